"""The rollup's total_time histogram buckets, without Spark: shared by the rollup transforms and
the console, which merges the stored histograms of many rows into percentiles and heatmaps.

Bucket ``k`` holds durations in ``(GAMMA^(k-1), GAMMA^k]`` milliseconds (as DDSketch does);
values below :data:`PERCENTILE_FLOOR_MS` (and zero or negative ones) share the lowest bucket.
:func:`bucket_value` is the bucket's midpoint in relative terms, within
:data:`PERCENTILE_RELATIVE_ERROR` of every value in it.
"""

from __future__ import annotations

import math

__all__ = [
    "GAMMA",
    "LOG_GAMMA",
    "PERCENTILE_FLOOR_MS",
    "PERCENTILE_RELATIVE_ERROR",
    "bucket_of",
    "bucket_value",
]

PERCENTILE_RELATIVE_ERROR = 0.01
PERCENTILE_FLOOR_MS = 0.001
GAMMA = (1 + PERCENTILE_RELATIVE_ERROR) / (1 - PERCENTILE_RELATIVE_ERROR)
LOG_GAMMA = math.log(GAMMA)


def bucket_of(milliseconds: float) -> int:
    return math.ceil(math.log(max(milliseconds, PERCENTILE_FLOOR_MS)) / LOG_GAMMA)


def bucket_value(bucket: int) -> float:
    return 2.0 * GAMMA**bucket / (GAMMA + 1)
