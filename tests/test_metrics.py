"""taproom.metrics: tallies (the hot path's lock-free counters) expose exactly what
prometheus_client's own counters and histograms do."""

from __future__ import annotations

from taproom.metrics import Metrics

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 1)


def _exposition(metrics: Metrics) -> list[str]:
    # _created samples carry the creation time: the one line two registries never share
    return [line for line in metrics.render().decode().splitlines() if "_created" not in line]


def test_tallies_expose_what_prometheus_client_counts() -> None:
    plain, fast = Metrics(), Metrics()
    counter = plain.counter("hub", "commits", "calls", "Group commits")
    labeled = plain.counter("ingest", "accepted", "events", "Events", ("protocol",))
    histogram = plain.histogram("hub", "latency", "seconds", "Latency", BUCKETS)
    tally = fast.tally("hub", "commits", "calls", "Group commits")
    labeled_tally = fast.tally("ingest", "accepted", "events", "Events", protocol="logjam")
    fast_histogram = fast.tally_histogram("hub", "latency", "seconds", "Latency", BUCKETS)
    # on a bound, between bounds, zero, past the last bound (+Inf), fractions in the sum
    observations = [0.001, 0.0007, 0.0, 3.5, 0.0005, 0.01, 0.2, 0.00049]
    for i, seconds in enumerate(observations):
        counter.inc()
        tally.inc()
        labeled.labels(protocol="logjam").inc(i + 0.5)
        labeled_tally.inc(i + 0.5)
        histogram.observe(seconds)
        fast_histogram.observe(seconds)
    got = _exposition(fast)
    assert got == _exposition(plain)
    assert "taproom_hub_commits_calls_total 8.0" in got
    assert 'taproom_hub_latency_seconds_bucket{le="0.001"} 5.0' in got
    assert 'taproom_hub_latency_seconds_bucket{le="+Inf"} 8.0' in got


def test_a_tally_keeps_the_count_so_far_and_shares_it_with_the_counter() -> None:
    metrics = Metrics()
    counter = metrics.counter("journal", "fsync", "calls", "fsync calls")
    counter.inc(3)
    tally = metrics.tally("journal", "fsync", "calls", "fsync calls")
    tally.inc()
    counter.inc()  # the counter's own inc counts in the tally now
    assert metrics.tally("journal", "fsync", "calls", "fsync calls") is tally
    assert "taproom_journal_fsync_calls_total 5.0" in _exposition(metrics)
    assert tally.value == 5
