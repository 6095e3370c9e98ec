"""orchestrator.spec.revision: which spec changes replace replicas (a new launch revision) and
which apply in place."""

from __future__ import annotations

from orchestrator.spec import load_spec_text
from orchestrator.spec.revision import changed_launch_fields, launch_revision

BASE = """
name: svc
service:
  replicas: 2
  load_balancing_policy: least_load
resources:
  cloud: local
  any_of: [{zone: local-a}, {zone: local-b}]
engine:
  model: tiny
"""


def test_launch_fields_change_the_revision():
    base = load_spec_text(BASE)
    for old, new, field in [
        ("model: tiny", "model: tiny\n  args: [--seed, '1']", "engine"),
        ("model: tiny", "model: Qwen/Qwen2.5-0.5B", "engine"),
        ("cloud: local", "cloud: local\n  image_id: img-2", "resources"),
        ("name: svc", "name: svc\nsetup: pip install x", "setup"),
        ("name: svc", "name: svc\nkv: {k: 2, m: 1}", "kv"),
    ]:
        changed = load_spec_text(BASE.replace(old, new, 1))
        assert launch_revision(changed) != launch_revision(base), field
        assert changed_launch_fields(base, changed) == [field]


def test_service_section_changes_apply_in_place():
    base = load_spec_text(BASE)
    changed = load_spec_text(BASE.replace("replicas: 2", "replicas: 5").replace("least_load", "round_robin"))
    assert launch_revision(changed) == launch_revision(base)
    assert changed_launch_fields(base, changed) == []
    assert launch_revision(load_spec_text(BASE)) == launch_revision(base)  # stable
