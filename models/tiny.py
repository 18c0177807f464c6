"""The embedded tiny models: deterministic random weights and a locally built tokenizer.

Built on first use into a git-ignored folder; no hub access. A recipe change changes
its fingerprint, so a stale build is replaced instead of silently reused. Each twin's
recipe lives in `models/twins/<architecture>.py` and registers itself in `RECIPES`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

FINGERPRINT_FILE = "moe_overlay_recipe.json"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class Tokens:
    """What a twin's config needs of the byte-level tokenizer built beside it."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int


class Recipe(ABC):
    """A twin: the architecture name and config keys of a real checkpoint, tiny sizes.

    Subclasses are frozen dataclasses whose fields are the recipe (every field, a seed among
    them, is in the fingerprint) and implement `write`, which puts config.json and the
    weights into a folder.
    """

    tokenizer: ClassVar[str] = "bytes-v1"  # token id = byte value; bump when the builder changes

    @abstractmethod
    def write(self, out: Path, tokens: Tokens) -> str:
        """Write config.json and the safetensors into `out`; return a one-line summary."""

    def fingerprint(self) -> str:
        payload = {"class": type(self).__name__, "tokenizer": self.tokenizer, **asdict(self)}  # type: ignore[call-overload]
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


RECIPES: dict[str, Recipe] = {}


def register(name: str, recipe: Recipe) -> None:
    if name in RECIPES:
        raise ValueError(f"embedded model {name!r} is registered twice")
    RECIPES[name] = recipe


def progress(message: str) -> None:
    print(f"[moe-overlay] {message}", file=sys.stderr, flush=True)


def byte_symbols() -> list[str]:
    """The printable stand-in for each byte 0..255 that byte-level BPE vocabularies use:
    printable Latin-1 bytes stand for themselves, the rest map to code points from 256 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _build_tokenizer(out: Path) -> Tokens:
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
    return Tokens(len(fast), fast.bos_token_id, fast.eos_token_id)


def write_checkpoint(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """config.json and model.safetensors as a hub checkpoint has them; returns the parameter count."""
    from safetensors.torch import save_file

    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values())


def build(name: str, out: Path) -> Path:
    """Build the named tiny model into `out` unless an identical build is already there."""
    from . import twins  # noqa: F401  (registers every twin's recipe)

    recipe = RECIPES[name]
    if _built(out, recipe):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:  # one builder at a time; the rest wait, then reuse
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _built(out, recipe):
            _build(name, recipe, out)
    return out


def _built(out: Path, recipe: Recipe) -> bool:
    stamp = out / FINGERPRINT_FILE
    return stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == recipe.fingerprint()


def _build(name: str, recipe: Recipe, out: Path) -> None:
    progress(f"building the embedded model {name!r} into {out}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokens = _build_tokenizer(tmp)
    progress(f"tokenizer: byte-level, {tokens.vocab_size} tokens")
    summary = recipe.write(tmp, tokens)
    (tmp / FINGERPRINT_FILE).write_text(json.dumps({"name": name, "fingerprint": recipe.fingerprint(),
                                                    "recipe": asdict(recipe)}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    progress(f"built {name}: {summary}")
