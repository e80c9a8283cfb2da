"""The ``taproom`` command.

Core commands live here (serve, validate, tail, journal, config). Protocol and pipeline commands
plug in: each module in :data:`CLI_PLUGINS` may define

* ``register_send(subparsers)``  -- add ``taproom send <protocol>``;
* ``register_tail(parser)``      -- add options to ``taproom tail`` and return a handler
  ``handler(args) -> int | None`` (None: not this plugin's options, fall through);
* ``register_commands(subparsers)`` -- add top-level commands (``keg``, ``spark``).

Parsers set ``func(args) -> int`` as their default. Plugins must import heavy dependencies
(pyspark) lazily, inside ``func``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from .config import describe_defaults, load_config
from .errors import ConfigError, JournalError, TaproomError

__all__ = ["CLI_PLUGINS", "main"]

CLI_PLUGINS = (
    "taproom.clients.lumberjack",
    "taproom.clients.logtk",
    "taproom.clients.logjam",
    "taproom.clients.eventbus",
    "taproom.clients.lager",
    "taproom.spark.cli",
    "taproom.web.top",
    "taproom.zmqaccess",
)

EX_CONFIG = 78  # sysexits.h EX_CONFIG

# Commands of this module alone: their parser needs no plugin, so `taproom serve` (every hub's
# start) and the journal and config commands import none (the clients, Spark's CLI, the console:
# ~0.1 CPU-s a start, measured).
CORE_COMMANDS = frozenset({"serve", "validate", "config", "journal"})


def _plugins() -> list[Any]:
    modules = []
    for name in CLI_PLUGINS:
        try:
            modules.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return modules


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        metavar="PATH",
        default=os.environ.get("TAPROOM_CONFIG"),
        help="TOML configuration (default: embedded defaults; env TAPROOM_CONFIG)",
    )


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from .app import run_app

    config = load_config(args.config)
    _setup_logging(config.hub.log_level)
    return asyncio.run(run_app(config, args.ready_file))


def cmd_validate(args: argparse.Namespace) -> int:
    from .access import open_listeners

    config = load_config(args.config)
    exposed = open_listeners(config)
    if exposed:
        print(f"taproom: warning: {_open_warning(exposed)}", file=sys.stderr)
    for warning in config.warnings:
        print(f"taproom: warning: {warning}", file=sys.stderr)
    print(f"{config.source or '<defaults>'}: valid ({len(config.names)} sections)")
    return 0


def _open_warning(exposed: list[str]) -> str:
    return (
        f"open = true: {', '.join(exposed)} accept{'s' if len(exposed) == 1 else ''} "
        "connections from any address, with no access control"
    )


def cmd_config_defaults(args: argparse.Namespace) -> int:
    for section, key, default, why in describe_defaults():
        print(f"{section}.{key} = {default!r}  # {why}")
    return 0


def _journal_dir(args: argparse.Namespace) -> str:
    if getattr(args, "journal", None):
        return str(args.journal)
    return str(load_config(args.config).journal.dir)


def cmd_tail(args: argparse.Namespace) -> int:
    for handler in getattr(args, "_tail_handlers", []):
        result = handler(args)
        if result is not None:
            return int(result)
    from .journal import JournalReader

    reader = JournalReader(_journal_dir(args))
    start = args.from_offset
    if start is None:
        start = 0 if not args.follow else reader.end_offset()
    records = reader.follow(start) if args.follow else reader.read(start)
    out = sys.stdout.buffer
    count = 0
    try:
        for record in records:
            if args.protocol and record.protocol != args.protocol:
                continue
            if args.stream and record.stream != args.stream:
                continue
            out.write(orjson.dumps(record.to_json_dict(), option=orjson.OPT_APPEND_NEWLINE))
            count += 1
            if args.follow:
                out.flush()
            if args.limit is not None and count >= args.limit:
                break
    except KeyboardInterrupt:
        pass
    out.flush()
    return 0


def cmd_journal_stats(args: argparse.Namespace) -> int:
    from .journal import JournalReader

    path = _journal_dir(args)
    reader = JournalReader(path)
    bases = reader.segment_bases()
    total = sum(os.path.getsize(os.path.join(path, f"{b:020d}.seg")) for b in bases)
    first = bases[0] if bases else 0
    end = reader.end_offset()
    stats = {
        "path": path,
        "id": reader.id,  # None until a hub opens a journal made before identities
        "segments": len(bases),
        "bytes": total,
        "first_offset": first,
        "last_offset": end - 1 if end > first else None,
        "events": end - first,
    }
    if args.json:
        print(orjson.dumps(stats).decode())
    else:
        for key, value in stats.items():
            print(f"{key:>13}: {value}")
    return 0


# `taproom journal check` exit codes (also in its --help and docs/operations.md).
CHECK_OK = 0  # nothing wrong, or everything found was repaired
CHECK_PROBLEMS = 1  # problems remain: lost offsets (quarantined, gaps) or unrepaired damage
CHECK_FAILED = 2  # the journal could not be checked (no such directory, unreadable)


def cmd_journal_check(args: argparse.Namespace) -> int:
    from .journal import check_journal

    try:
        report = check_journal(_journal_dir(args), repair=args.repair)
    except (JournalError, OSError) as exc:
        print(f"taproom: journal check: {exc}", file=sys.stderr)
        return CHECK_FAILED
    if args.json:
        print(orjson.dumps(report).decode())
    else:
        print(
            f"segments {report['segments']}, batches {report['batches']}, "
            f"events {report['events']}, lost events {report['lost_events']}"
        )
        for problem in report["problems"]:
            done = " (repaired)" if problem["repaired"] else ""
            print(f"{problem['kind']}: {problem['segment']}: {problem['problem']}{done}")
        print("ok" if report["ok"] else "problems remain")
    return CHECK_OK if report["ok"] else CHECK_PROBLEMS


def build_parser(plugins: bool = True) -> argparse.ArgumentParser:
    """The whole command line; ``plugins=False`` only the commands of CORE_COMMANDS (the rest
    then parse as nothing)."""
    parser = argparse.ArgumentParser(prog="taproom", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the hub")
    _config_arg(p)
    p.add_argument("--ready-file", metavar="PATH", help="write bound addresses (JSON) once up")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("validate", help="check a configuration (exit 78 when invalid)")
    _config_arg(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("config", help="configuration helpers")
    csub = p.add_subparsers(dest="config_command", required=True)
    q = csub.add_parser("defaults", help="every setting with its default and the reason")
    q.set_defaults(func=cmd_config_defaults)

    p = sub.add_parser("tail", help="print committed events as JSON lines")
    _config_arg(p)
    p.add_argument("--journal", metavar="DIR", help="journal directory (default: from config)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--from", dest="from_offset", type=int, metavar="OFFSET")
    p.add_argument("--protocol", metavar="P")
    p.add_argument("--stream", metavar="S")
    p.add_argument("--limit", type=int, metavar="N", help="stop after N events")
    handlers: list[Callable[[argparse.Namespace], int | None]] = []
    p.set_defaults(func=cmd_tail, _tail_handlers=handlers)
    tail_parser = p

    p = sub.add_parser("journal", help="inspect the journal")
    jsub = p.add_subparsers(dest="journal_command", required=True)
    q = jsub.add_parser("stats", help="segments, events, bytes, offsets")
    _config_arg(q)
    q.add_argument("--journal", metavar="DIR")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_journal_stats)
    q = jsub.add_parser(
        "check",
        help="verify every frame; exit 0 ok, 1 problems remain, 2 cannot check",
        description="Verify every frame of every segment and list damage with its offsets. "
        "Exit status: 0 nothing wrong (or all of it repaired), 1 problems remain (lost "
        "offsets: quarantined frames or gaps, which no repair brings back; or damage found "
        "without --repair), 2 the journal could not be checked.",
    )
    _config_arg(q)
    q.add_argument("--journal", metavar="DIR")
    q.add_argument(
        "--repair",
        action="store_true",
        help="cut a torn tail, rewrite damaged segment headers (stop the hub first)",
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_journal_check)

    send = sub.add_parser("send", help="send events with taproom's clients")
    send_sub = send.add_subparsers(dest="protocol", required=True, metavar="PROTOCOL")

    for plugin in _plugins() if plugins else ():
        if hasattr(plugin, "register_send"):
            plugin.register_send(send_sub)
        if hasattr(plugin, "register_tail"):
            handler = plugin.register_tail(tail_parser)
            if handler is not None:
                handlers.append(handler)
        if hasattr(plugin, "register_commands"):
            plugin.register_commands(sub)
    return parser


def _reader_gone() -> int:
    """stdout's reader went away (``taproom tail | head -1``): stop quietly, as a pipeline
    expects. Python flushes stdout once more at exit; pointing it at /dev/null keeps that
    flush from failing again with a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(plugins=not words or words[0] not in CORE_COMMANDS)
    args = parser.parse_args(words)
    try:
        result = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is handled below
        return result
    except BrokenPipeError:  # every command that writes to stdout, in one place
        return _reader_gone()
    except ConfigError as exc:
        print(f"taproom: config error: {exc}", file=sys.stderr)
        return EX_CONFIG
    except TaproomError as exc:
        print(f"taproom: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
