"""Throw-away PKI for TLS tests: a CA, a server certificate and a client certificate.

``make_tls(tmp_path)`` writes PEM files and returns their paths. The server certificate is for
``localhost`` and ``127.0.0.1``; its key is written twice, as PKCS#8 (``BEGIN PRIVATE KEY``)
and PKCS#1 (``BEGIN RSA PRIVATE KEY``), because servers must accept both. The client
certificate's subject CN is ``client_cn`` (default ``taproom-test-client``); ``client_expired_cert`` is a certificate for the
same client key that expired yesterday.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["TLSFiles", "make_tls"]


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    cert: Path
    key_pkcs8: Path
    key_pkcs1: Path
    client_cert: Path
    client_key: Path
    client_cn: str
    client_expired_cert: Path  # the same client key, a certificate that expired yesterday


def _key() -> rsa.RSAPrivateKey:
    # 2048 bits: the smallest size OpenSSL's default security level accepts.
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str,
    key: rsa.RSAPrivateKey,
    issuer: str,
    issuer_key: rsa.RSAPrivateKey,
    *,
    ca: bool = False,
    sans: list[x509.GeneralName] | None = None,
    usage: list[x509.ObjectIdentifier] | None = None,
    expired: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    if expired:
        now -= datetime.timedelta(days=3)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        builder = builder.add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_key(path: Path, key: rsa.RSAPrivateKey, fmt: serialization.PrivateFormat) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())
    )


def make_tls(tmp_path: Path, *, client_cn: str = "taproom-test-client") -> TLSFiles:
    """Write a CA, server cert + keys and a client cert + key under ``tmp_path / "tls"``."""
    d = Path(tmp_path) / "tls"
    d.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _cert("taproom test CA", ca_key, "taproom test CA", ca_key, ca=True)
    server_key = _key()
    server = _cert(
        "localhost",
        server_key,
        "taproom test CA",
        ca_key,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
    )
    client_key = _key()
    client = _cert(
        client_cn, client_key, "taproom test CA", ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    files = TLSFiles(
        ca=d / "ca.pem",
        cert=d / "server.pem",
        key_pkcs8=d / "server.key",
        key_pkcs1=d / "server.rsa.key",
        client_cert=d / "client.pem",
        client_key=d / "client.key",
        client_cn=client_cn,
        client_expired_cert=d / "client-expired.pem",
    )
    expired = _cert(
        client_cn,
        client_key,
        "taproom test CA",
        ca_key,
        usage=[ExtendedKeyUsageOID.CLIENT_AUTH],
        expired=True,
    )
    pem = serialization.Encoding.PEM
    files.client_expired_cert.write_bytes(expired.public_bytes(pem))
    files.ca.write_bytes(ca.public_bytes(pem))
    files.cert.write_bytes(server.public_bytes(pem))
    files.client_cert.write_bytes(client.public_bytes(pem))
    _write_key(files.key_pkcs8, server_key, serialization.PrivateFormat.PKCS8)
    _write_key(files.key_pkcs1, server_key, serialization.PrivateFormat.TraditionalOpenSSL)
    _write_key(files.client_key, client_key, serialization.PrivateFormat.PKCS8)
    return files
