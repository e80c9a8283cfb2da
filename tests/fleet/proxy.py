"""A real TCP proxy in front of a hub that damages what it relays, once, on purpose.

The network between Spark and a hub can flip bits or drop a connection; these tests need to
make that happen on a real socket. ``FaultyProxy`` relays connections to the target; on the
first connection that starts with a journal read (``/api/journal/read``) it flips one byte of
the answer at ``flip_at`` or cuts the connection after ``cut_at`` bytes of it. Other
connections pass untouched (a retry reads clean data).
"""

from __future__ import annotations

import socket
import threading

__all__ = ["FaultyProxy"]


class FaultyProxy:
    def __init__(
        self, target: str, *, flip_at: int | None = None, cut_at: int | None = None
    ) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.flip_at = flip_at
        self.cut_at = cut_at
        self.faults = 0  # connections damaged so far (at most one)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._first = True
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            request = client.recv(65536)
            faulty = self._first and b"/api/journal/read" in request
            self._first = self._first and not faulty
            upstream.sendall(request)
            for args in ((client, upstream, False), (upstream, client, faulty)):
                t = threading.Thread(target=self._pipe, args=args, daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket, faulty: bool) -> None:
        seen = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if faulty and self.cut_at is not None and seen + len(data) >= self.cut_at:
                    dst.sendall(data[: self.cut_at - seen])
                    self.faults += 1
                    break
                if faulty and self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                    i = self.flip_at - seen
                    data = data[:i] + bytes([data[i] ^ 0x20]) + data[i + 1 :]
                    self.faults += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
