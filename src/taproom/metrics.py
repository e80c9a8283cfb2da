"""Prometheus metrics with taproom's naming rule and bounded labels.

Names read ``taproom_<component>_<name>_<unit>_total`` for counters (prometheus-client adds the
``_total``); labels are drawn only from bounded sets: protocol, listener, reason, output, kind, loop. Each
:class:`Metrics` owns its registry so several hubs can live in one test process.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics", "Tally", "TallyHistogram"]

# "loop": a supervised loop's name, fixed in the code (taproom.supervise).
_ALLOWED_LABELS = frozenset(
    {"protocol", "listener", "reason", "output", "segment_state", "kind", "holder", "loop"}
)


class Tally:
    """A counter's value as a plain number, for the per-commit hot path (issue 32: a
    prometheus_client ``inc`` takes a lock and checks the metric each time, ~1.3 us; a request
    committed alone paid a dozen). It stands in for the counter's own value object, so the
    counter and /metrics are unchanged: ``get`` is read at scrape time.

    One writer at a time: ``inc`` is not atomic across threads. Use it only where the writer is
    the event loop, or the journal's write side (the write lock serializes it)."""

    __slots__ = ("value",)

    def __init__(self, value: float = 0.0) -> None:
        self.value = float(value)  # a float, as prometheus_client's own: the same exposition

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    # prometheus_client's value interface (values.MutexValue), what its Counter calls.
    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def get(self) -> float:
        return self.value

    def set_exemplar(self, exemplar: object) -> None:
        pass  # taproom sets no exemplars

    def get_exemplar(self) -> None:
        return None


class TallyHistogram:
    """``observe`` of a histogram (no labels) on :class:`Tally` values: its sum and buckets,
    the same samples at scrape time. Same one-writer rule as :class:`Tally`."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, histogram: Histogram) -> None:
        self._bounds = list(histogram._upper_bounds)  # ends with +Inf
        self._buckets = [_tally_of(histogram._buckets, i) for i in range(len(self._bounds))]
        self._sum = _tally_of(histogram, "_sum")

    def observe(self, amount: float) -> None:
        self._sum.value += amount
        # prometheus_client counts an observation in the first bucket whose bound is >= it
        self._buckets[bisect.bisect_left(self._bounds, amount)].value += 1


def _tally_of(owner: Any, key: Any) -> Tally:
    """The Tally in ``owner``'s value slot ``key`` (an attribute name or a list index),
    put there first (keeping the value so far) if it is still prometheus_client's own."""
    value = owner[key] if isinstance(key, int) else getattr(owner, key)
    if isinstance(value, Tally):
        return value
    tally = Tally(value.get())
    if isinstance(key, int):
        owner[key] = tally
    else:
        setattr(owner, key, tally)
    return tally


class Metrics:
    """Get-or-create access to counters, gauges and histograms on one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Any] = {}
        # accepted()'s two counters per protocol, looked up once: it runs once per commit
        # group of every protocol (a label lookup takes a lock and builds a key each time)
        self._accepted: dict[str, tuple[Tally, Tally]] = {}

    def _get(self, kind: type, name: str, doc: str, labels: Sequence[str], **kw: Any) -> Any:
        bad = set(labels) - _ALLOWED_LABELS
        if bad:
            raise ValueError(f"unbounded label(s) {sorted(bad)} on {name}")
        metric = self._metrics.get(name)
        if metric is None:
            metric = kind(name, doc, labelnames=tuple(labels), registry=self.registry, **kw)
            self._metrics[name] = metric
        return metric

    def collect(self, names: frozenset[str]) -> list[Any]:
        """The metric families of the metrics called ``names`` (as created, without the
        ``_total`` of counters), not the whole registry: the console's per-second sample
        reads a dozen of the hundreds a hub has."""
        families = []
        for name in names:
            metric = self._metrics.get(name)
            if metric is not None:
                families.extend(metric.collect())
        return families

    def counter(
        self, component: str, name: str, unit: str, doc: str, labels: Sequence[str] = ()
    ) -> Counter:
        """``taproom_<component>_<name>_<unit>_total``."""
        return self._get(Counter, f"taproom_{component}_{name}_{unit}", doc, labels)

    def tally(self, component: str, name: str, unit: str, doc: str, **labels: str) -> Tally:
        """:meth:`counter` (its child of ``labels``) counted through a :class:`Tally`: a
        hot path's counter with one writer at a time (the loop, or the journal's write side)."""
        counter = self.counter(component, name, unit, doc, tuple(labels))
        return _tally_of(counter.labels(**labels) if labels else counter, "_value")

    def tally_histogram(
        self, component: str, name: str, unit: str, doc: str, buckets: Sequence[float]
    ) -> TallyHistogram:
        """:meth:`histogram` (no labels) observed through :class:`TallyHistogram`."""
        return TallyHistogram(self.histogram(component, name, unit, doc, buckets))

    def gauge(
        self, component: str, name: str, unit: str, doc: str, labels: Sequence[str] = ()
    ) -> Gauge:
        return self._get(Gauge, f"taproom_{component}_{name}_{unit}", doc, labels)

    def gauge_fn(
        self, component: str, name: str, unit: str, doc: str, fn: Callable[[], float]
    ) -> None:
        """A gauge read at scrape time (queue fill levels, segment counts)."""
        self.gauge(component, name, unit, doc).set_function(fn)

    def histogram(
        self,
        component: str,
        name: str,
        unit: str,
        doc: str,
        buckets: Sequence[float],
        labels: Sequence[str] = (),
    ) -> Histogram:
        return self._get(
            Histogram, f"taproom_{component}_{name}_{unit}", doc, labels, buckets=tuple(buckets)
        )

    def rejected(self, protocol: str, reason: str, count: int = 1) -> None:
        """Count input refused by a protocol: a frame, message, connection or event."""
        self.counter(
            "ingest",
            "rejected",
            "items",
            "Frames, messages or connections refused, by reason",
            ("protocol", "reason"),
        ).labels(protocol=protocol, reason=reason).inc(count)

    def accepted(self, protocol: str, count: int, nbytes: int) -> None:
        """Count events a protocol handed to the journal (acked once committed), and their bytes.

        ``nbytes`` is the size of the encoded journal records, the same measure for every
        protocol (wire bytes differ by framing and compression).
        """
        children = self._accepted.get(protocol)
        if children is None:
            # Tallies: every protocol submits on the loop (Hub.submit needs it), one writer
            events = self.tally(
                "ingest",
                "accepted",
                "events",
                "Events handed to the journal, by protocol",
                protocol=protocol,
            )
            size = self.tally(
                "ingest",
                "accepted",
                "bytes",
                "Bytes of journal records handed to the journal, by protocol",
                protocol=protocol,
            )
            children = self._accepted[protocol] = (events, size)
        children[0].value += count
        children[1].value += nbytes

    def odd(self, protocol: str, reason: str, count: int = 1) -> None:
        """Count events accepted and stored with a caveat (a body that is not JSON, an event
        time the journal cannot hold: taproom.eventtime)."""
        self.counter(
            "ingest",
            "odd",
            "events",
            "Events accepted and stored with a caveat, by reason",
            ("protocol", "reason"),
        ).labels(protocol=protocol, reason=reason).inc(count)

    def connections(self, protocol: str, listener: str) -> Gauge:
        """Open connections of one listener."""
        return self.gauge(
            "ingest",
            "open_connections",
            "count",
            "Open connections by listener",
            ("protocol", "listener"),
        ).labels(protocol=protocol, listener=listener)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
