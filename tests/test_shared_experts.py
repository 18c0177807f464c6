"""Shared experts and routed scaling stay upstream's: the overlay's output equals stock.

Upstream's MoERunner runs the shared experts itself unless the quant method's kernel says it
overlaps them (`mk_can_overlap_shared_experts`), adds their output, and applies
routed_scaling_factor either in the router (to the top-k weights) or, with
`apply_routed_scale_to_output`, to the routed output. The adapter's `apply` gets the routed
tokens and weights as upstream computed them and returns only the routed sum. Each case below
builds the same layer three ways: upstream's stock UnquantizedFusedMoEMethod, the overlay, and
plain maths written here; a shared contribution dropped or added twice, or a scaling lost or
applied twice, breaks the equalities.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="these tests run upstream's MoE runner")
import torch
from torch import nn

from moe_overlay.models import moe_layer
from moe_overlay.models.moe_layer import OverlayMoEMethod, OverlayRoutedExperts, adapter_scope
from tests.vllm_layers import build_moe, forward, load, vllm_context

E, H, I, T = 8, 64, 32, 7
SCALE = 2.5


class SharedMLP(nn.Module):
    """A gated MLP standing in for the model's shared expert(s) (any module works for the runner)."""

    def __init__(self, gen: torch.Generator, width: int = 48) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(2 * width, H, generator=gen) * 0.2, requires_grad=False)
        self.down = nn.Parameter(torch.randn(H, width, generator=gen) * 0.2, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x.float() @ self.gate_up.T).chunk(2, dim=-1)
        return ((nn.functional.silu(gate) * up) @ self.down.T).to(x.dtype)


def llama4_routing(hidden_states, gating_output, topk, renormalize):
    """Maverick's router as upstream writes it: top-k on the logits, the weight sigmoid(logit)."""
    scores, ids = torch.topk(gating_output, topk, dim=-1)
    return torch.sigmoid(scores.float()), ids.to(torch.int32)


def experts_and_checkpoint(gen):
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, I, generator=gen) * 0.2
    checkpoint = {}
    for e in range(E):
        checkpoint[f"{e}.gate_proj.weight"] = w13[e, :I]
        checkpoint[f"{e}.up_proj.weight"] = w13[e, I:]
        checkpoint[f"{e}.down_proj.weight"] = w2[e]
    return w13, w2, checkpoint


def expert(w13, w2, e, x):
    gate, up = (x @ w13[e].T).chunk(2, dim=-1)
    return (nn.functional.silu(gate) * up) @ w2[e].T


