"""A throwaway certificate authority for tests and local stacks (never for production).

``ThrowawayCA.create(dir)`` makes a CA key and self-signed CA certificate; ``issue(name)``
signs a leaf certificate for a server (with ``localhost`` and ``127.0.0.1`` as subject
alternative names, so hostname checks pass on loopback) or a client (its common name is the
principal an agent sees with mTLS). Each is written as PEM files (``<name>.crt``,
``<name>.key``) under the CA's directory, keys unencrypted and readable by the owner only.
Validity can be set in the past (an expired certificate) for tests of refusals.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class Issued:
    certfile: Path
    keyfile: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class ThrowawayCA:
    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self.directory = directory
        self.key = key
        self.cert = cert

    @property
    def cafile(self) -> Path:
        return self.directory / "ca.crt"

    @classmethod
    def create(cls, directory: Path, name: str = "Strata throwaway CA") -> ThrowawayCA:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - datetime.timedelta(minutes=5))
            .not_valid_after(_now() + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
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
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        ca = cls(directory, key, cert)
        ca.cafile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(directory / "ca.key", key)
        return ca

    def issue(
        self,
        name: str,
        *,
        hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
        valid_days: float = 30,
        expired: bool = False,
        filename: str | None = None,
    ) -> Issued:
        """A leaf certificate with common name ``name`` for both server and client use."""
        key = ec.generate_private_key(ec.SECP256R1())
        if expired:
            start, end = _now() - datetime.timedelta(days=10), _now() - datetime.timedelta(days=1)
        else:
            start = _now() - datetime.timedelta(minutes=5)
            end = _now() + datetime.timedelta(days=valid_days)
        alt: list[x509.GeneralName] = []
        for h in hosts:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                alt.append(x509.DNSName(h))
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
        )
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        stem = filename or name
        certfile = self.directory / f"{stem}.crt"
        keyfile = self.directory / f"{stem}.key"
        certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(keyfile, key)
        return Issued(certfile, keyfile)
