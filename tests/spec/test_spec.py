"""Service spec: SkyServe-style YAML loads; every bad input yields one line naming the field."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from orchestrator.common.errors import UserError
from orchestrator.spec import SpecError, load_spec, parse_spec, spec_from_json
from orchestrator.spec.model import Accelerator
from providers.base import Location

TEMPLATES = sorted((Path(__file__).resolve().parents[2] / "templates").glob("*.yaml"))
MINIMAL = {"name": "svc", "engine": {"model": "tiny"}}
# What the local cloud's provider offers by default (the control plane passes each
# provider's locations as `known`).
LOCAL = [Location("local", "local", z) for z in ("local-a", "local-b", "local-c")]

# SkyServe `service:` sections as its docs and examples write them.
SKYSERVE_SECTIONS = [
    {"readiness_probe": "/v1/models", "replicas": 2},
    {
        "readiness_probe": {
            "path": "/v1/chat/completions",
            "post_data": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            "initial_delay_seconds": 1800,
            "timeout_seconds": 30,
            "headers": {"Authorization": "Bearer x"},
        },
        "replica_policy": {
            "min_replicas": 1,
            "max_replicas": 5,
            "target_qps_per_replica": 3,
            "upscale_delay_seconds": 60,
            "downscale_delay_seconds": 600,
            "num_overprovision": 1,
            "base_ondemand_fallback_replicas": 1,
            "dynamic_ondemand_fallback": True,
            "spot_placer": "dynamic_fallback",
        },
        "load_balancing_policy": "round_robin",
        "ports": 8081,
        "tls": {"keyfile": "~/k.pem", "certfile": "~/c.pem"},
        "load_balancer": {"stream_timeout_seconds": 120},
    },
    {
        "readiness_probe": {"path": "/health", "post_data": '{"a": 1}', "endpoint_probe_interval_seconds": 5},
        "replica_policy": {"min_replicas": 0, "max_replicas": 3, "target_qps_per_replica": {"H100": 4, "A100:1": 2}},
        "load_balancing_policy": "instance_aware_least_load",
    },
]


def spec_of(**sections) -> dict:
    return {**MINIMAL, **sections}


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.name for p in TEMPLATES])
def test_templates_load_and_round_trip(path):
    spec = load_spec(path)
    assert parse_spec(spec.to_dict()) == spec
    assert spec_from_json(spec.to_json()) == spec
    # to_dict is plain data that YAML can write and read back
    assert parse_spec(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec


def test_expected_templates_exist():
    names = {p.name for p in TEMPLATES}
    assert {
        "local-tiny.yaml",
        "service-reference.yaml",
        "aws.yaml",
        "gcp.yaml",
        "azure.yaml",
        "multi-cloud.yaml",
    } <= names


def test_demo_template_is_two_spot_replicas_in_two_local_zones():
    spec = load_spec(TEMPLATES[0].with_name("local-tiny.yaml"))
    assert (spec.min_replicas, spec.max_replicas, spec.autoscaling) == (2, 2, False)
    assert spec.engine.is_tiny and spec.use_spot
    assert spec.candidate_locations(LOCAL) == LOCAL[:2]
    assert spec.clouds() == ["local"]
    assert spec.engine.block_size_for(on_cpu=True) == 32


@pytest.mark.parametrize("section", SKYSERVE_SECTIONS, ids=["simple", "full", "per-accelerator-qps"])
def test_skyserve_sections_load_unchanged(section):
    spec = parse_spec(spec_of(service=section))
    again = parse_spec(spec.to_dict())
    assert again == spec
    if "replicas" in section:
        assert spec.min_replicas == spec.max_replicas == section["replicas"]
        assert spec.to_dict()["service"]["replicas"] == section["replicas"]
    else:
        policy = section["replica_policy"]
        assert spec.min_replicas == policy["min_replicas"]
        assert spec.max_replicas == policy["max_replicas"]


def test_full_section_values():
    spec = parse_spec(spec_of(service=SKYSERVE_SECTIONS[1]))
    probe = spec.service.readiness_probe
    assert probe.path == "/v1/chat/completions" and probe.initial_delay_seconds == 1800
    assert probe.headers == {"Authorization": "Bearer x"} and probe.post_data["max_tokens"] == 1
    assert spec.service.load_balancing_policy == "round_robin"
    assert spec.service.ports == 8081 and spec.service.tls.keyfile == "~/k.pem"
    assert spec.service.extra == {"load_balancer": {"stream_timeout_seconds": 120}}
    params = spec.policy_params()
    assert (params.num_overprovision, params.base_ondemand_fallback_replicas, params.dynamic_ondemand_fallback) == (
        1,
        1,
        True,
    )
    # post_data given as a JSON string is decoded, as SkyServe does
    assert parse_spec(spec_of(service=SKYSERVE_SECTIONS[2])).service.readiness_probe.post_data == {"a": 1}


def test_our_service_sections_pass_skyserves_own_validation():
    """The other direction: our templates' `service:` sections are valid SkyServe."""
    service_spec = pytest.importorskip("sky.serve.service_spec")
    for path in TEMPLATES:
        section = dict(yaml.safe_load(path.read_text())["service"])
        section.pop("placement_policy", None)  # ours, the one key SkyServe does not know
        service_spec.SkyServiceSpec.from_yaml_config(section)
    for section in SKYSERVE_SECTIONS:
        service_spec.SkyServiceSpec.from_yaml_config(section)


