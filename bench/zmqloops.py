"""The benches' C loops (bench/zmqloops.c): raw libzmq ceilings and fast load generators.

Built on first use with cffi into bench/out/ (the same C as taproom's compiled module,
src/taproom/zmqburst/burst.c, for its libzmq lookup), and bound to the libzmq pyzmq loaded,
so every loop runs on the same sockets and library as taproom. The calls release the GIL and
take a pyzmq socket's handle; a blocking loop ends early only by ``ZMQ_RCVTIMEO``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import sys
from pathlib import Path
from typing import Any

import zmq

_HERE = Path(__file__).resolve().parent
_OUT = _HERE / "out" / "zmqloops"
_BURST_C = _HERE.parent / "src" / "taproom" / "zmqburst" / "burst.c"

_CDEF = """
int tb_bind(int *major, int *minor, int *patch);
long bl_agent(void *sock, long n, int dealer, const char *app, size_t la, const char *topic,
              size_t lt, const char *body, size_t lb);
long bl_receiver(void *sock, long n, int reply);
long bl_publisher(void *sock, long n, const char *app, size_t la, const char *topic, size_t lt,
                  const char *body, size_t lb);
long bl_bus_publisher(void *sock, long n, long topics, uint32_t salt, const char *producer,
                      size_t lp, const char *ts, size_t lts, const char *data, size_t ld);
long bl_count(void *sock, long n);
long bl_count_until(void *sock, const char *end, size_t end_len);
long bl_bus_relay(void *router, void *pub, long n);
long bl_lager_tap(void *sock, long n, const char *uuid16, int items);
long bl_forward(void *in, void *out, long n);
int64_t bl_count_many(void **socks, int n, long expected, int quiet_ms, int sample,
                      long *received, int64_t *lags, int max_samples, int *samples);
"""

_lib: Any = None


def lib() -> Any:
    """The built and bound loops (built once per source change; a lock keeps parallel bench
    processes from building at the same time)."""
    global _lib
    if _lib is not None:
        return _lib
    from cffi import FFI

    source = _BURST_C.read_text() + (_HERE / "zmqloops.c").read_text()
    name = "_zmqloops_" + hashlib.sha256(source.encode()).hexdigest()[:12]
    _OUT.mkdir(parents=True, exist_ok=True)
    with open(_OUT / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not list(_OUT.glob(f"{name}*.so")):
            ffi = FFI()
            ffi.cdef(_CDEF)
            ffi.set_source(name, source, libraries=["dl"], extra_compile_args=["-O2"])
            ffi.compile(tmpdir=str(_OUT))
    sys.path.insert(0, str(_OUT))
    module = importlib.import_module(name)
    version = module.ffi.new("int[3]")
    if module.lib.tb_bind(version, version + 1, version + 2) != 0:
        raise RuntimeError("pyzmq's libzmq not found in this process")
    _lib = module.lib
    global _ffi
    _ffi = module.ffi
    return _lib


_ffi: Any = None


def _handle(sock: zmq.Socket[bytes]) -> Any:
    return _ffi.cast("void *", sock.underlying)


def agent(
    sock: zmq.Socket[bytes], n: int, dealer: bool, app: bytes, topic: bytes, body: bytes
) -> int:
    """n logjam messages out (DEALER: with the empty frame, and every 202 read back)."""
    loops = lib()
    return int(
        loops.bl_agent(
            _handle(sock), n, int(dealer), app, len(app), topic, len(topic), body, len(body)
        )
    )


def receiver(sock: zmq.Socket[bytes], n: int, reply: bool) -> int:
    """The raw receiver ceiling: n messages in, dropped (ROUTER: a 202 each)."""
    loops = lib()
    return int(loops.bl_receiver(_handle(sock), n, int(reply)))


def publisher(sock: zmq.Socket[bytes], n: int, app: bytes, topic: bytes, body: bytes) -> int:
    """The raw publisher ceiling: n logjam messages numbered from 1."""
    loops = lib()
    return int(
        loops.bl_publisher(_handle(sock), n, app, len(app), topic, len(topic), body, len(body))
    )


def bus_publisher(
    sock: zmq.Socket[bytes], n: int, topics: int, salt: int, producer: bytes, ts: bytes, data: bytes
) -> int:
    """n Event BUS PUB commands out of a DEALER, each with a distinct UUID (``salt``: 32 bits
    that keep one run's UUIDs apart from another's)."""
    loops = lib()
    return int(
        loops.bl_bus_publisher(
            _handle(sock), n, topics, salt, producer, len(producer), ts, len(ts), data, len(data)
        )
    )


def count(sock: zmq.Socket[bytes], n: int) -> int:
    """Receive and count n whole messages (fewer when ``ZMQ_RCVTIMEO`` runs out)."""
    loops = lib()
    return int(loops.bl_count(_handle(sock), n))


def count_until(sock: zmq.Socket[bytes], end: bytes) -> int:
    """Read whole messages until one whose first frame is ``end`` (read too): the messages
    before it, or -1 when ``ZMQ_RCVTIMEO`` ran out first."""
    loops = lib()
    return int(loops.bl_count_until(_handle(sock), end, len(end)))


def bus_relay(router: zmq.Socket[bytes], pub: zmq.Socket[bytes], n: int) -> int:
    """The Event BUS ceiling: n PUB commands in on ``router``, each out on ``pub`` numbered."""
    loops = lib()
    return int(loops.bl_bus_relay(_handle(router), _handle(pub), n))


def lager_tap(sock: zmq.Socket[bytes], n: int, uuid16: bytes, items: int) -> int:
    """n nasa/lager rows of ``items`` 8-byte items out of an XPUB, after its first subscription."""
    loops = lib()
    return int(loops.bl_lager_tap(_handle(sock), n, uuid16, items))


def forward(sock_in: zmq.Socket[bytes], sock_out: zmq.Socket[bytes], n: int) -> int:
    """n whole messages from ``sock_in`` to ``sock_out`` as they are (a forwarder with no work)."""
    loops = lib()
    return int(loops.bl_forward(_handle(sock_in), _handle(sock_out), n))


def count_many(
    socks: list[zmq.Socket[bytes]], expected: int, quiet_ms: int, sample: int, max_samples: int
) -> tuple[list[int], list[list[float]], float]:
    """Read many SUB sockets in one C loop until each has ``expected`` messages or none came
    for ``quiet_ms``: (messages per socket, sampled lags per socket in ms, wall time of the
    last message). A message's lag needs its last frame to start with a MessagePack
    ``[uint64 send time in ns, ...]``."""
    loops = lib()
    n = len(socks)
    handles = _ffi.new("void *[]", [_handle(s) for s in socks])
    received = _ffi.new("long[]", n)
    lags = _ffi.new("int64_t[]", n * max_samples)
    samples = _ffi.new("int[]", n)
    last = int(
        loops.bl_count_many(
            handles, n, expected, quiet_ms, sample, received, lags, max_samples, samples
        )
    )
    if last < 0:
        raise RuntimeError("zmq_poll not found in pyzmq's libzmq")
    per_socket = [[lags[i * max_samples + k] / 1e6 for k in range(samples[i])] for i in range(n)]
    return list(received), per_socket, last / 1e9
