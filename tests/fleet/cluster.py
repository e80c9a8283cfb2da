"""A real Spark standalone cluster on this machine, from pyspark's own distribution.

One master and ``workers`` workers, each a JVM of its own (``spark-class ...Master`` and
``...Worker``, as ``sbin/start-*.sh`` would start them); applications go in with the real
``spark-submit --master spark://...`` and their executors are further JVMs started by the
workers, each with its own Python workers. Everything binds 127.0.0.1 and lives in a work
directory the test owns.

The JVMs run with the client compiler only and the serial collector, and map the class archive of
Spark's jars once written (``fast_jvm``, tests/jvm_archive.py): on a small
shared machine that halves their start-up time, which dominates jobs this short. A real cluster
leaves both at their defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pyspark

from tests.support import descendants, fast_jvm, free_port, spark_worker_python

__all__ = ["SPARK_HOME", "SparkCluster", "descendants"]

SPARK_HOME = Path(pyspark.__file__).parent


def _python_driver(pid: int) -> int | None:
    """The Python process ``spark-submit``'s JVM runs the application in."""
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"driver.py" in f.read():
                    return child
        except OSError:
            continue
    return None


def kill_tree(proc: subprocess.Popen[bytes], signum: int = signal.SIGKILL) -> int | None:
    """Signal ``proc``, wait for it and everything it started (so two drivers never share a
    checkpoint); what is still there after a minute is killed outright.

    A SIGTERM goes to the Python driver under ``spark-submit`` (it stops its queries cleanly
    and the JVM exits with its code); a SIGKILL to the JVM and all it started at once (the
    driver's machine is gone)."""
    family = descendants(proc.pid)
    target = _python_driver(proc.pid) if signum == signal.SIGTERM else None
    with contextlib.suppress(ProcessLookupError):
        if target is not None:
            os.kill(target, signum)
        else:
            proc.send_signal(signum)
    if signum == signal.SIGKILL:
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait(10)
    deadline = time.monotonic() + 60
    for pid in family:
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return code


class SparkCluster:
    def __init__(self, work: Path, *, workers: int = 2, cores: int = 1, memory: str = "1g") -> None:
        self.work = work
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.ui_port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "SPARK_HOME": str(SPARK_HOME),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOG_DIR": str(work / "logs"),
            "SPARK_LOCAL_DIRS": str(work / "local"),
            "SPARK_DAEMON_JAVA_OPTS": fast_jvm(),
            "PYSPARK_PYTHON": spark_worker_python(),
        }

    def _daemon(self, name: str, args: list[str]) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 -- owned by the child
        self.processes.append(
            subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *args],
                stdout=log,
                stderr=log,
                env=self.env,
                start_new_session=True,
            )
        )
        log.close()

    def start(self) -> SparkCluster:
        self.work.mkdir(parents=True, exist_ok=True)
        self._daemon(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host", "127.0.0.1",
                "--port", str(self.port),
                "--webui-port", str(self.ui_port),
            ],
        )  # fmt: skip
        for i in range(self.workers):
            self._daemon(
                f"worker{i}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    "--host", "127.0.0.1",
                    "--cores", str(self.cores),
                    "--memory", self.memory,
                    "--webui-port", "0",
                    "--work-dir", str(self.work / f"worker{i}"),
                    self.url,
                ],
            )  # fmt: skip
        return self

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return dict(json.loads(r.read()))

    def wait_ready(self, timeout: float = 240) -> None:
        """Until every worker has registered with the master."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError):
                alive = [w for w in self.state()["workers"] if w["state"] == "ALIVE"]
                if len(alive) == self.workers:
                    return
            for proc in self.processes:
                if proc.poll() is not None:
                    raise RuntimeError(f"a cluster JVM exited {proc.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not registered in {timeout}s: {self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.work.glob("*.log"))
        )

    def submit(
        self,
        args: list[str],
        log: Path,
        *,
        cores: int | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """``spark-submit --master spark://...`` of ``taproom spark <args>`` (the driver file
        taproom ships for it); the driver runs here (client mode), executors on the workers."""
        from taproom.spark import driver

        conf = {
            "spark.executor.memory": "512m",
            "spark.executor.cores": "1",
            "spark.cores.max": str(cores or self.workers * self.cores),
            "spark.ui.enabled": "false",
            # This interpreter, importing pyspark from the installed package
            # (tests.support.spark_worker_python): the driver too, spark-submit puts
            # Spark's pyspark.zip on its path as well.
            "spark.pyspark.python": spark_worker_python(),
            "spark.pyspark.driver.python": spark_worker_python(),
            "spark.executor.extraJavaOptions": fast_jvm(),
            "spark.sql.shuffle.partitions": "2",
        }
        command = [str(SPARK_HOME / "bin" / "spark-submit"), "--master", self.url]
        command += ["--driver-java-options", fast_jvm()]
        for key, value in conf.items():
            command += ["--conf", f"{key}={value}"]
        command += [driver.__file__, *args]
        out = open(log, "ab")  # noqa: SIM115 -- owned by the child
        proc = subprocess.Popen(command, stdout=out, stderr=out, env={**self.env, **(env or {})})
        out.close()
        return proc

    def stop(self) -> None:
        """Workers first (they take their executors down), then the master."""
        for proc in reversed(self.processes):
            kill_tree(proc, signal.SIGTERM)
        self.processes.clear()

    def __enter__(self) -> SparkCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
