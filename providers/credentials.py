"""Whether a cloud's credentials are configured: cheap checks, no network waits, no heavy SDK imports.

`spotctl prices` asks before choosing live prices over the snapshot, so a machine without
credentials answers at once instead of waiting for metadata servers that are not there.
"""

from __future__ import annotations

import os
from pathlib import Path


def _dmi(*names: str) -> str:
    text = []
    for name in names:
        try:
            text.append(Path("/sys/devices/virtual/dmi/id", name).read_text().lower())
        except OSError:
            continue
    return " ".join(text)


def aws() -> bool:
    """boto3's credential chain; the instance-metadata step only on an EC2 machine."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    session = boto3.session.Session()
    imds_off = os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true"
    if imds_off or "amazon" not in _dmi("sys_vendor", "bios_vendor"):
        # Off EC2 the IMDS provider would spend its timeout waiting for 169.254.169.254.
        session._session.get_component("credential_provider").remove("iam-role")
    try:
        return session.get_credentials() is not None
    except (BotoCoreError, ClientError):
        return False


def gcp() -> bool:
    """Application-default credentials with a project (google.auth.default), or a GCE machine."""
    config = Path(os.environ.get("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud")
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or (config / "application_default_credentials.json").exists():
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            _, project = google.auth.default()
        except DefaultCredentialsError:
            return False
        return bool(project)
    # NO_GCE_CHECK is google-auth's own switch for "do not probe the metadata server".
    return os.environ.get("NO_GCE_CHECK", "").lower() != "true" and "google" in _dmi("product_name")


def azure() -> bool:
    """A subscription plus a service principal in the environment, or an `az login` profile."""
    if not os.environ.get("AZURE_SUBSCRIPTION_ID"):
        return False
    principal = os.environ.get("AZURE_CLIENT_ID") and os.environ.get("AZURE_TENANT_ID") and (
        os.environ.get("AZURE_CLIENT_SECRET") or os.environ.get("AZURE_FEDERATED_TOKEN_FILE"))
    return bool(principal) or (Path.home() / ".azure" / "azureProfile.json").exists()


def available(cloud: str) -> bool:
    return {"aws": aws, "gcp": gcp, "azure": azure}[cloud]()
