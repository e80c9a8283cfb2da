"""``taproom serve`` as a child process: the one launcher of tests (restart, SIGKILL, memory
tests) and benches (the hub measured apart from its load generators).

Imports nothing from pytest, so ``python -m bench`` uses it as it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

import orjson

__all__ = ["HubProcess"]


class HubProcess:
    """``taproom serve --config <config_path>``; its log beside the config (``.log``).

    ``start`` waits for the ready file and reads the listeners' addresses from it;
    ``preexec_fn`` runs in the child before exec (benches pin CPUs or lower priority).
    """

    def __init__(
        self,
        config_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self.ready_file = self.config_path.with_suffix(".ready.json")
        self.log_path = self.config_path.with_suffix(".log")
        self.env = {**os.environ, **(env or {})}
        self.preexec_fn = preexec_fn
        self.proc: subprocess.Popen[bytes] | None = None
        self.addresses: dict[str, str] = {}
        self.journal_id = ""  # the journal's identity, from the ready file
        self.starts = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> HubProcess:
        with contextlib.suppress(FileNotFoundError):
            self.ready_file.unlink()
        log = open(self.log_path, "ab")  # noqa: SIM115 -- owned by the child process
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "taproom",
                "serve",
                "--config",
                str(self.config_path),
                "--ready-file",
                str(self.ready_file),
            ],
            stdout=log,
            stderr=log,
            env=self.env,
            preexec_fn=self.preexec_fn,
        )
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                ready = orjson.loads(self.ready_file.read_bytes())
                self.addresses = ready["listeners"]
                self.journal_id = ready["journal_id"]
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"taproom serve exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)
        self.kill()
        raise TimeoutError(f"taproom serve not ready in {timeout}s:\n{self.log()}")

    def address(self, name: str) -> tuple[str, int]:
        host, port = self.addresses[name].rsplit(":", 1)
        return host, int(port)

    def metric(self, name: str) -> float:
        """One unlabelled sample of the hub's /metrics (0 when absent): needs [web]."""
        with urllib.request.urlopen(f"http://{self.addresses['web']}/metrics", timeout=30) as r:
            text = r.read().decode()
        found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait for the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
        if self.proc is None:
            return
        try:
            self.terminate(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, timeout: float = 60.0) -> HubProcess:
        self.kill()
        return self.start(timeout)

    def __enter__(self) -> HubProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
