"""A spec's launch revision: a short hash of every field a replica is launched from.

The controller stamps it on each replica it launches (replicas.spec_revision); a spec whose
revision differs from a live replica's replaces that replica (orchestrator.fleet.rollout, the
daemon's apply_spec). What a replica never reads applies in place: the service's name and its
`service:` section (replica counts, autoscaling, placement and load-balancing policies, probe,
ports, TLS), all of which the daemon's controller and load balancer act on themselves.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from orchestrator.spec.model import ServiceSpec

# The top-level keys of ServiceSpec.to_dict() that no launch reads. Everything else (engine,
# kv, resources with image_id and accelerators, the SkyPilot task keys: setup, run, envs,
# file_mounts, ...) is launch-relevant, so a field added later replaces replicas by default.
IN_PLACE_KEYS = frozenset({"name", "service"})


def launch_fields(spec: ServiceSpec) -> dict[str, Any]:
    """The part of the spec a replica is launched from."""
    return {k: v for k, v in spec.to_dict().items() if k not in IN_PLACE_KEYS}


def launch_revision(spec: ServiceSpec) -> str:
    """12 hex digits naming `launch_fields(spec)`; equal specs give equal revisions."""
    text = json.dumps(launch_fields(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def changed_launch_fields(old: ServiceSpec, new: ServiceSpec) -> list[str]:
    """The launch-relevant top-level keys that differ (for the update's event)."""
    a, b = launch_fields(old), launch_fields(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
