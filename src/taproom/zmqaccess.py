"""Access control on the ZeroMQ listeners: the ZAP handler, CURVE, and refusals counted.

libzmq asks a ZAP handler (RFC 27, ``inproc://zeromq.zap.01`` in the socket's context) about
every connection to a socket that has a ``ZMQ_ZAP_DOMAIN``, with the peer's address, the
mechanism and, for CURVE, the client's public key. :class:`ZmqAccess` is that handler for one
context (each ZeroMQ service has its own): every listening socket gets its listener name as
its ZAP domain, so one handler serves all of them and applies each listener's policy
(:func:`taproom.access.access_for`): the allowlist with the NULL mechanism (logjam-tools, the
Guide's Clone clients and nasa/lager need no change), and the client keys of a CURVE listener.
A socket whose policy can refuse no one gets no domain, so libzmq does not ask (no cost).

A refusal (ZAP status 400) is counted and logged by the policy with the peer's address; the
peer's libzmq stops reconnecting. Two refusals happen before ZAP is asked, inside libzmq: a
peer with the other mechanism (a NULL peer on a CURVE listener) and a CURVE peer that does not
know the server's key. The socket's monitor reports those (``mechanism_mismatch``,
``curve_handshake_failed``; ``handshake_failed`` when the peer hung up first, as a NULL peer
that read the CURVE greeting does, and libzmq gives no detail) without the peer's address,
which libzmq does not give.

A listener that moves to taproom's own ZMTP transport stops using ZAP: the transport calls
the same policy (``allows``, ``curve``, ``curve_allows``, ``refused``) itself.

Clients: :func:`curve_client` sets a client socket up for a CURVE server (taproom's logjam,
Event BUS and Lager clients take ``--curve-server-key`` and ``--curve-key-file``);
``taproom access keygen NAME`` writes a key pair as zmq.auth and curve_keygen do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

import zmq
import zmq.asyncio
from zmq.utils import z85

from .access import ListenerAccess, access_for, load_curve_keys
from .config import Config
from .errors import ConfigError
from .metrics import Metrics
from .zmqmonitor import watch_handshakes

__all__ = [
    "ZAP_ENDPOINT",
    "Curve",
    "ZmqAccess",
    "add_curve_arguments",
    "curve_client",
    "curve_from_args",
    "register_commands",
]

log = logging.getLogger("taproom.access")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# A client's CURVE settings: the server's public key (Z85 or its .key file) and the client's
# own .key_secret file (None: a fresh key pair).
Curve = tuple[str, str | None]
_ZAP_VERSION = b"1.0"
# Bytes a CURVE MESSAGE command adds to a frame: name, nonce, the box's MAC, flags, and a
# long length (libzmq's curve_mechanism_base: 16 + 8 + 16 + 1, rounded up).
_CURVE_FRAME_OVERHEAD = 64
# What the monitor reports that ZAP never saw, as refusal reasons of the listener.
_NO_DETAIL = "closed during the handshake (libzmq gives no detail: a NULL peer?)"
_MONITOR_REASONS = {
    "mechanism_mismatch": "the peer's mechanism is not the listener's (NULL on a CURVE listener?)",
    "curve_handshake_failed": "the peer's CURVE handshake failed (a wrong server key?)",
}


class ZmqAccess:
    """The ZAP handler of one ZeroMQ context and the access settings of its listeners.

    ``secure(sock, listener)`` before ``bind``; ``start()`` once bound; ``await stop()``
    before the context is terminated (it closes the sockets it made).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        config: Config,
        metrics: Metrics | None,
        service: str = "zmq",
    ) -> None:
        self._ctx = ctx
        self._service = service
        self._config = config
        self._metrics = metrics
        self.policies: dict[str, ListenerAccess] = {}
        self._watched: dict[zmq.Socket[Any], tuple[str, Callable[[], None] | None]] = {}
        self._zap: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def policy(self, listener: str) -> ListenerAccess:
        access = self.policies.get(listener)
        if access is None:
            access = self.policies[listener] = access_for(self._config, listener, self._metrics)
        return access

    def secure(
        self,
        sock: zmq.Socket[Any],
        listener: str,
        on_refused: Callable[[], None] | None = None,
    ) -> ListenerAccess:
        """Apply ``listener``'s policy to ``sock`` (before it binds). ``on_refused`` is called
        for handshakes libzmq refuses for other reasons (a peer of the wrong socket type);
        the socket's monitor runs when it is given or the listener uses CURVE."""
        access = self.policy(listener)
        if access.curve is not None:
            sock.curve_server = True
            sock.curve_secretkey = access.curve.secret_z85
            limit = sock.getsockopt(zmq.MAXMSGSIZE)
            if isinstance(limit, int) and limit >= 0:
                # libzmq checks the handshake's commands (INITIATE: ~300 bytes) and each
                # encrypted frame (33 bytes more than its content) against MAXMSGSIZE: a
                # subscription-sized bound refused every CURVE client at the handshake.
                sock.setsockopt(zmq.MAXMSGSIZE, max(limit + _CURVE_FRAME_OVERHEAD, 1024))
        if access.restricted:
            self._bind_zap()
            sock.zap_domain = listener.encode()
        if on_refused is not None or access.curve is not None:
            self._watched[sock] = (listener, on_refused)
        return access

    def forget(self, sock: zmq.Socket[Any]) -> None:
        """``sock`` is closed before ``start()`` (a failed bind)."""
        self._watched.pop(sock, None)

    def _bind_zap(self) -> None:
        if self._zap is not None:
            return
        zap = self._ctx.socket(zmq.ROUTER)
        zap.linger = 0
        try:
            zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            zap.close(0)
            raise
        self._zap = zap

    def start(self, spawn: Spawn | None = None) -> None:
        """Serve ZAP requests (loop ``<service>.zap``) and watch the monitored sockets
        (``<service>.handshakes.<listener>``), on the running loop: in tasks made by ``spawn``
        (the hub's supervisor: a loop that dies is restarted), else plain tasks."""
        spawn = spawn or _task
        zap = self._zap
        if zap is not None:
            self._tasks.append(spawn(f"{self._service}.zap", partial(self._serve_zap, zap)))
        for sock, (listener, on_refused) in self._watched.items():
            assert isinstance(sock, zmq.asyncio.Socket)
            on = self._on_monitor(listener, on_refused)
            self._tasks.append(
                spawn(
                    f"{self._service}.handshakes.{listener}",
                    partial(watch_handshakes, sock, on),
                    first=watch_handshakes(sock, on),  # the monitor starts now
                )
            )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._watched.clear()
        self.close()

    def close(self) -> None:
        """Close the ZAP socket (also when ``start()`` never ran)."""
        if self._zap is not None:
            self._zap.close(0)
            self._zap = None

    def _on_monitor(
        self, listener: str, on_refused: Callable[[], None] | None
    ) -> Callable[[str], None]:
        access = self.policy(listener)

        def refused(reason: str) -> None:
            if reason in _MONITOR_REASONS:
                access.refused("?", reason, _MONITOR_REASONS[reason])
            elif reason == "handshake_refused":
                if on_refused is not None:
                    on_refused()  # the service counts these itself (Event BUS)
                elif access.curve is not None:
                    # A NULL peer that saw the CURVE greeting first hangs up before the
                    # listener sees its mechanism: libzmq then gives no detail.
                    access.refused("?", "handshake_failed", _NO_DETAIL)
            # "zap": the handler has counted it already, with the peer's address

        return refused

    async def _serve_zap(self, zap: zmq.asyncio.Socket) -> None:
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(zap.underlying)
        while True:
            frames = await zap.recv_multipart()
            try:
                reply = self.answer(frames)
            except Exception:  # never lose the handler to one request: refuse it
                log.exception("ZAP request could not be judged; refused")
                reply = _reply(frames, b"500", b"internal error")
            if reply is not None:
                with contextlib.suppress(zmq.Again):
                    raw.send_multipart(reply, zmq.NOBLOCK)

    def answer(self, frames: list[bytes]) -> list[bytes] | None:
        """The reply to one ZAP request (routing id, empty delimiter, then RFC 27 frames):
        ``[version, request_id, domain, address, identity, mechanism, credentials...]``."""
        try:
            split = frames.index(b"")
        except ValueError:
            return None  # not a REQ envelope: nothing to answer
        body = frames[split + 1 :]
        if len(body) < 6 or body[0] != _ZAP_VERSION:
            return _reply(frames, b"500", b"bad ZAP request")
        domain, address, mechanism = body[2], body[3].decode(errors="replace"), body[5]
        credentials = body[6:]
        access = self.policies.get(domain.decode(errors="replace"))
        if access is None:
            return _reply(frames, b"400", b"unknown domain")
        if not access.allows(address):
            access.refused(address, "address_not_allowed", "not in allow")
            return _reply(frames, b"400", b"address not allowed")
        if mechanism == b"CURVE":
            key = credentials[0] if credentials else b""
            if len(key) != 32 or not access.curve_allows(key):
                detail = f"client key {z85.encode(key).decode()}" if len(key) == 32 else ""
                access.refused(address, "curve_key_not_allowed", detail)
                return _reply(frames, b"400", b"client key not allowed")
            return _reply(frames, b"200", b"OK", z85.encode(key))
        if mechanism != b"NULL" or access.curve is not None:
            access.refused(address, "mechanism_not_allowed", mechanism.decode(errors="replace"))
            return _reply(frames, b"400", b"mechanism not allowed")
        return _reply(frames, b"200", b"OK")


