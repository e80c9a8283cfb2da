"""``taproom spark kegs``: Lager kegs → Parquet, one table per tap format, plus telemetry.

``out/format=<tap uuid>/`` holds each tap's samples with typed columns; ``out/telemetry/``
the per-minute :func:`~taproom.spark.transforms.telemetry_rollup` of every numeric item.
Both are overwritten on a re-run.
"""

from __future__ import annotations

import os
from typing import Any

from .. import transforms as T
from ..kegsource import keg_files, keg_formats

__all__ = ["run_kegs"]


def run_kegs(spark: Any, source: str, out: str, window: str = "1 minute") -> list[str]:
    """Write every format found in ``source`` and the telemetry rollup; returns the uuids."""
    files = keg_files({"path": source})
    formats = keg_formats(files)
    for uuid in sorted(formats):
        (
            spark.read.format("keg")
            .option("layout", "wide")
            .option("format", uuid)
            .load(source)
            .write.mode("overwrite")
            .parquet(os.path.join(out, f"format={uuid}"))
        )
    samples = spark.read.format("keg").load(source)
    (
        samples.transform(T.telemetry_rollup, window)
        .write.mode("overwrite")
        .parquet(os.path.join(out, "telemetry"))
    )
    return sorted(formats)