def test_defaults():
    spec = parse_spec(MINIMAL)
    assert spec.min_replicas == spec.max_replicas == 1
    assert spec.service.load_balancing_policy == "least_load"
    assert spec.service.placement_policy == "default"
    probe = spec.service.readiness_probe
    assert (probe.initial_delay_seconds, probe.timeout_seconds) == (1200, 15)
    assert spec.service.replica_policy.upscale_delay_seconds == 300
    assert spec.service.replica_policy.downscale_delay_seconds == 1200
    assert (spec.kv.enabled, spec.kv.k, spec.kv.m) == (True, 4, 2)
    assert spec.use_spot is False  # SkyPilot's default: on-demand unless use_spot
    assert spec.candidate_locations(LOCAL) == LOCAL and spec.clouds() == []


def test_name_defaults_to_file_stem(tmp_path):
    path = tmp_path / "My_Service.yaml"
    path.write_text("engine:\n  model: tiny\n")
    assert load_spec(path).name == "my-service"
    assert load_spec(str(path)).name == "my-service"


def test_yaml_text_is_accepted():
    spec = load_spec("name: chat\nengine: {model: tiny, args: '--enforce-eager --seed 1'}\n")
    assert spec.name == "chat" and spec.engine.args == ("--enforce-eager", "--seed", "1")


@pytest.mark.parametrize(
    ("accelerators", "expected"),
    [
        ("A100:1", [Accelerator("A100", 1)]),
        ("A100", [Accelerator("A100", 1)]),
        ({"A100": 2}, [Accelerator("A100", 2)]),
        ({"A100": 1, "L4": 1}, [Accelerator("A100", 1), Accelerator("L4", 1)]),
        ({"A100": None, "L4": None}, [Accelerator("A100", 1), Accelerator("L4", 1)]),  # YAML set syntax
        (["H100:8", "A100:8"], [Accelerator("H100", 8), Accelerator("A100", 8)]),
        ([{"T4": 1}], [Accelerator("T4", 1)]),
    ],
)
def test_accelerator_forms(accelerators, expected):
    spec = parse_spec(spec_of(resources={"accelerators": accelerators}))
    assert list(spec.resources.accelerators) == expected
    assert spec.policy_params().accelerator == expected[0].name
    assert spec.policy_params().accelerator_count == expected[0].count
    assert parse_spec(spec.to_dict()) == spec


def test_yaml_set_syntax_for_accelerators():
    spec = load_spec("name: s\nengine: {model: tiny}\nresources:\n  accelerators: {A100, V100}\n")
    assert [a.name for a in spec.resources.accelerators] == ["A100", "V100"]


