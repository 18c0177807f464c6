"""The embedded tiny models: deterministic random weights and a locally built tokenizer.

Built on first use into a git-ignored folder; no hub access. A recipe change changes
its fingerprint, so a stale build is replaced instead of silently reused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

FINGERPRINT_FILE = "moe_overlay_recipe.json"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinyMixtralRecipe:
    """A Mixtral-architecture model small enough for CI, big enough to be non-trivial."""

    architecture: str = "MixtralForCausalLM"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4  # head_dim 32: vLLM's CPU attention rejects smaller
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 1024
    initializer_range: float = 0.08  # wide enough that greedy choices are not near-ties
    seed: int = 20261129
    tokenizer: str = "bytes-v1"  # token id = byte value; bump when the builder changes


    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


RECIPES = {"tiny-mixtral": TinyMixtralRecipe()}


def _progress(message: str) -> None:
    print(f"[moe-overlay] {message}", file=sys.stderr, flush=True)


def byte_symbols() -> list[str]:
    """The printable stand-in for each byte 0..255 that byte-level BPE vocabularies use:
    printable Latin-1 bytes stand for themselves, the rest map to code points from 256 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _build_tokenizer(out: Path):
    """A byte-level tokenizer (token id = byte value) with chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = {ch: i for i, ch in enumerate(byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tokenizer.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build(name: str, out: Path) -> Path:
    """Build the named tiny model into `out` unless an identical build is already there."""
    recipe = RECIPES[name]
    stamp = out / FINGERPRINT_FILE
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == recipe.fingerprint():
        return out
    _progress(f"building the embedded model {name!r} into {out}")
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = _build_tokenizer(tmp)
    vocab = len(tokenizer)
    _progress(f"tokenizer: byte-level, {vocab} tokens")
    config = MixtralConfig(
        vocab_size=vocab,  # no ids the tokenizer cannot decode
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        num_local_experts=recipe.num_local_experts,
        num_experts_per_tok=recipe.num_experts_per_tok,
        max_position_embeddings=recipe.max_position_embeddings,
        initializer_range=recipe.initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / FINGERPRINT_FILE).write_text(json.dumps({"name": name, "fingerprint": recipe.fingerprint(),
                                                    "recipe": asdict(recipe)}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    n_params = sum(p.numel() for p in model.parameters())
    _progress(f"built {name}: {n_params / 1e6:.2f} M parameters, {recipe.num_local_experts} experts")
    return out
