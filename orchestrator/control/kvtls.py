"""The service CA that encrypts shard traffic between clouds: created once, a certificate per replica.

Each service has its own CA (`<state>/services/<name>/kv-ca.crt` and `kv-ca.key`, 0600), made on
first use with the `cryptography` package. Every replica's shard store gets a certificate for
`store_server_name(replica_id)` signed by it; connectors trust only that CA, so a store of another
service, or anyone else, fails the handshake. The launcher writes a local replica's files
(`replica_files`); a VM receives the same three PEMs in its one bootstrap redemption (`issue`),
never in its user-data.
"""

from __future__ import annotations

import datetime
import os
import shutil
import threading
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from orchestrator.common.kvtls import CA_FILE, CERT_FILE, KEY_FILE, store_server_name
from orchestrator.control import auth

CA_DAYS = 3650
CERT_DAYS = 90  # a replica lives hours to days; its certificate is issued at each launch
_CA_LOCK = threading.Lock()  # launches run in parallel: one CA per service, not one per thread


class StoreCredentials(NamedTuple):
    """PEMs for one replica's shard store: the service CA, its certificate, its private key."""

    ca: str
    cert: str
    key: str


def _private_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a reader sees the old file or the whole new one


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def service_ca(service: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The service's CA, created on first use (the key 0600 beside the other secrets)."""
    with _CA_LOCK:
        return _load_or_create_ca(service)


def _load_or_create_ca(service: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path = auth.service_secret_path(service, CA_FILE)
    key_path = auth.service_secret_path(service, "kv-ca.key")
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"spot-orchestrator kv CA of {service}"))
        .issuer_name(_name(f"spot-orchestrator kv CA of {service}"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _private_write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    _private_write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def issue(service: str, replica_id: str) -> StoreCredentials:
    """A fresh key and certificate for replica `replica_id`'s shard store."""
    ca_cert, ca_key = service_ca(service)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    name = store_server_name(replica_id)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return StoreCredentials(
        ca=ca_cert.public_bytes(pem).decode(),
        cert=cert.public_bytes(pem).decode(),
        key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode(),
    )


def write_credentials(folder: Path, creds: StoreCredentials) -> Path:
    """The three files in `folder` (0700; the key 0600), the names the replica side expects."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for filename, text in ((CA_FILE, creds.ca), (CERT_FILE, creds.cert), (KEY_FILE, creds.key)):
        _private_write(folder / filename, text.encode())
    return folder


def replica_files(service: str, replica_id: str) -> Path:
    """A local replica's TLS folder (`<state>/services/<name>/kv-tls/<replica_id>`), issued now."""
    return write_credentials(auth.service_secret_path(service, "kv-tls") / replica_id, issue(service, replica_id))


def forget_service(service: str) -> None:
    """Delete the TLS folders of a service's local replicas (the daemon, once the service is
    gone: every replica is terminated, and a key nobody uses should not stay on disk)."""
    shutil.rmtree(auth.service_secret_path(service, "kv-tls"), ignore_errors=True)
