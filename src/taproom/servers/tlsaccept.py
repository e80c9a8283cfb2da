"""TLS after the connection gate, with every failed handshake's cause known at once.

``loop.create_server(ssl=...)`` runs the TLS handshake before the application sees the
connection and tells it nothing when the handshake fails: a listener could only count
connections that never arrived, after a timeout, without a peer or a cause. Here the listener
accepts plain TCP, its :class:`~taproom.access.ConnectionGate` decides first (a refused or
flooding peer costs no handshake), and :func:`start_server_tls` runs the handshake with
``loop.start_tls``, which raises the handshake's own error: :func:`tls_refusal` names its
cause (``tls_no_certificate``, ``tls_unknown_ca``, ``tls_expired_certificate``,
``tls_protocol_version``, ``tls_plaintext``, ``tls_handshake_timeout``, ...), counted and
logged with the peer by the listener's access policy.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

__all__ = ["TLS_REASONS", "start_server_tls", "tls_refusal"]

# OpenSSL's verify codes (X509_V_ERR_*) a client certificate fails with.
_VERIFY = {
    9: "tls_certificate_not_yet_valid",
    10: "tls_expired_certificate",
    2: "tls_unknown_ca",  # unable to get issuer certificate
    18: "tls_unknown_ca",  # self-signed certificate
    19: "tls_unknown_ca",  # self-signed certificate in the chain
    20: "tls_unknown_ca",  # unable to get local issuer certificate
    21: "tls_unknown_ca",  # unable to verify the first certificate
}
# OpenSSL's reason names, as ssl.SSLError.reason gives them.
_REASONS = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "tls_no_certificate",
    "UNSUPPORTED_PROTOCOL": "tls_protocol_version",
    "TLSV1_ALERT_PROTOCOL_VERSION": "tls_protocol_version",
    "WRONG_SSL_VERSION": "tls_protocol_version",
    "VERSION_TOO_LOW": "tls_protocol_version",
    "NO_PROTOCOLS_AVAILABLE": "tls_protocol_version",
    "WRONG_VERSION_NUMBER": "tls_plaintext",  # the first bytes are no TLS record header
    "HTTP_REQUEST": "tls_plaintext",
    "HTTPS_PROXY_REQUEST": "tls_plaintext",
    "UNKNOWN_PROTOCOL": "tls_plaintext",
    "PACKET_LENGTH_TOO_LONG": "tls_plaintext",
    "NO_SHARED_CIPHER": "tls_no_shared_cipher",
    "TLSV1_ALERT_UNKNOWN_CA": "tls_peer_refused_certificate",  # the client distrusts ours
    "SSLV3_ALERT_BAD_CERTIFICATE": "tls_peer_refused_certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "tls_peer_refused_certificate",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "tls_peer_refused_certificate",
    "UNEXPECTED_EOF_WHILE_READING": "tls_peer_closed",
}
TLS_REASONS = frozenset(
    {
        *_VERIFY.values(),
        *_REASONS.values(),
        "tls_bad_certificate",
        "tls_handshake_timeout",
        "tls_handshake_failed",
    }
)


def tls_refusal(exc: BaseException) -> tuple[str, str]:
    """(reason, detail) of a failed server-side handshake: a bounded reason for the metric,
    OpenSSL's own words for the log."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        return _VERIFY.get(code, "tls_bad_certificate"), f"{exc.verify_message} ({code})"
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or ""
        return _REASONS.get(reason, "tls_handshake_failed"), reason or str(exc)
    if isinstance(exc, TimeoutError | ConnectionAbortedError):
        return "tls_handshake_timeout", str(exc)  # asyncio's ssl_handshake_timeout
    if isinstance(exc, ConnectionError | EOFError):
        return "tls_peer_closed", type(exc).__name__
    return "tls_handshake_failed", type(exc).__name__


class _Early(asyncio.Protocol):
    """Holds what arrives between the handshake's end and the protocol taking over:
    asyncio reads the first application data as soon as the handshake completes."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = False
        self.lost: tuple[Exception | None] | None = None

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = (exc,)


async def start_server_tls(
    transport: asyncio.BaseTransport,
    context: ssl.SSLContext,
    protocol: Any,
    *,
    handshake_timeout: float,
    shutdown_timeout: float,
) -> asyncio.BaseTransport:
    """The server side of a TLS handshake on an accepted plain connection; once done,
    ``protocol`` gets ``connection_made`` with the TLS transport and whatever arrived
    meanwhile. Raises the handshake's error (see :func:`tls_refusal`); the connection is
    closed then."""
    loop = asyncio.get_running_loop()
    early = _Early()
    tls = await loop.start_tls(
        transport,  # type: ignore[arg-type]
        early,
        context,
        server_side=True,
        ssl_handshake_timeout=handshake_timeout,
        ssl_shutdown_timeout=shutdown_timeout,
    )
    assert tls is not None
    tls.set_protocol(protocol)
    protocol.connection_made(tls)
    for data in early.data:
        protocol.data_received(data)
    if early.eof:
        protocol.eof_received()
    if early.lost is not None:
        protocol.connection_lost(early.lost[0])
    return tls
