"""Shared pieces for benchmarks: figures, percentiles, peak RSS, child processes."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

__all__ = [
    "Figure",
    "cpu_seconds_of_pid",
    "peak_rss_mib",
    "percentile",
    "print_figures",
    "rss_of_pid_kib",
]


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    goal: str = ""  # e.g. ">= 500000": shown beside the figure, never asserted

    def line(self) -> str:
        value = f"{self.value:,.0f}" if abs(self.value) >= 100 else f"{self.value:,.3f}"
        goal = f"   (goal {self.goal})" if self.goal else ""
        return f"  {self.name:<58} {value:>14} {self.unit}{goal}"


def print_figures(figures: list[Figure]) -> None:
    for figure in figures:
        print(figure.line(), flush=True)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def peak_rss_mib(children: bool = False) -> float:
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return resource.getrusage(who).ru_maxrss / 1024


def rss_of_pid_kib(pid: int, field: str = "VmRSS") -> int:
    """Current resident set of another process (Linux); ``field="VmHWM"`` for its peak."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def cpu_seconds_of_pid(pid: int) -> float:
    """User + system CPU time of another process, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def cpu_count() -> int:
    return os.cpu_count() or 1
