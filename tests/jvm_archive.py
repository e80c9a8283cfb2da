"""A class-data-sharing archive of Spark's classes for the JVMs the tests start.

Every Spark JVM of the suite (the two local sessions, each stream driver, the standalone
cluster's master, workers, drivers and executors) loads and verifies the same ~15,000 classes
of Spark's jars at start: about half of a JVM's CPU for a short test. Java 17's dynamic
class-data sharing (AppCDS) writes the classes a JVM loaded to an archive when it exits
(``-XX:ArchiveClassesAtExit``); a JVM started with ``-XX:SharedArchiveFile`` maps them
ready-made. Measured on the 2-core machine: a local session's start, one query and stop took
12.4-12.6 CPU-s without the archive and 5.9-6.2 with it (docs/testing.md).

``make unit`` runs ``python -m tests.jvm_archive`` in the background as the suite starts
(when the archive is missing or older than the venv): a small query through one local session
whose JVM writes the archive, then renamed into place (a JVM never sees half a file).
``tests.support.fast_jvm()`` adds the archive to a JVM's options, waiting for the writer if it
is still at work; without an archive a JVM runs exactly as it would anyway. The archive is
only an optimisation of the JVM's start: the same classes from the same jars, checked by the
JVM against the jars' sizes and times (a venv installed again makes it stale: the JVM then
ignores it, silently, and `make` writes it again).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE = ROOT / "build" / "jvm" / "spark.jsa"

# A JVM that cannot use the archive (a jar changed, another JDK) says so on its stdout, which
# some tests read: the archive's own log lines are turned off.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


# The writer's pid, while `make unit` runs one beside the suite.
WRITER = ARCHIVE.with_name(ARCHIVE.name + ".writer")
# How long a JVM's start waits for the writer: the archive was in place ~45 s after the suite
# started in quiet clean-clone runs, ~100 s at load ~12; a writer that takes longer is not
# waited for.
WAIT_S = 120.0


def _writer_running() -> bool:
    try:
        pid = int(WRITER.read_text())
    except (OSError, ValueError):
        return False
    return os.path.exists(f"/proc/{pid}")


def archive_options() -> str:
    """The JVM options that use the archive. While `make unit`'s writer is still at work, wait
    for it (on a worker that has nothing else to do: the tests beside it run on): a JVM
    started without the archive costs the whole suite ~9 CPU-s more. "" without an archive."""
    deadline = time.monotonic() + WAIT_S
    while not ARCHIVE.is_file() and _writer_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    return f"-XX:SharedArchiveFile={ARCHIVE} {QUIET}" if ARCHIVE.is_file() else ""


def _exercise(dump: str) -> None:
    """Run in a child: a session whose JVM dumps its classes to ``dump`` when it exits. A
    small query and a Parquet write and read: the classes every Spark JVM of the tests loads.
    (A whole rollup and a stream besides made an archive that saved ~2 CPU-s more a JVM but
    took three times as long to write, while the first Spark tests wait for it.)"""
    from tests.support import FAST_JVM, local_spark

    spark = local_spark("taproom-jvm-archive", f"{FAST_JVM} -XX:ArchiveClassesAtExit={dump}")
    print(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid(), flush=True)
    with tempfile.TemporaryDirectory(prefix="taproom-jvm-archive-") as work:
        counts = spark.range(1000).selectExpr("id % 7 AS k", "id").groupBy("k").count()
        counts.write.parquet(f"{work}/counts")
        assert len(spark.read.parquet(f"{work}/counts").collect()) == 7
    spark.stop()


def write_archive(path: Path = ARCHIVE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    dump = f"{path}.{os.getpid()}.tmp"
    child = subprocess.run(
        [sys.executable, "-m", "tests.jvm_archive", "--exercise", dump],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        timeout=600,
        check=True,
    )
    jvm = int(child.stdout.split()[0])
    # The JVM writes the archive as it exits, after its Python side is gone.
    deadline = time.monotonic() + 300
    while os.path.exists(f"/proc/{jvm}") and time.monotonic() < deadline:
        time.sleep(0.2)
    if not os.path.isfile(dump) or os.path.getsize(dump) == 0:
        raise SystemExit(f"the JVM {jvm} wrote no class archive to {dump}")
    os.replace(dump, path)
    print(f"{path}: {os.path.getsize(path) >> 20} MiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--exercise"]:
        _exercise(sys.argv[2])
    else:
        write_archive(Path(sys.argv[1]) if len(sys.argv) > 1 else ARCHIVE)