def test_candidate_locations():
    known = [
        Location("aws", "us-east-1", "us-east-1a"),
        Location("aws", "us-east-1", "us-east-1b"),
        Location("aws", "us-west-2", "us-west-2a"),
        Location("gcp", "us-central1", "us-central1-a"),
    ]
    region = parse_spec(spec_of(resources={"cloud": "aws", "region": "us-east-1"}))
    assert region.candidate_locations(known) == known[:2]
    assert region.candidate_locations() == []  # zones unknown without a price book
    any_of = parse_spec(
        spec_of(
            resources={"any_of": [{"infra": "gcp/us-central1/us-central1-a"}, {"cloud": "aws", "region": "us-west-2"}]}
        )
    )
    assert any_of.candidate_locations(known) == [known[3], known[2]]
    assert any_of.candidate_locations() == [known[3]]  # fully named ones need no price book
    anywhere = parse_spec(MINIMAL)
    assert anywhere.candidate_locations(known) == known
    inherit = parse_spec(spec_of(resources={"cloud": "local", "any_of": [{"zone": "local-c"}]}))
    assert inherit.candidate_locations(LOCAL) == [Location("local", "local", "local-c")]
    assert any_of.clouds() == ["gcp", "aws"] and region.clouds() == ["aws"]


def test_infra_wildcards():
    spec = parse_spec(spec_of(resources={"infra": "aws/*/us-east-1a"}))
    assert (spec.resources.cloud, spec.resources.region, spec.resources.zone) == ("aws", None, "us-east-1a")


def test_kv_sizes():
    assert parse_spec(spec_of(kv={"store_max_bytes": "2GiB"})).kv.store_max_bytes == 2 * 1024**3
    assert parse_spec(spec_of(kv={"store_max_bytes": "512MB"})).kv.store_max_bytes == 512 * 10**6
    assert parse_spec(spec_of(kv={"store_max_bytes": 1000})).kv.store_max_bytes == 1000


def test_task_keys_are_kept():
    spec = parse_spec(spec_of(setup="pip install x", run="python serve.py", envs={"A": "1"}, num_nodes=1))
    assert spec.task == {"setup": "pip install x", "run": "python serve.py", "envs": {"A": "1"}, "num_nodes": 1}
    assert parse_spec(spec.to_dict()).task == spec.task


def test_spec_error_is_a_user_error():
    assert issubclass(SpecError, UserError)


