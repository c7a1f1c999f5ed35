"""Certificates for a throwaway local control plane: one CA, serving certs, client certs.

Keys are ECDSA P-256 (generated in microseconds, unlike RSA) and certificates live as long as a
control plane could plausibly run (a year). Everything is written as PEM files with mode 0600.
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

VALIDITY = datetime.timedelta(days=365)
# Tolerates clock skew between the moment of generation and the first TLS handshake.
BACKDATE = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


def _write(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    return x509.Name([*attributes, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class CertificateAuthority:
    """An in-memory CA that issues serving and client certificates into a folder."""

    def __init__(self, folder: Path, common_name: str = "oobleck-dev-ca") -> None:
        self.folder = folder
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = _write(folder / "ca.crt", self._cert.public_bytes(serialization.Encoding.PEM))
        self.key = _write(folder / "ca.key", _key_pem(self._key))

    def issue(
        self,
        name: str,
        common_name: str,
        *,
        organizations: tuple[str, ...] = (),
        server: bool = False,
        client: bool = False,
        hosts: tuple[str, ...] = (),
    ) -> KeyPair:
        """Issue `<name>.crt`/`<name>.key`; `hosts` (IPs or DNS names) become subject alt names."""
        if not (server or client):
            raise ValueError(f"{name}: a certificate must be for a server, a client, or both")
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organizations))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
        )
        if hosts:
            alt_names: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    alt_names.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return KeyPair(
            cert=_write(self.folder / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(self.folder / f"{name}.key", _key_pem(key)),
        )


def service_account_keys(folder: Path) -> KeyPair:
    """The key pair that signs service-account tokens (`sa.key`) and verifies them (`sa.pub`)."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return KeyPair(cert=_write(folder / "sa.pub", public), key=_write(folder / "sa.key", _key_pem(key)))
