"""The vLLM-side glue without an engine: scoping, selection, spec mapping, reload safety.

Upstream's own construction of RoutedExperts needs a running engine; here its
`_get_quant_method` and `weight_loader` are stood in for, and everything of ours is real.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="these tests check the glue against the installed vLLM")
import torch
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

import moe_overlay as mo
from moe_overlay.models import moe_layer
from moe_overlay.models.moe_layer import OverlayMoEMethod, OverlayRoutedExperts, adapter_scope, describe_rows
from moe_overlay.routing import softmax_topk
from tests.backends_for_tests import RelayoutBackend

E, H, I, K = 4, 64, 32, 2


def _moe_config(**overrides):
    cfg = dict(num_experts=E, hidden_dim=H, intermediate_size_per_partition=I, experts_per_token=K,
               activation=MoEActivation.SILU, in_dtype=torch.float32, has_bias=False,
               activation_situ_beta=None, activation_situ_linear_beta=None)
    return SimpleNamespace(**{**cfg, **overrides})


def _upstream(cfg):
    method = CustomOp.__new__(UnquantizedFusedMoEMethod)  # upstream's class, its engine-bound init skipped
    torch.nn.Module.__init__(method)
    method.moe = cfg
    method.process_weights_after_loading = lambda layer: None
    return method


def _layer(cfg, expert_map=None):
    layer = torch.nn.Module.__new__(OverlayRoutedExperts)
    torch.nn.Module.__init__(layer)
    layer.moe_config = cfg
    layer.apply_router_weight_on_input = False
    layer._expert_map = expert_map
    layer.expert_map_manager = SimpleNamespace(num_fused_shared_experts=0)
    layer.layer_name = "model.layers.0.mlp.experts"
    return layer


@pytest.fixture
def upstream(monkeypatch):
    cfg = _moe_config()
    method = _upstream(cfg)
    monkeypatch.setattr(RoutedExperts, "_get_quant_method", lambda self, prefix, qc, mc: method)
    monkeypatch.setattr(moe_layer, "SCOPES", [])
    return method


def test_outside_an_overlay_architecture_the_layer_is_stock(upstream, monkeypatch):
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "torch")
    layer = _layer(upstream.moe)
    assert layer._get_quant_method("p", None, upstream.moe) is upstream
    assert describe_rows() == []


def test_inside_the_scope_the_adapter_runs_the_experts(upstream, monkeypatch):
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "torch")
    layer = _layer(upstream.moe)
    with adapter_scope("TestForCausalLM"):
        method = layer._get_quant_method("model.layers.0.mlp.experts", None, upstream.moe)
    assert isinstance(method, OverlayMoEMethod) and method.upstream is upstream
    assert method.spec == mo.MoESpec(E, H, I, K, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    layer.w13_weight = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=gen), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.randn(E, H, I, generator=gen), requires_grad=False)
    method.process_weights_after_loading(layer)
    x = torch.randn(5, H, generator=gen)
    w, ids = softmax_topk(torch.randn(5, E, generator=gen), K)
    expected = mo.PreparedExperts(method.spec, {"w13": layer.w13_weight, "w2": layer.w2_weight},
                                  mo.get_backend("torch")).apply(x, w, ids)
    assert torch.equal(method.apply(layer, x, w.double(), ids.long(), None, None), expected)
    [row] = describe_rows()
    assert row["layer"] == "model.layers.0.mlp.experts" and row["backend"] == "torch" and row["prepared"]
    assert row["top_k"] == K and row["weight_on_input"] is False


def test_vllm_backend_leaves_upstream_in_place(upstream, monkeypatch):
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "vllm")
    layer = _layer(upstream.moe)
    with adapter_scope("TestForCausalLM"):
        assert layer._get_quant_method("l0", None, upstream.moe) is upstream
    [row] = describe_rows()
    assert row["backend"] == "vllm" and row["layout"] == "owned by vLLM" and row["top_k"] == K
    assert row["kernel"].startswith("UnquantizedFusedMoEMethod")


def test_unmapped_layers_fall_back_to_vllm_or_fail_in_strict_mode(upstream, monkeypatch):
    upstream.moe.activation = MoEActivation.RELU2
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "torch")
    layer = _layer(upstream.moe)
    with adapter_scope("TestForCausalLM"):
        assert layer._get_quant_method("l0", None, upstream.moe) is upstream
        assert "activation 'relu2' is not mapped" in describe_rows()[0]["reason"]
        monkeypatch.setenv("MOE_OVERLAY_STRICT", "1")
        with pytest.raises(mo.BackendUnavailableError, match=r"l0: activation 'relu2' is not mapped.*strict"):
            _layer(upstream.moe)._get_quant_method("l0", None, upstream.moe)


def test_aiters_fused_shared_experts_are_refused_by_name(upstream, monkeypatch):
    """VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS gives the layer its shared expert as one more local
    expert (DeepSeek-V3: 257 for 256): the adapter does not model it, so the layer is refused while it
    is built (strict) or left on vLLM's kernel (auto), never loaded into a spec of the wrong size."""
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "torch")
    monkeypatch.setenv("MOE_OVERLAY_STRICT", "1")
    layer = _layer(upstream.moe)
    layer.expert_map_manager.num_fused_shared_experts = 1
    with adapter_scope("TestForCausalLM"), pytest.raises(
            mo.BackendUnavailableError,
            match=r"^l0: AITER's fused shared experts \(VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS\): 1 shared "
                  r"expert\(s\) run as routed experts 4\.\.4, which the adapter does not model"):
        layer._get_quant_method("l0", None, upstream.moe)
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "auto")
    with adapter_scope("TestForCausalLM"):
        assert layer._get_quant_method("l0", None, upstream.moe) is upstream
    assert describe_rows()[-1]["backend"] == "vllm"


