"""The names both ends of encrypted shard traffic agree on, without a cloud or a crypto library.

The daemon (orchestrator.control.kvtls) issues each replica's shard store a certificate for
`store_server_name(replica_id)`, signed by the service's CA; the connector (orchestrator.replica.kv)
verifies a peer store against that CA and that name. The replica keeps the files under its home
with the names below.
"""

from __future__ import annotations

import hashlib

CA_FILE, CERT_FILE, KEY_FILE = "kv-ca.crt", "kv-store.crt", "kv-store.key"


def store_server_name(node_id: str) -> str:
    """The DNS name in the certificate of store `node_id` (a hash: any id makes a valid name)."""
    return f"{hashlib.sha256(node_id.encode()).hexdigest()[:32]}.kv-store.invalid"
