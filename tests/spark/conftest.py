"""One local SparkSession for every Spark test (local[2], 2 shuffle partitions, UI off)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "pyspark", reason="the Spark tests need the spark extra (make test installs it)"
)

from tests.support import fast_jvm, local_spark

from .generate import GeneratedEvent, generate_events, write_journal


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    # Python workers must run this interpreter so they can import taproom (and import pyspark
    # from the installed package: spark_worker_python, set by local_spark).
    # collect() turns timestamps into naive datetimes in the local zone: make that UTC.
    os.environ["TZ"] = "UTC"
    time.tzset()
    session = local_spark("taproom-tests", fast_jvm())
    yield session
    session.stop()


@pytest.fixture(scope="session")
def logjam_events() -> list[GeneratedEvent]:
    return generate_events(3000, seed=11)


@pytest.fixture(scope="session")
def logjam_journal(tmp_path_factory: pytest.TempPathFactory, logjam_events: Any) -> Path:
    return write_journal(tmp_path_factory.mktemp("journal") / "j", logjam_events)