class Spawn(Protocol):
    """``Supervisor.spawn``'s shape."""

    def __call__(
        self,
        loop: str,
        factory: Callable[[], Awaitable[None]],
        *,
        first: Awaitable[None] | None = None,
    ) -> asyncio.Task[None]: ...


def _task(
    loop: str, factory: Callable[[], Awaitable[None]], *, first: Awaitable[None] | None = None
) -> asyncio.Task[None]:
    async def run() -> None:
        await (first if first is not None else factory())

    return asyncio.create_task(run(), name=loop)


def _reply(frames: list[bytes], status: bytes, text: bytes, user: bytes = b"") -> list[bytes]:
    split = frames.index(b"")
    request_id = frames[split + 2] if len(frames) > split + 2 else b""
    return [*frames[: split + 1], _ZAP_VERSION, request_id, status, text, user, b""]


# --- clients ---------------------------------------------------------------------------------


def _server_key(spec: str) -> bytes:
    """A server's public key: 40 Z85 characters, or a .key / .key_secret file holding it."""
    if os.path.isfile(spec):
        with open(spec, "rb") as f:
            for line in f:
                line = line.strip()
                if line.startswith(b"public-key") and b"=" in line:
                    spec = line.split(b"=", 1)[1].strip(b" \t'\"").decode()
                    break
            else:
                raise ConfigError(f"{spec}: no public-key line")
    if len(spec) != 40:
        raise ConfigError(f"{spec[:60]}: a CURVE key is 40 Z85 characters or a .key file")
    try:
        z85.decode(spec.encode())
    except (ValueError, KeyError, IndexError):
        raise ConfigError(f"{spec}: not a Z85 key") from None
    return spec.encode()


