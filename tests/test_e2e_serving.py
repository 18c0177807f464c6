"""End to end on the CPU lane: the embedded tiny Mixtral served by vLLM with the overlay
(backend torch) against the same server with the overlay disabled (stock vLLM)."""

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
    config_variant,
    mean_abs_diff,
    observe,
    score,
)

CONFIG = ROOT / "configs" / "tiny-mixtral.yaml"
MODEL = "tiny-mixtral"

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def float32_runs(tmp_path_factory):
    ensure_builtin("tiny-mixtral")
    logs = tmp_path_factory.mktemp("logs")
    config = config_variant(CONFIG, tmp_path_factory.mktemp("cfg"), dtype="float32")
    runs = {}
    for name, env in (("overlay", {}), ("stock", DISABLED)):
        with serve(config, logs / f"{name}.log", env) as server:
            runs[name] = observe(server, MODEL)
            if name == "overlay":  # sequences the bf16 servers score against fp32's answer
                runs["sequences"] = [p + t for p, t in zip(runs[name]["prompt_ids"], runs[name]["completions"],
                                                           strict=True)]
                runs["scores"] = score(server, MODEL, runs["sequences"])
        runs[name]["log"] = server.log()
    return runs


@pytest.fixture(scope="module")
def bfloat16_runs(tmp_path_factory, float32_runs):
    logs = tmp_path_factory.mktemp("logs")
    config = config_variant(CONFIG, tmp_path_factory.mktemp("cfg"), dtype="bfloat16")
    runs = {"fp32": float32_runs["scores"]}
    for name, env in (("overlay", {}), ("stock", DISABLED)):
        with serve(config, logs / f"{name}.log", env) as server:
            runs[name] = score(server, MODEL, float32_runs["sequences"])
    return runs


def test_float32_greedy_tokens_identical(float32_runs):
    overlay, stock = float32_runs["overlay"]["completions"], float32_runs["stock"]["completions"]
    assert all(len(t) == NEW_TOKENS for t in overlay)
    assert overlay == stock


def test_both_openai_endpoints_answer(float32_runs):
    for run in (float32_runs["overlay"], float32_runs["stock"]):
        assert len(run["prompt_ids"]) == len(PROMPTS)
        choice = run["chat"]["choices"][0]
        assert choice["message"]["role"] == "assistant" and run["chat"]["usage"]["completion_tokens"] == 8
    assert float32_runs["overlay"]["chat"]["choices"][0]["message"]["content"] == \
        float32_runs["stock"]["chat"]["choices"][0]["message"]["content"]


def test_v1_moe_lists_every_layer_from_the_engine(float32_runs):
    status, payload = float32_runs["overlay"]["moe"]
    assert status == 200
    layers = payload["layers"]
    assert [row["layer"] for row in layers] == [f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)]
    for row in layers:
        assert row["backend"] == "torch" and row["kernel"] == "moe_overlay::reference_experts"
        assert row["prepared"] is True and "requested (torch)" in row["reason"]
        assert row["worker"] == 0 and row["experts"] == "8/8"


def test_startup_table_in_the_log(float32_runs):
    log = float32_runs["overlay"]["log"]
    assert "[moe-overlay] MixtralForCausalLM: 2 MoE layers" in log
    header = next(line for line in log.splitlines() if line.startswith("layer "))
    assert header.split() == ["layer", "backend", "kernel", "layout", "quantisation", "tuned", "reason"]
    assert re.search(r"model\.layers\.1\.block_sparse_moe\.experts\s+torch\s+moe_overlay::reference_experts"
                     r"\s+canonical\s+none\s+n/a\s+requested", log)


def test_plugin_runs_once_in_each_process(float32_runs):
    pids = re.findall(r"\[moe-overlay\] pid (\d+): plugin active", float32_runs["overlay"]["log"])
    roles = re.findall(r"\((APIServer|EngineCore|Worker|VllmWorker-\d+) pid=(\d+)\)", float32_runs["overlay"]["log"])
    assert len(pids) == len(set(pids)) == 3  # API server, engine core, worker: once each
    seen_roles = {role.split("-")[0] for role, pid in roles if pid in pids}
    assert {"APIServer", "EngineCore"} <= seen_roles and seen_roles & {"Worker", "VllmWorker"}


def test_kill_switch_runs_stock(float32_runs):
    stock = float32_runs["stock"]
    assert "plugin active" not in stock["log"] and "disabled by MOE_OVERLAY_DISABLE=1" in stock["log"]
    status, payload = stock["moe"]
    assert status == 503 and "not active" in payload["error"]
    assert "MoE layers" not in stock["log"]


def test_bfloat16_logprobs_agree(bfloat16_runs):
    assert_logprobs_agree(bfloat16_runs["overlay"], bfloat16_runs["stock"])


def test_bfloat16_overlay_is_as_close_to_float32_as_stock(bfloat16_runs):
    mean_overlay = mean_abs_diff(bfloat16_runs["overlay"], bfloat16_runs["fp32"])
    mean_stock = mean_abs_diff(bfloat16_runs["stock"], bfloat16_runs["fp32"])
    assert mean_overlay <= 1.25 * mean_stock + 1e-3, f"overlay {mean_overlay:.4f} vs stock {mean_stock:.4f} nats"
