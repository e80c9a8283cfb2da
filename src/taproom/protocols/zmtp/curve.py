"""CurveZMQ, the server side (rfc.zeromq.org 26/CURVEZMQ, 25/ZMTP-CURVE), with PyNaCl.

The handshake: the client's HELLO (its transient key C', proof it knows our key S), our
WELCOME (our transient key S' and a cookie holding C' and s' under a key only we know, so we
keep no state for a client that never comes back), its INITIATE (the cookie back, its
long-term key C vouched for by C', its metadata), our READY. After it every frame travels in
a MESSAGE command: a short nonce that must grow, and a box of flags + body under the
transient keys. ``allow(C)`` decides which clients get in (``curve_key_not_allowed``).

Sans-I/O: commands in, bytes out; randomness from PyNaCl.
"""

from __future__ import annotations

from collections.abc import Callable

import nacl.bindings as nb
import nacl.exceptions
import nacl.utils

from .wire import ZmtpError, command_body, encode_command, encode_frame, encode_metadata
from .wire import parse_metadata as _parse_metadata

__all__ = ["CurveServer"]

_KEY = 32
_HELLO_DATA = 2 + 72 + 32 + 8 + 80
# flags inside a MESSAGE box (libzmq's curve_mechanism_base_t): more, command
_MSG_MORE, _MSG_COMMAND = 0x01, 0x02


def _fail(detail: str, reason: str = "handshake_failed") -> ZmtpError:
    return ZmtpError(detail, reason=reason)


class CurveServer:
    """One connection's CURVE server (a :class:`~taproom.protocols.zmtp.handshake.Mechanism`)."""

    name = b"CURVE"

    def __init__(
        self,
        public: bytes,
        secret: bytes,
        socket_type: bytes,
        allow: Callable[[bytes], bool],
    ) -> None:
        self._public, self._secret = public, secret
        self._ready_metadata = encode_metadata({b"Socket-Type": socket_type})
        self._allow = allow
        self._state = "hello"
        self._client_transient = b""
        self._transient_public, self._transient_secret = nb.crypto_box_keypair()
        self._cookie_key = nacl.utils.random(32)
        self._shared = b""  # crypto_box_beforenm(C', s'), once READY
        self._client = b""
        self._metadata: dict[bytes, bytes] = {}
        self._send_nonce = 0
        self._recv_nonce = 0

    # --- handshake ---------------------------------------------------------------------------

    def command(self, name: bytes, data: bytes) -> tuple[bytes, bool]:
        if name == b"ERROR":
            raise ZmtpError("the peer sent ERROR", reason="peer_error")
        try:
            if self._state == "hello" and name == b"HELLO":
                return self._hello(data), False
            if self._state == "initiate" and name == b"INITIATE":
                return self._initiate(data), True
        except nacl.exceptions.CryptoError as exc:
            raise _fail(f"a box did not open: {exc}") from None
        raise _fail(f"{name!r} out of turn in the CURVE handshake", "bad_handshake")

    def _hello(self, data: bytes) -> bytes:
        if len(data) != _HELLO_DATA or data[:2] != b"\x01\x00":
            raise _fail("malformed HELLO")
        client_transient = data[74:106]
        nonce, box = data[106:114], data[114:194]
        if nb.crypto_box_open(box, b"CurveZMQHELLO---" + nonce, client_transient, self._secret) != (
            bytes(64)
        ):
            raise _fail("HELLO signature")
        self._client_transient = client_transient
        cookie_nonce = nacl.utils.random(16)
        cookie = cookie_nonce + nb.crypto_secretbox(
            client_transient + self._transient_secret, b"COOKIE--" + cookie_nonce, self._cookie_key
        )
        welcome_nonce = nacl.utils.random(16)
        welcome = nb.crypto_box(
            self._transient_public + cookie,
            b"WELCOME-" + welcome_nonce,
            client_transient,
            self._secret,
        )
        self._state = "initiate"
        return encode_command(b"WELCOME", welcome_nonce + welcome)

    def _initiate(self, data: bytes) -> bytes:
        if len(data) < 96 + 8 + 16 + 32 + 96:
            raise _fail("malformed INITIATE")
        cookie, nonce, box = data[:96], data[96:104], data[104:]
        opened = nb.crypto_secretbox_open(cookie[16:], b"COOKIE--" + cookie[:16], self._cookie_key)
        if opened != self._client_transient + self._transient_secret:
            raise _fail("INITIATE cookie")
        plain = nb.crypto_box_open(
            box, b"CurveZMQINITIATE" + nonce, self._client_transient, self._transient_secret
        )
        client, vouch_nonce, vouch_box = plain[:_KEY], plain[32:48], plain[48:128]
        vouched = nb.crypto_box_open(
            vouch_box, b"VOUCH---" + vouch_nonce, client, self._transient_secret
        )
        if vouched != self._client_transient + self._public:
            raise _fail("INITIATE vouch")
        self._recv_nonce = int.from_bytes(nonce, "big")
        if not self._allow(client):
            raise _fail("client key not allowed", "curve_key_not_allowed")
        self._client = client
        self._metadata = _parse_metadata(plain[128:])
        self._shared = nb.crypto_box_beforenm(self._client_transient, self._transient_secret)
        self._state = "ready"
        nonce_out = self._next_nonce()
        ready = nb.crypto_box_afternm(
            self._ready_metadata, b"CurveZMQREADY---" + nonce_out, self._shared
        )
        return encode_command(b"READY", nonce_out + ready)

    def metadata(self) -> dict[bytes, bytes]:
        return self._metadata

    def client_key(self) -> bytes:
        return self._client

    # --- traffic -----------------------------------------------------------------------------

    def _next_nonce(self) -> bytes:
        self._send_nonce += 1
        return self._send_nonce.to_bytes(8, "big")

    def open_message(self, data: bytes) -> tuple[int, bytes]:
        """A MESSAGE command's data: (ZMTP frame flags, body). Raises ZmtpError."""
        if len(data) < 8 + 17:
            raise _fail("malformed MESSAGE", "bad_command")
        nonce = int.from_bytes(data[:8], "big")
        if nonce <= self._recv_nonce:
            raise _fail("MESSAGE nonce not increasing", "bad_command")
        try:
            plain = nb.crypto_box_open_afternm(
                data[8:], b"CurveZMQMESSAGEC" + data[:8], self._shared
            )
        except nacl.exceptions.CryptoError:
            raise _fail("MESSAGE box did not open", "bad_command") from None
        self._recv_nonce = nonce
        flags = plain[0]
        return (0x01 if flags & _MSG_MORE else 0) | (0x04 if flags & _MSG_COMMAND else 0), plain[1:]

    def seal(self, flags: int, body: bytes) -> bytes:
        """One frame (ZMTP ``flags``: MORE 1, COMMAND 4) as a MESSAGE command's wire bytes."""
        inner = (_MSG_MORE if flags & 0x01 else 0) | (_MSG_COMMAND if flags & 0x04 else 0)
        nonce = self._next_nonce()
        box = nb.crypto_box_afternm(
            bytes((inner,)) + body, b"CurveZMQMESSAGES" + nonce, self._shared
        )
        # as libzmq sends it: a frame without the COMMAND flag (25/ZMTP-CURVE calls it a
        # command; libzmq peers read either, taproom's transport too)
        return encode_frame(command_body(b"MESSAGE", nonce + box))