def curve_client(sock: zmq.Socket[Any], server_key: str, key_file: str | None = None) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the server with ``server_key``
    (Z85 text or the server's .key file). The client's own pair comes from ``key_file`` (a
    .key_secret file, the one a server lists in curve_allowed_clients), else a fresh pair for
    this socket alone (enough for a server that takes any client key)."""
    sock.curve_serverkey = _server_key(server_key)
    if key_file:
        pair = load_curve_keys(key_file)
        public, secret = pair.public_z85, pair.secret_z85
    else:
        public, secret = zmq.curve_keypair()
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def add_curve_arguments(parser: Any) -> None:
    """``--curve-server-key`` and ``--curve-key-file`` for a client command (once: the
    logjam and Event BUS plug-ins both add them to ``taproom tail``)."""
    try:
        _add_curve_arguments(parser)
    except argparse.ArgumentError:
        pass  # already there


def _add_curve_arguments(parser: Any) -> None:
    parser.add_argument(
        "--curve-server-key",
        metavar="KEY",
        help="CURVE: the hub's public key (Z85, or its .key file); default: no encryption",
    )
    parser.add_argument(
        "--curve-key-file",
        metavar="PATH",
        help="CURVE: this client's .key_secret file (its public key is in the hub's "
        "curve_allowed_clients); default: a fresh key pair",
    )


def curve_from_args(args: argparse.Namespace) -> Curve | None:
    """(server key, key file) from the options, or None without ``--curve-server-key``."""
    server = getattr(args, "curve_server_key", None)
    key_file = getattr(args, "curve_key_file", None)
    if key_file and not server:
        raise ConfigError("--curve-key-file needs --curve-server-key")
    return (server, key_file) if server else None


# --- taproom access keygen -------------------------------------------------------------------


def _cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    directory = args.dir
    os.makedirs(directory, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        path = os.path.join(directory, args.name + suffix)
        if os.path.exists(path) and not args.force:
            print(f"taproom: {path} exists (--force replaces it)", file=sys.stderr)
            return 1
    public, secret = zmq.auth.create_certificates(directory, args.name)
    os.chmod(secret, 0o600)
    print(f"{public}\n{secret}")
    return 0


def register_commands(subparsers: Any) -> None:
    access = subparsers.add_parser("access", help="access control tools")
    sub = access.add_subparsers(dest="access_command", required=True)
    p = sub.add_parser(
        "keygen",
        help="write a CURVE key pair: NAME.key (public: give it out) and NAME.key_secret",
    )
    p.add_argument("name", help="file name stem, e.g. the hub's or the client's name")
    p.add_argument("--dir", default=".", help="where to write the two files (default: .)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(func=_cmd_keygen)
