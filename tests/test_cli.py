"""The real `taproom` console script: validate, serve, journal stats/check, tail."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from taproom.journal import Journal
from taproom.records import BatchBuilder

TAPROOM = shutil.which("taproom", path=str(Path(sys.executable).parent)) or "taproom"


def run(
    *args: str, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPROOM_")}
    return subprocess.run(
        [TAPROOM, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def make_journal(path: Path) -> None:
    j = Journal(path)
    b = BatchBuilder()
    b.add("lumberjack", b'{"message":"hello"}', stream="shop", topic="log", content_type="json")
    b.add("logtk", b"plain text", stream="web", topic="x", content_type="raw")
    b.add("eventbus", bytes.fromhex("81a16101"), stream="/a/", content_type="msgpack")
    j.commit([b.build()])
    j.close()


def test_validate_valid_and_invalid(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text("[web]\nport = 0\n")
    assert run("validate", "--config", str(good)).returncode == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[web]\nport = -1\n")
    result = run("validate", "--config", str(bad))
    assert result.returncode == 78
    assert f"{bad}:2: web.port" in result.stderr


def test_validate_warns_about_a_retired_key_and_exits_0(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("[eventbus]\ncollector_hwm = 32\n")
    result = run("validate", "--config", str(old))
    assert result.returncode == 0, result.stderr
    assert f"taproom: warning: {old}:2: eventbus.collector_hwm: retired, ignored: " in (
        result.stderr
    )


@pytest.mark.parametrize("command", [["validate"], ["config", "defaults"], ["serve", "--help"]])
def test_core_commands_import_no_plugin(command):
    """`taproom serve` (every hub's start), validate, config and journal parse without the
    plugins' commands; every other command, and `taproom --help`, still sees them all."""
    from taproom.cli import CLI_PLUGINS

    code = (
        "import sys, taproom.cli as c\n"
        "try:\n"
        f"    c.main({command!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        # zmqaccess is a plugin (its keygen command) and the hub's own access check as well.
        "print(sorted(m for m in sys.modules if m in c.CLI_PLUGINS and m != 'taproom.zmqaccess'),"
        " file=sys.stderr)"
    )
    core = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert core.stderr.strip().splitlines()[-1] == "[]", core.stderr
    every = run("--help")
    assert every.returncode == 0
    for name in ("send", "tail", "spark", "top"):
        assert name in every.stdout, every.stdout
    assert "taproom.clients.logjam" in CLI_PLUGINS


def test_validate_missing_file(tmp_path):
    result = run("validate", "--config", str(tmp_path / "nope.toml"))
    assert result.returncode == 78 and "cannot read" in result.stderr


def test_tail_prints_committed_events_with_decoded_payloads(tmp_path):
    make_journal(tmp_path / "j")
    result = run("tail", "--journal", str(tmp_path / "j"))
    assert result.returncode == 0, result.stderr
    lines = [orjson.loads(line) for line in result.stdout.splitlines()]
    assert [e["offset"] for e in lines] == [0, 1, 2]
    assert lines[0]["payload"] == {"message": "hello"}
    assert lines[1]["payload"] == "plain text"
    assert lines[2]["payload"] == {"a": 1}
    filtered = run("tail", "--journal", str(tmp_path / "j"), "--protocol", "logtk")
    assert [orjson.loads(x)["protocol"] for x in filtered.stdout.splitlines()] == ["logtk"]
    from_one = run("tail", "--journal", str(tmp_path / "j"), "--from", "1", "--stream", "/a/")
    assert [orjson.loads(x)["offset"] for x in from_one.stdout.splitlines()] == [2]


def test_tail_shows_a_field_that_is_not_utf8(tmp_path):
    """A logjam routing key is any bytes after its prefix (logjam-device's well_formed_topic):
    stored as it came, shown with U+FFFD, the line still JSON."""
    from taproom.protocols import logjam as lj

    j = Journal(tmp_path / "j")
    parser = lj.IngestParser(max_body=1024, max_decompressed=1024)
    b = BatchBuilder()
    parser.add(b, [b"app-prod", b"logs.\xff x", b"{}", lj.encode_meta(0, 1, 2, 3)])
    j.commit([b.build()])
    j.close()
    result = run("tail", "--journal", str(tmp_path / "j"))
    assert result.returncode == 0, result.stderr
    assert [orjson.loads(x)["topic"] for x in result.stdout.splitlines()] == ["logs.\ufffd x"]


def test_tail_follow_sees_new_events(tmp_path):
    make_journal(tmp_path / "j")
    proc = subprocess.Popen(
        [
            TAPROOM,
            "tail",
            "--journal",
            str(tmp_path / "j"),
            "--follow",
            "--from",
            "3",
            "--limit",
            "1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    j = Journal(tmp_path / "j")
    b = BatchBuilder()
    b.add("t", b'"later"', content_type="json")
    j.commit([b.build()])
    j.close()
    out, _ = proc.communicate(timeout=30)
    assert orjson.loads(out)["payload"] == "later"


def test_journal_stats_and_check(tmp_path):
    make_journal(tmp_path / "j")
    stats = json.loads(run("journal", "stats", "--journal", str(tmp_path / "j"), "--json").stdout)
    assert stats["events"] == 3 and stats["segments"] == 1 and stats["last_offset"] == 2
    assert run("journal", "check", "--journal", str(tmp_path / "j")).returncode == 0
    seg = next((tmp_path / "j").glob("*.seg"))
    with open(seg, "ab") as f:
        f.write(b"torn")
    assert run("journal", "check", "--journal", str(tmp_path / "j")).returncode == 1
    assert run("journal", "check", "--journal", str(tmp_path / "j"), "--repair").returncode == 0
    assert run("journal", "check", "--journal", str(tmp_path / "j")).returncode == 0


def test_serve_writes_ready_file_and_exits_zero_on_sigterm(tmp_path):
    config = tmp_path / "t.toml"
    config.write_text(
        f'[journal]\ndir = "{tmp_path / "j"}"\n[web]\nport = 0\n'
        + "".join(
            f"[{s}]\nenabled = false\n"
            for s in ("lumberjack", "logtk", "logjam", "eventbus", "lager")
        )
    )
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [TAPROOM, "serve", "--config", str(config), "--ready-file", str(ready)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(300):
            if ready.exists():
                break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            subprocess.run(["sleep", "0.05"])
        listeners = json.loads(ready.read_text())["listeners"]
        assert listeners["web"].startswith("127.0.0.1:")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopped cleanly" in err
    assert not ready.exists()


def test_config_defaults_lists_reasons():
    result = run("config", "defaults")
    assert result.returncode == 0
    assert "journal.fsync = 'always'  # ack only what is on disk" in result.stdout


def _serve_config(tmp_path: Path, journal: Path, **ports: int) -> Path:
    """Web and Lumberjack on (ports given or 0), every other service off."""
    config = tmp_path / "serve.toml"
    config.write_text(
        f'[journal]\ndir = "{journal}"\n'
        f"[web]\nport = {ports.get('web', 0)}\n"
        f"[lumberjack]\nport = {ports.get('lumberjack', 0)}\n"
        + "".join(f"[{s}]\nenabled = false\n" for s in ("logtk", "logjam", "eventbus", "lager"))
    )
    return config


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The last stderr line, after checking no traceback was printed."""
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["validate", "serve"])
def test_config_not_utf8_is_one_line_exit_78(tmp_path, command):
    config = tmp_path / "latin1.toml"
    config.write_bytes(b'[hub]\nname = "caf\xe9"\n')
    result = run(command, "--config", str(config))
    assert result.returncode == 78
    assert _one_line_error(result).startswith(f"taproom: config error: {config}:2: not UTF-8")


@pytest.mark.parametrize("command", ["validate", "serve"])
@pytest.mark.parametrize("below", ["", "/sub"])
def test_journal_dir_that_is_a_file_is_one_line_exit_78(tmp_path, command, below):
    afile = tmp_path / "afile"
    afile.write_text("")
    result = run(command, "--config", str(_serve_config(tmp_path, Path(f"{afile}{below}"))))
    assert result.returncode == 78
    line = _one_line_error(result)
    assert line.startswith("taproom: config error: ") and ":2: journal.dir: " in line
    assert f"{afile} is not a directory" in line


def test_journal_dir_that_cannot_be_created_is_one_line_exit_1(tmp_path):
    # Nobody, not even root, can create a directory in /proc: a runtime error, not config.
    journal = Path("/proc/taproom-test/journal")
    result = run("serve", "--config", str(_serve_config(tmp_path, journal)))
    assert result.returncode == 1
    assert _one_line_error(result) == (
        f"taproom: journal.dir {journal}: cannot open: No such file or directory"
        " (/proc/taproom-test)"
    )


@pytest.mark.parametrize("listener", ["web", "lumberjack"])
def test_listener_port_in_use_is_one_line_exit_1(tmp_path, listener):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _serve_config(tmp_path, tmp_path / "j", **{listener: port})
        assert run("validate", "--config", str(config)).returncode == 0
        result = run("serve", "--config", str(config))
    assert result.returncode == 1
    line = _one_line_error(result)
    assert line.startswith(f"taproom: [{listener}] cannot listen: ")
    assert f"('127.0.0.1', {port})" in line and "address already in use" in line


def test_zmq_port_in_use_is_one_line_exit_1(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "zmq.toml"
        config.write_text(
            f'[journal]\ndir = "{tmp_path / "j"}"\n[web]\nport = 0\n'
            f"[logjam]\nrouter_port = {port}\npull_port = 0\npub_port = 0\nreplay_port = 0\n"
            + "".join(
                f"[{s}]\nenabled = false\n" for s in ("lumberjack", "logtk", "eventbus", "lager")
            )
        )
        result = run("serve", "--config", str(config))
    assert result.returncode == 1
    line = _one_line_error(result)
    # The ROUTER is taproom's own ZMTP transport on asyncio now (asyncio names the address as
    # a tuple); libzmq's sockets name the endpoint. Either way the line names the port.
    assert line.startswith("taproom: [logjam] cannot listen: ")
    assert str(port) in line and "already in use" in line.lower()
