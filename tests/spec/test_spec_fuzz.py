"""The spec loader under property-based input (hypothesis): whatever the text or the structure,
load_spec_text either returns a spec that round-trips through the store's JSON or raises one
one-line SpecError; and alias bombs of any shape are refused before they expand."""

from __future__ import annotations

import json

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.spec import SpecError, load_spec_text, spec_from_json
from orchestrator.spec.parse import MAX_NODES, TOP_KEYS

SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["tiny", "local", "local-a", "/health", "2GiB", "A100:2"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=20)
keys = st.sampled_from([*TOP_KEYS, "replicas", "readiness_probe", "model", "zone", "any_of", "bogus"])
specs = st.dictionaries(keys, values | st.dictionaries(keys, values, max_size=5), max_size=7)


def check(text: str) -> None:
    try:
        spec = load_spec_text(text)
    except SpecError as err:
        assert str(err) and "\n" not in str(err)
        return
    stored = spec.to_json()
    json.loads(stored)  # what the store keeps is JSON
    assert spec_from_json(stored) == spec


@SETTINGS
@given(st.text(max_size=400))
def test_any_text_is_a_spec_or_one_spec_error(text):
    check(text)


@SETTINGS
@given(specs, st.booleans())
def test_any_structure_is_a_spec_or_one_spec_error(data, with_engine):
    if with_engine:
        data = {**data, "engine": {"model": "tiny"}, "name": "fuzzed"}
    check(yaml.safe_dump(data, allow_unicode=True))


@settings(max_examples=60, deadline=None, database=None)
@given(st.integers(1, 12), st.integers(1, 12))
def test_alias_bombs_are_refused_before_they_expand(levels, width):
    lines = ["name: bomb", "engine: {model: tiny}", "config:", "  l0: &l0 [" + ", ".join(['"lol"'] * width) + "]"]
    for level in range(1, levels + 1):
        lines.append(f"  l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    expanded = sum(width ** n for n in range(1, levels + 2))
    try:
        spec = load_spec_text("\n".join(lines))
    except SpecError as err:
        assert "alias" in str(err) or "values" in str(err)
        return
    assert expanded <= MAX_NODES and levels * width <= 64
    assert spec.task["config"]
