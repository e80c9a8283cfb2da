"""The suite's guard against leaked ZeroMQ contexts (tests/conftest.py installs it).

A context dropped without ``term()``/``destroy()`` is closed by pyzmq's ``Context.__del__``
when the garbage collector reaches it, maybe tests later. That ``destroy()`` closes its
sockets with their own LINGER, -1 (forever) by default, so one unsent message to a peer that
is gone blocks ``term()`` until pytest-timeout fires inside ``__del__``, where the exception is
swallowed: the test the collector happened to run in passes, and the run loses 5 minutes.

Here, in tests only:

* each context records where it was made (the test and phase, and the stack's project frames);
* ``Context.__del__`` on a context still open records a leak naming that origin, closes its
  sockets with LINGER 0 and terms it in a daemon thread it waits on a few seconds at most (a
  socket closed earlier with pending messages and LINGER -1 can still hold ``term()``; then
  the thread keeps it, the test does not), so the suite never hangs in a finalizer;
* after each test that made a context it left open, a garbage collection finalizes the ones
  that are garbage now, so the leak is charged to the test that made it, and the teardown of
  the test fails with each leak's origin (a leak found later, in another test, fails that
  one, naming the test that made it; one made by a test that failed is only reported, as a
  warning: that test's failure is the error).

A context still reachable after its test (a module fixture's, ``Context.instance()``) is not a
leak: it is checked when it becomes garbage. No socket option of the code under test changes:
a context closed properly behaves exactly as in production.
"""

from __future__ import annotations

import gc
import os
import threading
import traceback
from typing import Any

import zmq
import zmq.sugar.context
import zmq.sugar.socket

__all__ = ["check", "failed", "forget_failed", "install", "set_phase"]

# How long a finalizer waits for term() after closing the sockets with LINGER 0. It returns
# at once unless a socket closed earlier still holds messages with LINGER -1; the wait only
# lets a slow io thread finish, it is not a performance bound.
_TERM_WAIT = 5.0
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_made_in_phase: list[zmq.Context[Any]] = []  # strong only until check(): see there
_leaks: list[tuple[zmq.Context[Any], str, threading.Thread]] = []
_leaks_lock = threading.Lock()
_phase = "outside any test"
_test = ""  # the node id of the test running now
_failed: set[str] = set()  # tests that failed already: see check()
_installed = False


def set_phase(test: str, phase: str) -> None:
    """The test (node id, "" between tests) and phase whose code makes the contexts now."""
    global _phase, _test
    _test = test
    _phase = f"{test} ({phase})" if test else phase


def failed(test: str) -> None:
    """``test`` failed (a phase of it): what it leaks is reported, it fails nothing more."""
    _failed.add(test)


def forget_failed(test: str) -> None:
    """Undo :func:`failed` (for the guard's own tests)."""
    _failed.discard(test)


def _origin() -> str:
    frames = [
        f
        for f in traceback.extract_stack()[:-2]
        if f.filename.startswith(_ROOT)
        and "site-packages" not in f.filename
        and f.filename != __file__
    ]
    where = "".join(traceback.format_list(frames[-6:]))
    return f"made in {_phase}:\n{where}"


def install() -> None:
    """Wrap ``zmq.Context.__init__``, ``Context.__del__`` and ``Socket.__del__`` (asyncio
    contexts and sockets inherit them)."""
    global _installed
    if _installed:
        return
    _installed = True
    context_cls = zmq.sugar.context.Context
    socket_cls = zmq.sugar.socket.Socket
    context_init = context_cls.__init__
    context_del = context_cls.__del__
    socket_del = socket_cls.__del__

    def __init__(self: zmq.Context[Any], *args: Any, **kwargs: Any) -> None:
        context_init(self, *args, **kwargs)
        if not self._shadow:
            object.__setattr__(self, "_taproom_origin", _origin())
            object.__setattr__(self, "_taproom_test", _test)
            object.__setattr__(self, "_taproom_dropped", [])
            _made_in_phase.append(self)

    def context_finalizer(self: zmq.Context[Any]) -> None:
        origin = self.__dict__.get("_taproom_origin")
        if origin is None or self._shadow or self.closed or zmq.sugar.context._exiting:
            context_del(self)  # pyzmq's own checks: never term at exit
            return
        # Sockets still referenced only from here (the collector clears the WeakSet of
        # sockets in a cycle before finalizers run: those come to socket_finalizer).
        for sock in list(self._sockets or ()):
            if not sock.closed:
                self._taproom_dropped.append(zmq.SocketType(sock.type).name)
                sock.close(linger=0)
        # term() returns once every socket is closed; the sockets of a cycle are closed by
        # their own finalizers after this one, in this thread: so not here, and check()
        # waits for it. The thread keeps the context alive until then.
        term = threading.Thread(target=self.term, name="zmqleaks-term", daemon=True)
        term.start()
        with _leaks_lock:
            _leaks.append((self, origin, term))

    def socket_finalizer(self: zmq.Socket[Any]) -> None:
        ctx = getattr(self, "context", None)
        if (
            self._shadow
            or self.closed
            or ctx is None
            or "_taproom_origin" not in ctx.__dict__
            or ctx.closed
        ):
            socket_del(self)
            return
        # A socket dropped open: pyzmq closes it with its own LINGER, -1 by default, which
        # holds its context's term() forever if a message is pending to a peer that is gone.
        ctx._taproom_dropped.append(zmq.SocketType(self.type).name)
        self.close(linger=0)

    context_cls.__init__ = __init__  # type: ignore[method-assign]
    context_cls.__del__ = context_finalizer  # type: ignore[method-assign]
    socket_cls.__del__ = socket_finalizer  # type: ignore[method-assign]


def check() -> tuple[list[str], list[str]]:
    """The leaks found since the last call, each with where its context was made: those to
    fail the test with, and those only to report, made by a test that failed already (its
    traceback holds its frames until the next test, and a test stopped by an assertion or a
    timeout leaves its clean-up undone: the run is red already, the next test is not to
    blame). After a test that made a context it left open, a garbage collection first
    finalizes those that are garbage, so they are found now (the list's references, dropped
    here, were the last ones of a context leaked without a cycle)."""
    left_open = any(not c.closed for c in _made_in_phase)
    _made_in_phase.clear()
    if left_open:
        gc.collect()
    with _leaks_lock:
        leaks = list(_leaks)
        _leaks.clear()
    to_fail: list[str] = []
    to_report: list[str] = []
    for ctx, origin, term in leaks:
        term.join(_TERM_WAIT)
        dropped = ctx._taproom_dropped
        found = to_report if ctx._taproom_test in _failed else to_fail
        found.append(
            "a ZeroMQ context was never closed; the garbage collector reached it "
            f"with {len(dropped)} socket(s) open ({', '.join(sorted(dropped)) or '-'})"
            + ("" if not term.is_alive() else f", and term() still blocked after {_TERM_WAIT} s")
            + f"; {origin}"
        )
    return to_fail, to_report
