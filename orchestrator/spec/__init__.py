"""The service YAML (SkyServe-compatible): `model` holds the frozen dataclasses, `parse` the
loader and validator. The names most callers need are re-exported here."""

from orchestrator.spec.model import ServiceSpec
from orchestrator.spec.parse import SpecError, load_spec, load_spec_text, parse_spec, spec_from_json

__all__ = ["ServiceSpec", "SpecError", "load_spec", "load_spec_text", "parse_spec", "spec_from_json"]
