"""Weight lifecycle through vLLM's own paths.

Module level: vLLM's in-place layerwise reload (`reload_weights` -> initialize_layerwise_reload,
the model's load_weights, finalize_layerwise_reload) on upstream's MoE layer with the adapter on
a non-canonical (shuffled) layout. Served: the tiny Mixtral reloaded through
`POST /collective_rpc` (VLLM_SERVER_DEV_MODE=1) against fresh servers; never against a reloaded
stock server (stock vLLM's reload of the same weights changes its output: see UPSTREAM.md).
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
)

import moe_overlay as mo
from moe_overlay.models import moe_layer
from moe_overlay.models.moe_layer import OverlayRoutedExperts, adapter_scope
from tests.backends_for_tests import RelayoutBackend
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
    (what a captured graph reads); again after three more reloads."""
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
        assert torch.equal(layer.w13_weight, fresh.routed_experts.w13_weight)
        assert torch.equal(layer.w2_weight, fresh.routed_experts.w2_weight)
