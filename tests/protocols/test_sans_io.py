"""DESIGN decision 1: protocol cores do no I/O and read no clock.

Checked on the source (imports and calls) so that a new protocol module is covered the day it
lands, without a list to keep up to date.
"""

from __future__ import annotations

import ast
from pathlib import Path

import taproom.protocols

FORBIDDEN_MODULES = {"socket", "asyncio", "ssl", "zmq", "selectors", "threading", "websockets"}
FORBIDDEN_CALLS = {
    ("time", "time"),
    ("time", "time_ns"),
    ("time", "monotonic"),
    ("time", "monotonic_ns"),
    ("time", "sleep"),
    ("datetime", "now"),
    ("datetime", "utcnow"),
}

ROOT = Path(taproom.protocols.__file__).parent


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    found.append(f"{path.name}:{node.lineno} imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{path.name}:{node.lineno} imports from {node.module}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            if (name, node.func.attr) in FORBIDDEN_CALLS:
                found.append(f"{path.name}:{node.lineno} calls {name}.{node.func.attr}()")
    return found


def test_protocol_package_is_scanned():
    # the check below must look at real files, not an empty directory
    assert (ROOT / "__init__.py") in _modules()


def test_protocol_cores_do_no_io_and_read_no_clock():
    problems = [v for path in _modules() for v in _violations(path)]
    assert problems == []


def test_the_checker_catches_io(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import socket\nfrom zmq import Socket\nimport time\nt = time.monotonic()\n")
    assert len(_violations(bad)) == 3
