"""The ``keg`` source and ``taproom spark kegs`` on kegs written by the Lager keg writer
(``taproom.protocols.lager.keg.KegFileWriter``): a finished keg and an unfinished one whose
writer died (zero header, recovered from its sidecar, torn last record dropped)."""

from __future__ import annotations

import datetime as dt
import math
import random
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from taproom.protocols.lager.formats import parse_format_xml
from taproom.protocols.lager.keg import KegFileWriter, read_keg
from taproom.spark import transforms as T
from taproom.spark.jobs.kegs import run_kegs

pytestmark = pytest.mark.spark

MOTION = parse_format_xml(
    '<format version="BEERR01">'
    '<item name="speed" type="float64" size="8" offset="0"/>'
    '<item name="count" type="uint32_t" size="4" offset="8"/>'
    '<item name="temp" type="int16_t" size="2" offset="12"/>'
    '<item name="ok" type="bool" size="1" offset="14"/>'
    '<item name="xyz" type="float32" size="12" offset="15"/>'
    "</format>"
)
POWER = parse_format_xml(
    '<format version="BEERR01">'
    '<item name="volts" type="float32" size="4" offset="0"/>'
    '<item name="big" type="uint64_t" size="8" offset="4"/>'
    '<item name="label" type="string" size="8" offset="12"/>'
    "</format>"
)
U_MOTION, U_POWER = uuid.UUID(int=0xA1), uuid.UUID(int=0xB2)
T0 = 1_763_769_600_000_000_000  # 2025-11-22T00:00:00Z


def _write_kegs(root: Path) -> list[tuple[str, int, str, float]]:
    """Two kegs; returns every (tap, ts_ns, item, value) a reader should find."""
    rng = random.Random(3)
    samples: list[tuple[str, int, str, float]] = []
    root.mkdir()
    finished = KegFileWriter(
        root / "20251122_000000.lgr", {str(U_MOTION): MOTION, str(U_POWER): POWER}, fsync=False
    )
    unfinished = KegFileWriter(root / "20251122_010000.lgr", {str(U_MOTION): MOTION}, fsync=False)
    for i in range(400):
        ts = T0 + i * 1_500_000_000 + rng.randint(0, 999)
        xyz = [rng.uniform(-1, 1) for _ in range(3)]
        row = {
            "speed": rng.uniform(0, 30),
            "count": rng.randint(0, 2**32 - 1),
            "temp": rng.randint(-300, 300),
            "ok": rng.random() < 0.5,
            "xyz": xyz,
        }
        writer = finished if i % 2 else unfinished
        writer.write(U_MOTION.bytes, ts, MOTION.encode_row(row))
        decoded = MOTION.decode_row(MOTION.encode_row(row))  # float32 rounding as stored
        for name in ("speed", "count", "temp", "ok"):
            samples.append((str(U_MOTION), ts, name, float(decoded[name])))
        for k in range(3):
            samples.append((str(U_MOTION), ts, f"xyz[{k}]", float(decoded["xyz"][k])))
        if i % 5 == 0:
            power = {"volts": rng.uniform(11, 13), "big": 2**63 + i, "label": f"b{i}"}
            finished.write(U_POWER.bytes, ts, POWER.encode_row(power))
            decoded = POWER.decode_row(POWER.encode_row(power))
            samples.append((str(U_POWER), ts, "volts", float(decoded["volts"])))
            samples.append((str(U_POWER), ts, "big", float(decoded["big"])))
    finished.close()
    unfinished.flush()
    unfinished.abandon()  # the writer died: zero dataFormatOffset, sidecar left behind
    with open(root / "20251122_010000.lgr", "ab") as f:
        f.write(U_MOTION.bytes + b"\x00\x01")  # and a torn last record
    assert read_keg(root / "20251122_010000.lgr").recovered_unfinished
    return samples


@pytest.fixture(scope="module")
def kegs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    root = tmp_path_factory.mktemp("kegs") / "kegs"
    return root, _write_kegs(root)


def test_long_table_has_every_sample(spark: Any, kegs: tuple[Path, list[Any]]) -> None:
    root, samples = kegs
    rows = spark.read.format("keg").load(str(root)).collect()
    got = sorted((r["tap"], r["ts_ns"], r["item"], r["value"]) for r in rows)
    assert got == sorted(samples)
    first = min(rows, key=lambda r: r["ts_ns"])
    assert first["ts"] == dt.datetime(2025, 11, 22)  # naive UTC (conftest sets TZ)


def test_kegs_job_writes_typed_parquet_per_format(
    spark: Any, kegs: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    root, samples = kegs
    out = tmp_path / "out"
    uuids = run_kegs(spark, str(root), str(out))
    assert uuids == sorted([str(U_MOTION), str(U_POWER)])

    motion = spark.read.parquet(str(out / f"format={U_MOTION}"))
    assert dict(motion.dtypes) == {
        "keg": "string", "tap": "string", "ts": "timestamp", "ts_ns": "bigint",
        "speed": "double", "count": "bigint", "temp": "bigint", "ok": "boolean",
        "xyz": "array<float>",
    }  # fmt: skip
    rows = motion.collect()
    assert len(rows) == 400
    assert {Path(r["keg"]).name for r in rows} == {"20251122_000000.lgr", "20251122_010000.lgr"}
    by_ts = {(r["ts_ns"], "count"): r["count"] for r in rows}
    for tap, ts, item, value in samples:
        if tap == str(U_MOTION) and item == "count":
            assert by_ts[(ts, "count")] == value

    power = spark.read.parquet(str(out / f"format={U_POWER}")).collect()
    assert len(power) == 80
    assert {int(r["big"]) for r in power} == {2**63 + i for i in range(0, 400, 5)}
    assert {r["label"] for r in power} == {f"b{i}" for i in range(0, 400, 5)}

    # telemetry rollup: per tap, item and minute, against plain Python.
    expected: dict[tuple[Any, ...], list[tuple[int, float]]] = defaultdict(list)
    for tap, ts, item, value in samples:
        minute = dt.datetime.fromtimestamp(ts // 10**9, dt.UTC).replace(second=0, tzinfo=None)
        expected[(minute, tap, item)].append((ts, value))
    got = {
        (r["window_start"], r["tap"], r["item"]): r
        for r in spark.read.parquet(str(out / "telemetry")).collect()
    }
    assert set(got) == set(expected)
    for key, values in expected.items():
        row = got[key]
        numbers = [v for _, v in values]
        assert row["count"] == len(values)
        assert (row["min"], row["max"]) == (min(numbers), max(numbers))
        assert math.isclose(row["mean"], math.fsum(numbers) / len(numbers), rel_tol=1e-12)
        assert row["last"] == max(values)[1]
        assert row["window_end"] - row["window_start"] == dt.timedelta(minutes=1)


def test_telemetry_rollup_window_is_a_parameter(spark: Any, kegs: tuple[Path, list[Any]]) -> None:
    root, samples = kegs
    df = spark.read.format("keg").load(str(root))
    rows = df.transform(T.telemetry_rollup, "1 hour").collect()
    assert sum(r["count"] for r in rows) == len(samples)
    assert {r["window_end"] - r["window_start"] for r in rows} == {dt.timedelta(hours=1)}