def deepseek_routing(logits, bias, top_k, groups, keep):
    """Sigmoid scores; bias for selection only; groups ranked by their top-2 biased sum; the
    unbiased scores of the chosen experts, renormalised, are the weights."""
    scores = torch.sigmoid(logits.float())
    biased = scores + bias
    per_group = biased.view(T, groups, -1)
    group_score = per_group.topk(2, dim=-1).values.sum(dim=-1)
    kept = torch.zeros_like(group_score).scatter_(1, group_score.topk(keep, dim=-1).indices, 1.0)
    mask = kept.repeat_interleave(E // groups, dim=1).bool()
    ids = biased.masked_fill(~mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


CASES = {
    # DeepSeek-V3: grouped sigmoid routing with bias, x2.5 on the top-k weights, one shared expert
    "deepseek-scale-in-router": dict(
        top_k=2, use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
        renormalize=True, routed_scaling_factor=SCALE),
    # the same, with the runner scaling the routed output instead
    "deepseek-scale-on-output": dict(
        top_k=2, use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
        renormalize=True, routed_scaling_factor=SCALE, apply_routed_scale_to_output=True),
    # Llama-4 Maverick: top-1, sigmoid weight applied to the expert's input, one shared expert
    "maverick-weight-on-input": dict(
        top_k=1, custom_routing_function=llama4_routing, renormalize=False, apply_router_weight_on_input=True),
}


def plain(case, x, logits, bias, w13, w2, shared):
    kw = CASES[case]
    xf = x.float()
    if kw.get("use_grouped_topk"):
        weights, ids = deepseek_routing(logits, bias, kw["top_k"], kw["num_expert_group"], kw["topk_group"])
        weights = weights * SCALE
    else:
        weights, ids = llama4_routing(xf, logits.float(), kw["top_k"], False)
    out = torch.zeros_like(xf)
    for t in range(T):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            if kw.get("apply_router_weight_on_input"):
                out[t] += expert(w13, w2, e, xf[t] * w)
            else:
                out[t] += w * expert(w13, w2, e, xf[t])
    return out + shared(xf)


def build(case, overlay: bool, shared: nn.Module, bias: torch.Tensor):
    kw = dict(CASES[case])
    if kw.get("use_grouped_topk"):
        kw["e_score_correction_bias"] = bias
    with adapter_scope("TestForCausalLM"):
        return build_moe(num_experts=E, hidden_size=H, intermediate_size=I, params_dtype=torch.float32,
                         shared_experts=shared, routed_experts_cls=OverlayRoutedExperts if overlay else None,
                         **kw)


@pytest.fixture(autouse=True)
def _vllm(monkeypatch):
    monkeypatch.setattr(moe_layer, "SCOPES", [])
    monkeypatch.delenv("MOE_OVERLAY_STRICT", raising=False)
    with vllm_context():
        yield


@pytest.mark.parametrize("case", CASES)
def test_shared_experts_and_routed_scaling_reach_the_output_exactly_as_stock(case, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    w13, w2, checkpoint = experts_and_checkpoint(gen)
    shared = SharedMLP(gen)
    bias = torch.randn(E, generator=gen) * 0.5
    x = torch.randn(T, H, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    expected = plain(case, x, logits, bias, w13, w2, shared)

    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "vllm")  # the overlay leaves upstream's method: stock
    stock = build(case, overlay=False, shared=shared, bias=bias)
    assert type(stock.routed_experts.quant_method).__name__ == "UnquantizedFusedMoEMethod"
    load(stock, checkpoint)
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "torch")
    overlay = build(case, overlay=True, shared=shared, bias=bias)
    assert isinstance(overlay.routed_experts.quant_method, OverlayMoEMethod)
    load(overlay, checkpoint)

    out_stock, out_overlay = forward(stock, x, logits), forward(overlay, x, logits)
    torch.testing.assert_close(out_stock, expected, rtol=1e-4, atol=1e-4)  # the plain maths is right
    torch.testing.assert_close(out_overlay, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_overlay, out_stock, rtol=1e-5, atol=1e-5)

    # The same layer with the shared contribution taken out, or the scaling not applied, differs:
    routed_only = expected - shared(x.float())
    assert (out_overlay - routed_only).abs().max() > 1e-2
    if "routed_scaling_factor" in CASES[case]:
        assert (out_overlay - (routed_only / SCALE + shared(x.float()))).abs().max() > 1e-2


def test_the_overlay_never_claims_to_overlap_the_shared_experts(monkeypatch):
    """If the overlay said its kernel ran the shared experts (MK_INTERNAL_OVERLAPPED), the runner
    would skip them and they would be lost: the guard above catches it."""
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "torch")
    gen = torch.Generator().manual_seed(4)
    *_, checkpoint = experts_and_checkpoint(gen)
    shared = SharedMLP(gen)
    overlay = build("maverick-weight-on-input", overlay=True, shared=shared, bias=None)
    load(overlay, checkpoint)
    assert overlay.routed_experts.quant_method.mk_can_overlap_shared_experts is False
    x, logits = torch.randn(T, H, generator=gen), torch.randn(T, E, generator=gen)
    good = forward(overlay, x, logits)
    monkeypatch.setattr(OverlayMoEMethod, "mk_can_overlap_shared_experts", property(lambda self: True))
    with pytest.raises(AssertionError):  # the runner finds no shared output: never silently dropped
        torch.testing.assert_close(forward(overlay, x, logits), good)
