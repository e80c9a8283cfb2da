"""A journal's identity: created with it, stable, shown by the hub and the tools, never replaced."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
import uuid
from pathlib import Path

import pytest

from taproom.errors import JournalError
from taproom.journal import ID_FILE, Journal, JournalReader, journal_id, read_journal_id
from taproom.records import BatchBuilder
from tests.support import HubProcess, write_config

TAPROOM = str(Path(sys.executable).with_name("taproom"))


def _commit(journal: Journal, n: int) -> None:
    builder = BatchBuilder()
    for i in range(n):
        builder.add("test", f"event {i}".encode())
    journal.commit([builder.build()])


def test_created_with_the_journal_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "j"
    journal = Journal(path)
    first = journal.id
    assert uuid.UUID(first) and journal.stats()["id"] == first
    _commit(journal, 3)
    journal.close()
    assert Journal(path).id == first == JournalReader(path).id == read_journal_id(path)
    assert (path / ID_FILE).read_text().strip() == first


def test_an_old_journal_gets_one_on_open(tmp_path: Path) -> None:
    path = tmp_path / "old"
    journal = Journal(path)
    _commit(journal, 5)
    journal.close()
    (path / ID_FILE).unlink()  # as journals were before identities
    assert JournalReader(path).id is None  # a reader never writes
    reopened = Journal(path)
    assert reopened.id and read_journal_id(path) == reopened.id
    assert [r.offset for r in reopened.read()] == list(range(5))  # its data untouched
    reopened.close()


def test_concurrent_creators_agree(tmp_path: Path) -> None:
    path = tmp_path / "j"
    path.mkdir()
    ids: list[str] = []
    start = threading.Barrier(8)

    def create() -> None:
        start.wait()
        ids.append(journal_id(path))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and read_journal_id(path) == ids[0]
    assert [p.name for p in path.iterdir()] == [ID_FILE]  # no temporary file left


def test_a_damaged_id_is_refused_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "j"
    Journal(path).close()
    (path / ID_FILE).write_bytes(b"not-a-uuid\n")
    with pytest.raises(JournalError, match="damaged"):
        Journal(path)
    assert (path / ID_FILE).read_bytes() == b"not-a-uuid\n"


def test_shown_in_ready_file_api_and_journal_stats(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    with HubProcess(config) as hub:
        expected = read_journal_id(tmp_path / "journal")
        assert hub.journal_id == expected
        with urllib.request.urlopen(f"http://{hub.addresses['web']}/api/overview") as reply:
            assert json.loads(reply.read())["journal"]["id"] == expected
        with urllib.request.urlopen(f"http://{hub.addresses['web']}/api/journal") as reply:
            assert json.loads(reply.read())["id"] == expected
    stats = subprocess.run(
        [TAPROOM, "journal", "stats", "--json", "--journal", str(tmp_path / "journal")],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert json.loads(stats.stdout)["id"] == expected
