"""A VM's boot script: `templates/replica-boot.sh` rendered for one replica.

The launcher (orchestrator.control.launch) calls `BootScripts.render` for every VM launch; the
provider puts the result in the cloud's user-data (AWS), startup-script (GCP) or customData
(Azure). The script carries a one-time bootstrap token, never a secret: the replica redeems
the token with the daemon for its secrets (orchestrator.control.bootstrap).
"""

from __future__ import annotations

import shlex
import string
from collections.abc import Callable, Sequence

from orchestrator.common import paths
from orchestrator.control.bootstrap import BootstrapTokens
from orchestrator.control.wheel import own_wheel
from orchestrator.spec import ServiceSpec
from providers.base import MachineRuntime

TEMPLATE = paths.REPO_ROOT / "templates" / "replica-boot.sh"
PYTHON_VERSION = "3.11"
# Where a VM's replica keeps the service's KV secret ({home}: its --home, the boot script's WORK).
VM_SECRET_FILE = "{home}/kv.secret"
VM_TLS_DIR = "{home}/kv-tls"  # and its shard store's TLS files (orchestrator.replica.main writes them)


class BootScripts:
    """`issue_token(service, replica_id)` makes the replica's bootstrap token (a dry run's is a
    stand-in); `wheel_name()` is the file name of the daemon's own wheel."""

    def __init__(self, daemon_url: str, issue_token: Callable[[str, str], str], wheel_name: Callable[[], str]):
        self.daemon_url = daemon_url
        self.issue_token = issue_token
        self.wheel_name = wheel_name

    @classmethod
    def for_daemon(cls, daemon_url: str, tokens: BootstrapTokens) -> BootScripts:
        return cls(daemon_url, tokens.issue, lambda: own_wheel().name)

    def render(self, spec: ServiceSpec, row, runtime: MachineRuntime, replica_args: Sequence[str],
               engine_args: Sequence[str], env: dict[str, str]) -> str:
        """The script for replica `row` (a store ReplicaRow); issues its bootstrap token."""
        token = self.issue_token(spec.name, row.replica_id)
        command = " ".join(shlex.quote(a) for a in [*replica_args, "--", *engine_args])
        return string.Template(TEMPLATE.read_text()).substitute(
            daemon_url=shlex.quote(self.daemon_url),
            bootstrap_token=shlex.quote(token),
            service=shlex.quote(spec.name),
            replica_id=shlex.quote(row.replica_id),
            env_exports="\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())),
            python_version=PYTHON_VERSION,
            wheel_name=shlex.quote(self.wheel_name()),
            cloud=shlex.quote(runtime.notice_watcher or ""),
            replica_command=command,
        )
