"""The random-weight demo model: built once, identical everywhere, and served by real vLLM."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from orchestrator.replica import demo_model
from tests.fakes.vllm_procs import Processes, greedy_token_ids, start_vllm


def _build(python: Path, root: Path, size: str = "tiny") -> Path:
    out = subprocess.run([str(python), "-m", "orchestrator.replica.demo_model", "--size", size, "--root", str(root)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(out.stdout.strip().splitlines()[-1])


def test_sizes_fit_vllm_cpu_and_the_benchmark():
    for size in demo_model.SIZES.values():
        assert size.hidden_size // size.num_attention_heads == 64  # CPU attention rejects head_dim 16
    assert demo_model.SIZES["tiny"].max_position_embeddings >= 1024
    assert demo_model.SIZES["bench"].max_position_embeddings >= 4096
    assert demo_model.recipe_key("tiny") != demo_model.recipe_key("bench")


def test_unknown_size_is_a_one_line_user_error(tmp_path):
    from orchestrator.common.errors import UserError

    with pytest.raises(UserError, match="unknown demo model size 'huge'"):
        demo_model.ensure_demo_model("huge", tmp_path)


@pytest.mark.vllm
def test_concurrent_builds_agree_and_later_calls_reuse_it(replica_runtime, tmp_path):
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: _build(replica_runtime, tmp_path), range(2))
    assert first == second
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no half-written temp folders left
    weights = first / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert _build(replica_runtime, tmp_path) == first
    assert weights.stat().st_mtime_ns == stamp  # cached: not rebuilt

    # Fixed seeds: a build elsewhere has the same bytes (replicas on other machines agree).
    other = _build(replica_runtime, tmp_path / "elsewhere")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (other / name).read_bytes() == (first / name).read_bytes(), name

    config = json.loads((first / "config.json").read_text())
    assert config["num_hidden_layers"] == demo_model.SIZES["tiny"].num_hidden_layers
    assert config["vocab_size"] == demo_model.VOCAB_SIZE


@pytest.mark.vllm
def test_tokenizer_has_a_chat_template(replica_runtime, tiny_model):
    script = ("import sys; from transformers import AutoTokenizer;"
              "t = AutoTokenizer.from_pretrained(sys.argv[1]);"
              "print(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False,"
              " add_generation_prompt=True))")
    out = subprocess.run([str(replica_runtime), "-c", script, str(tiny_model)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "<s><|user|>hi<|end|><|assistant|>"


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_vllm_serves_it_with_varied_greedy_output(replica_runtime, tiny_model, tmp_path):
    procs = Processes(replica_runtime, tmp_path)
    try:
        base = start_vllm(procs, "vllm", tiny_model)
        ids = greedy_token_ids(base, tiny_model, list(range(20, 120)), 64)
        # Default-init random models repeat one token; ours must not (tests tell runs apart).
        assert len(set(ids)) > 16, ids
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": str(tiny_model), "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert chat.status_code == 200, chat.text[:500]
        assert chat.json()["usage"]["completion_tokens"] == 16
    finally:
        procs.kill_all()