BAD = [
    # (spec mapping or YAML text, the exact one-line message)
    (spec_of(service={"replica_policy": {"min_replicas": 3, "max_replicas": 2}}),
     "service.replica_policy.min_replicas: (3) > max_replicas (2)"),
    (spec_of(service={"replica_polcy": {"min_replicas": 1}}),
     "service.replica_polcy: unknown key; did you mean 'replica_policy'?"),
    (spec_of(service={"replicas": "two"}), "service.replicas: expected an integer, got 'two'"),
    ({"name": "svc", "engine": {"args": []}}, "engine.model: required (a HF model id, a local directory or 'tiny')"),
    ({"name": "svc"}, "engine: required (at least engine.model: a HF model id, a local directory or 'tiny')"),
    (spec_of(service={"replicas": 2, "replica_policy": {"min_replicas": 1}}),
     "service.replicas: give either replicas or replica_policy, not both"),
    (spec_of(service={"replica_policy": {"max_replicas": 2}}), "service.replica_policy.min_replicas: required"),
    (spec_of(service={"replica_policy": {"min_replicas": 1, "max_replicas": 3}}),
     "service.replica_policy.target_qps_per_replica: required when max_replicas (3) != min_replicas (1)"),
    (spec_of(service={"replica_policy": {"min_replicas": 1, "target_qps_per_replica": 2}}),
     "service.replica_policy.max_replicas: required when target_qps_per_replica is set"),
    (spec_of(service={"replicas": -1}), "service.replicas: expected a value >= 0, got -1"),
    (spec_of(service={"readiness_probe": "health"}), "service.readiness_probe: must start with '/', got 'health'"),
    (spec_of(service={"readiness_probe": {"initial_delay_seconds": 5}}), "service.readiness_probe.path: required"),
    (spec_of(service={"readiness_probe": {"path": "/h", "timeout_seconds": "fast"}}),
     "service.readiness_probe.timeout_seconds: expected a number, got 'fast'"),
    (spec_of(service={"load_balancing_policy": "random"}),
     "service.load_balancing_policy: expected one of round_robin, least_load, instance_aware_least_load, got 'random'"),
    (spec_of(service={"ports": 70000}), "service.ports: expected a value <= 65535, got 70000"),
    (spec_of(service={"tls": {"keyfile": "k.pem"}}), "service.tls.certfile: required"),
    (spec_of(service={"replica_policy": {"min_replicas": 1, "max_replicas": 1, "dynamic_ondemand_fallback": "yes"}}),
     "service.replica_policy.dynamic_ondemand_fallback: expected true or false, got 'yes'"),
    (spec_of(service=["replicas", 2]), "service: expected a mapping, got a list"),
    (spec_of(resources={"use_spot": "sometimes"}), "resources.use_spot: expected true or false, got 'sometimes'"),
    (spec_of(resources={"cloud": "a w s"}),
     "resources.cloud: expected a cloud name (letters, digits, '-'), got 'a w s'"),
    (spec_of(resources={"accelerators": "A100:x"}),
     "resources.accelerators: expected 'NAME' or 'NAME:COUNT', got 'A100:x'"),
    (spec_of(resources={"accelerators": {"A100": 0}}),
     "resources.accelerators: A100: expected a whole accelerator count >= 1, got 0"),
    (spec_of(resources={"any_of": [{"cloud": "aws"}, {"zonee": "b"}]}),
     "resources.any_of[1].zonee: unknown key; did you mean 'zone'?"),
    (spec_of(resources={"any_of": []}),
     "resources.any_of: expected a non-empty list of resource mappings, got a list"),
    (spec_of(resources={"infra": "aws", "cloud": "aws"}),
     "resources.infra: give either infra or cloud/region/zone, not both"),
    (spec_of(engine={"model": "tiny", "block_size": 0}), "engine.block_size: expected a value >= 1, got 0"),
    (spec_of(engine={"model": "tiny", "dtype": "fp8x"}),
     "engine.dtype: expected one of auto, half, float16, bfloat16, float, float32, got 'fp8x'"),
    (spec_of(engine={"model": "tiny", "args": {"a": 1}}),
     "engine.args: expected a list of vLLM command-line arguments, got a mapping"),
    (spec_of(kv={"k": 0}), "kv.k: expected a value >= 1, got 0"),
    (spec_of(kv={"m": 0}), "kv.m: expected a value >= 1, got 0"),  # the codec needs a parity shard
    (spec_of(kv={"store_max_bytes": "lots"}),
     "kv.store_max_bytes: expected bytes or a size like '2GiB' or '512MB', got 'lots'"),
    (spec_of(kv={"enabeld": True}), "kv.enabeld: unknown key; did you mean 'enabled'?"),
    ({**MINIMAL, "servce": {}}, "servce: unknown key; did you mean 'service'?"),
    ({**MINIMAL, "name": "My Service"},
     "name: expected lowercase letters, digits and '-', starting with a letter, got 'My Service'"),
    ("- a\n- b\n", "(top level): expected a mapping, got a list"),
    ("just-a-name", "file not found: just-a-name"),
    ("name: x\nengine:\n  model: tiny\n  model: other\n", "spec: duplicate key 'model' at line 4"),
    ("name: x\nengine: {model: tiny\nservice: {}\n", None),  # YAML syntax error: checked below
]  # fmt: skip


@pytest.mark.parametrize("bad,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_yields_one_line_error(bad, message):
    with pytest.raises(SpecError) as info:
        load_spec(bad) if isinstance(bad, str) else parse_spec(bad)
    text = str(info.value)
    assert "\n" not in text and "Traceback" not in text
    if message is None:
        assert text.startswith("spec: invalid YAML at line 3, column ")
    else:
        assert text == message
        assert not info.value.path or text.startswith(f"{info.value.path}: ")  # also available as data


def test_bad_yaml_in_a_file_names_file_and_line(tmp_path):
    path = tmp_path / "svc.yaml"
    path.write_text(
        textwrap.dedent("""\
        name: svc
        engine:
          model: tiny
        service:
          replicas: [1
        """)
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: invalid YAML at line ")
    assert "\n" not in str(info.value)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(SpecError, match=r"^file not found: .*nope\.yaml$"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match=r"^file not found: "):
        load_spec(str(tmp_path / "nope.yml"))
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(SpecError, match="empty; expected a mapping with at least engine.model"):
        load_spec(empty)
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path)
