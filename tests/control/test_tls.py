"""TLS through the real CLI and daemon: `service.tls` makes the service's endpoint HTTPS (a
client verifying the test's self-signed certificate gets completions), a spec whose TLS files are
missing or wrong is refused in one line, and the daemon's API serves TLS beyond loopback."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import sys

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.control.test_daemon import SPEC, FakeEngineLauncher, ready
from tests.helpers import running_daemon, spotctl, wait_for


def self_signed(folder, name="cert") -> tuple[str, str]:
    """(certfile, keyfile) for localhost and 127.0.0.1."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = folder / f"{name}.pem", folder / f"{name}.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(certfile), str(keyfile)


def tls_spec(certfile: str, keyfile: str) -> str:
    return SPEC.replace("  replicas: 2\n", f"  replicas: 1\n  tls: {{certfile: {certfile}, keyfile: {keyfile}}}\n")


@pytest.fixture
def daemon(state_home, monkeypatch):
    with running_daemon(monkeypatch, launcher=FakeEngineLauncher()) as running:
        yield running


def test_service_tls_serves_https_that_a_verifying_client_trusts(daemon, tmp_path):
    _, client = daemon
    certfile, keyfile = self_signed(tmp_path)
    spec = tmp_path / "svc.yaml"
    spec.write_text(tls_spec(certfile, keyfile))
    out = json.loads(spotctl("up", str(spec), "--json", timeout=120).stdout)
    assert out["endpoint"].startswith("https://127.0.0.1:")
    wait_for(lambda: ready(client), 60, "a READY replica")
    trusted = httpx.Client(verify=ssl.create_default_context(cafile=certfile), timeout=10)
    openai_client = openai.OpenAI(base_url=f"{out['endpoint']}/v1", api_key="unused", http_client=trusted)
    completion = openai_client.completions.create(model="svc", prompt="hi", max_tokens=2)
    assert completion.choices[0].text
    with pytest.raises(httpx.ConnectError):  # the system's CAs do not know it: verification is real
        httpx.get(f"{out['endpoint']}/v1/models", timeout=10)


@pytest.mark.parametrize("case", ["missing_key", "wrong_key", "relative"])
def test_a_spec_with_bad_tls_files_is_refused_in_one_line(daemon, tmp_path, case):
    _, client = daemon
    certfile, keyfile = self_signed(tmp_path)
    _, other_key = self_signed(tmp_path, "other")
    given, expected = {"missing_key": ((certfile, str(tmp_path / "nope.key")), "service.tls.keyfile"),
                       "wrong_key": ((certfile, other_key), "service.tls: cannot load"),
                       "relative": (("cert.pem", keyfile), "service.tls.certfile")}[case]
    spec = tmp_path / "svc.yaml"
    spec.write_text(tls_spec(*given))
    proc = spotctl("up", str(spec), check=False, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
    r = client.post("/v1/services", json={"yaml": spec.read_text()})  # the daemon checks too
    assert r.status_code == 400 and expected in r.json()["detail"]
    assert client.get("/v1/services").json() == []


def test_the_daemon_api_serves_tls_beyond_loopback(state_home, tmp_path):
    proc = spotctl("daemon", "--host", "0.0.0.0", "--port", "0", check=False, timeout=120)
    assert proc.returncode == 2 and "--tls-certfile" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    certfile, keyfile = self_signed(tmp_path)
    daemon = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "daemon", "--host", "0.0.0.0", "--port",
                               "0", "--tls-certfile", certfile, "--tls-keyfile", keyfile],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        info = wait_for(lambda: (state_home / "daemon.json").exists() and
                        json.loads((state_home / "daemon.json").read_text()), 60, "the daemon to listen")
        assert info["url"].startswith("https://127.0.0.1:")
        assert json.loads(spotctl("status", "--json", timeout=120).stdout) == []  # the CLI verifies it
        trusted = ssl.create_default_context(cafile=certfile)
        assert httpx.get(f"{info['url']}/v1/health", verify=trusted, timeout=10).status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{info['url']}/v1/health", timeout=10)
        with pytest.raises(httpx.HTTPError):
            httpx.get(info["url"].replace("https", "http") + "/v1/health", timeout=10)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
