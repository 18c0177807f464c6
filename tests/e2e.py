"""Shared pieces of the end-to-end tests: one served tiny twin with the overlay against the
same twin on stock vLLM (`MOE_OVERLAY_DISABLE=1`), compared token for token in fp32 and by
log-probability in bf16."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from moe_overlay.serving.harness import Server

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Q: What is 17 times 23?\nA:",
    "Mixture-of-Experts models route each token to",
    "1, 2, 3, 5, 8, 13,",
    "<html><body>",
    "The quick brown fox",
]
NEW_TOKENS = 32
# bf16 rounding differs between kernels, and where a tiny random model's router logits nearly
# tie a rounding difference can flip an expert choice; so the gate is on the distribution.
BF16_MEDIAN_TOLERANCE = 0.01  # nats, median |logprob difference| per token
BF16_P90_TOLERANCE = 0.05  # nats, 90th percentile
DISABLED = {"MOE_OVERLAY_DISABLE": "1"}


def config_variant(config: Path, out_dir: Path, **model: Any) -> Path:
    """`config` with `model.<key>` overridden (e.g. dtype), written into `out_dir`."""
    raw = yaml.safe_load(config.read_text())
    raw["model"].update(model)
    suffix = "-".join(str(v) for v in model.values())
    path = out_dir / f"{config.stem}-{suffix}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def generate(server: Server, model: str, prompts: list[str] = PROMPTS, tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy token ids, `tokens` per prompt: one request, so the prompts decode as one batch."""
    body = {"model": model, "prompt": prompts, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    return [c["token_ids"] for c in choices(server.post("/v1/completions", body), len(prompts))]


def prompt_logprobs(server: Server, model: str, sequences: list[list[int]], top: int = 0) -> list[list[dict]]:
    """vLLM's prompt log-probability entries of every token of each sequence after the first (each
    token's own and the `top` best at its place), one request for all."""
    body = {"model": model, "prompt": sequences, "max_tokens": 1, "temperature": 0, "prompt_logprobs": top}
    return [c["prompt_logprobs"][1:] for c in choices(server.post("/v1/completions", body), len(sequences))]


def score(server: Server, model: str, sequences: list[list[int]]) -> list[list[float]]:
    """Log-probability of every token of each sequence after the first, as this server computes it."""
    return [[entry[str(tok)]["logprob"] for entry, tok in zip(entries, ids[1:], strict=True)]
            for entries, ids in zip(prompt_logprobs(server, model, sequences), sequences, strict=True)]


def choices(response: dict[str, Any], prompts: int) -> list[dict[str, Any]]:
    """A batched completion's choices in the order of its prompts."""
    out = sorted(response["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in out] == list(range(prompts)), "one choice a prompt"
    return out


def prompt_ids(server: Server, model: str, prompts: list[str] = PROMPTS) -> list[list[int]]:
    body = {"model": model, "prompt": prompts, "max_tokens": 1, "return_token_ids": True}
    return [c["prompt_token_ids"] for c in choices(server.post("/v1/completions", body), len(prompts))]


def chat(server: Server, model: str) -> dict[str, Any]:
    return server.post("/v1/chat/completions", {"model": model, "max_tokens": 8, "temperature": 0,
                                                "messages": [{"role": "user", "content": "Hello!"}]})


def observe(server: Server, model: str) -> dict[str, Any]:
    """What a served twin answers: greedy completions, a chat, /v1/moe and the prompts' ids."""
    return {"completions": generate(server, model), "chat": chat(server, model), "moe": server.request("/v1/moe"),
            "prompt_ids": prompt_ids(server, model)}


def abs_diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return sorted(abs(x - y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


def assert_logprobs_agree(a: list[list[float]], b: list[list[float]]) -> None:
    """The bf16 gate: median and 90th percentile of |logprob difference| per token."""
    diffs = abs_diffs(a, b)
    assert len(diffs) >= len(PROMPTS) * NEW_TOKENS
    median, p90 = diffs[len(diffs) // 2], diffs[int(len(diffs) * 0.9)]
    summary = f"median {median:.4f}, p90 {p90:.4f}, max {diffs[-1]:.4f} nats"
    assert median <= BF16_MEDIAN_TOLERANCE and p90 <= BF16_P90_TOLERANCE, summary


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = abs_diffs(a, b)
    return sum(diffs) / len(diffs)