def test_spec_maps_situ_and_the_expert_map():
    cfg = _moe_config(activation=MoEActivation.SITU, activation_situ_beta=4.0, activation_situ_linear_beta=25.0)
    layer = _layer(cfg, expert_map=torch.tensor([-1, 0, -1, 1], dtype=torch.int32))
    spec = moe_layer.spec_from_layer(layer, _upstream(cfg))
    assert spec.activation == mo.Activation.situ(4.0, 25.0)
    assert spec.expert_map == (-1, 0, -1, 1) and spec.num_local_experts == 2


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_computes_upstreams_situ_and_mul(linear_beta):
    """Upstream clips `up` only when activation_situ_linear_beta is set (SituAndMul: linear_beta None
    passes `up` through); the adapter's SiTU equals upstream's own op on the same gate/up values."""
    from vllm.model_executor.layers.activation import SituAndMul

    from moe_overlay.activations import apply_gated
    from tests.vllm_layers import vllm_context

    cfg = _moe_config(activation=MoEActivation.SITU, activation_situ_beta=4.0, activation_situ_linear_beta=linear_beta)
    activation = moe_layer.spec_from_layer(_layer(cfg), _upstream(cfg)).activation
    gate_up = torch.randn(6, 2 * I, generator=torch.Generator().manual_seed(3)) * 40  # |up| well past 25
    with vllm_context():
        expected = SituAndMul(4.0, linear_beta).forward_native(gate_up)
    torch.testing.assert_close(apply_gated(activation, gate_up), expected)


def test_reload_restores_before_writing_so_nothing_is_shuffled_twice(upstream, monkeypatch):
    """A partial weight update (one expert) on a shuffled layer must give exactly the
    result of a fresh load of the updated weights."""
    shuffled = mo.Layout("test-shuffle", shuffle=(16, 16))
    writes = []

    def upstream_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        writes.append(weight_name)
        param.data[expert_id].copy_(loaded_weight)

    monkeypatch.setattr(RoutedExperts, "weight_loader", upstream_loader)
    spec = mo.MoESpec(E, H, I, K, dtype=torch.float32)
    layer = _layer(upstream.moe)
    scope = moe_layer.Scope("Test")
    moe_layer.SCOPES.append(scope)
    record = scope.add("l0", {})
    method = OverlayMoEMethod(upstream, spec, mo.Selection(RelayoutBackend(shuffled), "test"), record)
    layer.quant_method = method
    gen = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    method.process_weights_after_loading(layer)
    assert method.prepared.layout == shuffled
    new_expert = torch.randn(2 * I, H, generator=gen)
    layer.weight_loader(layer.w13_weight, new_expert, "w13", "w1", 2)  # RL weight sync of one expert
    assert writes == ["w13"] and method.prepared.layout == mo.CANONICAL
    method.process_weights_after_loading(layer)
    w13[2] = new_expert
    x = torch.randn(7, H, generator=gen)
    w, ids = softmax_topk(torch.randn(7, E, generator=gen), K)
    fresh = mo.PreparedExperts(spec, {"w13": w13, "w2": w2}, mo.get_backend("torch")).apply(x, w, ids)
    assert torch.equal(method.apply(layer, x, w, ids, None, None), fresh)


@pytest.mark.parametrize("amx", [False, True])
def test_auto_passes_vllm_over_for_quantised_layers_on_a_cpu_without_amx(monkeypatch, amx):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    fp8 = mo.MoESpec(E, 256, 256, K, dtype=torch.bfloat16,
                     quant=mo.QuantSpec("fp8", "block", activations="fp8_block"))
    cpu = mo.Platform.of("cpu")
    chosen = mo.select_backend(fp8, cpu)
    if amx:
        assert chosen.backend.name == "vllm"
    else:
        assert chosen.backend.name == "torch"
        assert "vLLM's CPU lane has no fp8 MoE kernel on a CPU without AMX tiles" in chosen.rejected["vllm"]
    assert mo.select_backend(mo.MoESpec(E, H, I, K, dtype=torch.bfloat16), cpu).backend.name == "vllm"
