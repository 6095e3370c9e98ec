"""TLS settings: a service's `service.tls` (SkyServe's keyfile / certfile, served by its load
balancer) and the daemon API's own certificate (required when it binds beyond loopback), checked
into one-line errors before anything listens. Called by control/daemon.py, cli/service.py and
control/discovery.py (which verifies the daemon with the certificate it recorded)."""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from orchestrator.common.errors import UserError

CERTFILE_ENV = "SPOT_ORCHESTRATOR_API_CERTFILE"
KEYFILE_ENV = "SPOT_ORCHESTRATOR_API_KEYFILE"


@dataclass(frozen=True)
class CertPair:
    certfile: str
    keyfile: str


def load_pair(certfile: str, keyfile: str, where: str) -> CertPair:
    """Both files, ~-expanded and absolute, after loading them once (a missing file, a key that
    is not the certificate's, or a file that is not PEM is a UserError naming `where`)."""
    for key, given in (("certfile", certfile), ("keyfile", keyfile)):
        if not Path(given).expanduser().is_absolute():  # the daemon reads it, from another directory
            raise UserError(f"{where}.{key}: {given!r} is relative; give an absolute or ~/ path")
    pair = CertPair(str(Path(certfile).expanduser().resolve()), str(Path(keyfile).expanduser().resolve()))
    for key, path in (("certfile", pair.certfile), ("keyfile", pair.keyfile)):
        if not os.path.isfile(path):
            raise UserError(f"{where}.{key}: {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(pair.certfile, pair.keyfile)
    except (ssl.SSLError, OSError) as err:
        raise UserError(f"{where}: cannot load certfile {pair.certfile} with keyfile {pair.keyfile}: "
                        f"{getattr(err, 'reason', None) or err}") from None
    return pair


def service_tls(spec) -> CertPair | None:
    """The load balancer's certificate of a spec with `service.tls` (None: plain HTTP)."""
    tls = spec.service.tls
    return load_pair(tls.certfile, tls.keyfile, "service.tls") if tls is not None else None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_tls(host: str, certfile: str | None = None, keyfile: str | None = None,
            allow_plain_http: bool = False) -> CertPair | None:
    """The daemon API's certificate: from the arguments or the environment. Bound beyond
    loopback, the API carries tokens over the network, so it needs one unless the operator
    says a TLS-terminating proxy is in front (allow_plain_http)."""
    certfile = certfile or os.environ.get(CERTFILE_ENV)
    keyfile = keyfile or os.environ.get(KEYFILE_ENV)
    if bool(certfile) != bool(keyfile):
        raise UserError("daemon TLS: give both --tls-certfile and --tls-keyfile "
                        f"(or {CERTFILE_ENV} and {KEYFILE_ENV})")
    if certfile:
        return load_pair(certfile, keyfile, "daemon TLS")
    if not is_loopback(host) and not allow_plain_http:
        raise UserError(f"daemon --host {host}: beyond loopback the API serves TLS only; give --tls-certfile and "
                        f"--tls-keyfile (or {CERTFILE_ENV} / {KEYFILE_ENV}), or --plain-http behind a TLS proxy")
    return None


def client_context(cafile: str | None) -> ssl.SSLContext | bool:
    """What a client verifies the daemon with: the system's CAs plus the daemon's own
    certificate as a trust anchor (a self-signed one, or a leaf of a private CA)."""
    if not cafile:
        return True
    context = ssl.create_default_context()
    context.load_verify_locations(cafile)
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context
