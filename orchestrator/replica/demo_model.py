"""Random-weight Llama models for the local cloud, tests and benchmarks (no download).

`ensure_demo_model("tiny")` builds, once per machine, a byte-level BPE tokenizer (with a chat
template, so /v1/chat/completions works) and a LlamaForCausalLM with fixed-seed random weights,
in Hugging Face format for vLLM. The folder name carries a key of the recipe, so a changed
recipe builds a new folder, and concurrent builders never expose a half-written one (each builds
in a temporary folder and renames it into place). Weights have a large standard deviation (with
the default init a random model repeats one token) and the special tokens' logits are zeroed,
so greedy decoding never stops early on EOS. Needs torch, transformers and tokenizers (the
replica runtime has them), imported only to build.

    python -m orchestrator.replica.demo_model --size tiny [--root DIR]   # prints the model folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.common.paths import models_dir

# Bump when the recipe changes in a way the size parameters do not show.
RECIPE_VERSION = 1
SEED = 1234
WEIGHT_STD = 0.5
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A few sentences to learn ~250 merges from; the text only shapes the vocabulary.
CORPUS = [
    "Spot instances are spare cloud capacity sold at a discount and reclaimed at short notice.",
    "The orchestrator places replicas across zones, regions and clouds to hedge preemptions.",
    "When a notice arrives the replica drains, flushes its KV cache and requests move elsewhere.",
    "Erasure coding splits each block into data and parity shards kept on peer replicas.",
    "A large language model predicts the next token from the tokens it has seen so far.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Hello, how are you today? I am fine, thank you. What would you like to talk about?",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in prices, latencies and counts.",
]


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


# head_dim = hidden / heads must be 64: vLLM's CPU attention rejects 16.
SIZES: dict[str, ModelSize] = {
    # Loads in vLLM CPU in ~20 s; prompts of many 32-token blocks fit.
    "tiny": ModelSize(128, 256, 2, 2, 2, 2048),
    # For tests/benchmarks/bench_migration.py: recomputing a 2,000-token prompt takes well over a
    # second on 2 cores, while its KV (GQA, 4 layers x 2 KV heads) stays ~2 KiB per token,
    # so loading it is far cheaper than recomputing it.
    "bench": ModelSize(512, 1024, 4, 8, 2, 8192),
}


def recipe_key(size: str) -> str:
    """A short content key of everything that determines the model's bytes."""
    recipe = {"v": RECIPE_VERSION, "seed": SEED, "std": WEIGHT_STD, "vocab": VOCAB_SIZE,
              "special": SPECIAL_TOKENS, "chat": CHAT_TEMPLATE, "corpus": CORPUS,
              "size": asdict(SIZES[size])}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def default_root() -> Path:
    return models_dir()


def ensure_demo_model(size: str = "tiny", root: Path | None = None) -> Path:
    """The folder of the demo model of this size, built first if it is not there yet.
    Raises UserError for an unknown size."""
    if size not in SIZES:
        from orchestrator.common.errors import UserError

        raise UserError(f"unknown demo model size {size!r}: expected one of {', '.join(SIZES)}")
    root = Path(root) if root is not None else default_root()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"demo-llama-{size}-{recipe_key(size)}"
    if (final / "config.json").exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _build(SIZES[size], tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; other users' replicas read it too
        try:
            os.rename(tmp, final)  # atomic; fails if another builder got there first
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=10**6,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _build(size: ModelSize, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(out)
    assert len(tokenizer) <= VOCAB_SIZE, len(tokenizer)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, **asdict(size), tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                continue  # keep RMSNorm gains at 1
            param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)
        # Never predict a special token (EOS would end greedy runs at random lengths).
        special_ids = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
        model.lm_head.weight[special_ids] = 0
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "demo_model.json").write_text(json.dumps({"recipe": asdict(size), "seed": SEED}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args(argv)
    print(ensure_demo_model(args.size, args.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
