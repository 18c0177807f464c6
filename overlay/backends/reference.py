"""The torch reference backend: dequantise, then compute each expert plainly in fp32.

It runs on any device and is the oracle every other backend is checked against, so it
favours obviously-right over fast. Registered as the custom op
`torch.ops.moe_overlay.reference_experts` (with a fake) so torch.compile keeps it opaque.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..activations import apply_gated
from ..backend import Backend, Platform, register_backend
from ..checks import check_expert_ids
from ..layout import CANONICAL, Layout
from ..quant import dequantize_fp8, dequantize_mxfp4, fake_quantize_activations
from ..spec import Activation, MoESpec, QuantSpec


def _dequantize(w: torch.Tensor, scale: torch.Tensor | None, quant: QuantSpec) -> torch.Tensor:
    if quant.weights == "fp8":
        assert scale is not None
        return dequantize_fp8(w, scale, quant)
    if quant.weights == "mxfp4":
        assert scale is not None
        return dequantize_mxfp4(w, scale)
    return w.float()


def reference_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quant: QuantSpec,
    activation: Activation,
    weight_on_input: bool,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_j w[t,j] * expert_{id[t,j]}(x[t]) (or expert(w*x) with weight on input).

    w8a8 activations are quantised as a fused-MoE kernel does, a whole batch at once: the input
    (weighted first where the weight goes on the input) before the gate/up GEMMs, then every
    routed copy's activation before the down GEMMs. So a per-tensor scale is one
    over the batch, as upstream's; per-token and 1x128 scales are a row's own either way."""
    num_global = expert_map.numel() if expert_map is not None else w13.shape[0]
    check_expert_ids(topk_ids, num_global)
    local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    block_k = quant.block[1]
    routes = topk_weights.float().unsqueeze(-1)  # [M, k, 1]
    # the batch [M, 1, H], or with the weight on the input each routed copy's input [M, k, H]
    h = x.float().unsqueeze(1) * routes if weight_on_input else x.float().unsqueeze(1)
    h = fake_quantize_activations(h.flatten(0, 1), quant.activations, quant.fp8_dtype, block_k).view(h.shape)
    h = h.expand(*local.shape, -1)
    acts = torch.zeros(*local.shape, w13.shape[-2] // 2, dtype=torch.float32, device=x.device)  # [M, k, I]
    for e in range(w13.shape[0]):
        mask = local == e
        if mask.any():
            w1 = _dequantize(w13[e : e + 1], None if scales[0] is None else scales[0][e : e + 1], quant)[0]
            gate_up = h[mask] @ w1.T
            if biases[0] is not None:
                gate_up = gate_up + biases[0][e].float()
            acts[mask] = apply_gated(activation, gate_up)
    acts = fake_quantize_activations(acts.flatten(0, 1), quant.activations, quant.fp8_dtype, block_k).view(acts.shape)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w2.shape[0]):
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w2e = _dequantize(w2[e : e + 1], None if scales[1] is None else scales[1][e : e + 1], quant)[0]
        y = acts[tok, slot] @ w2e.T
        if biases[1] is not None:
            y = y + biases[1][e].float()
        out.index_add_(0, tok, y if weight_on_input else y * routes[tok, slot])
    return out.to(x.dtype)


@torch.library.custom_op("moe_overlay::reference_experts", mutates_args=())
def reference_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    activation_params: list[float],
    weight_on_input: bool,
    weight_quant: str,
    granularity: str,
    block: list[int],
    fp8_format: str,
    activation_quant: str,
) -> torch.Tensor:
    quant = QuantSpec(
        weight_quant, granularity or None, (block[0], block[1]), fp8_format, activation_quant
    )
    return reference_moe(
        x, w13, w2, topk_weights, topk_ids, quant, Activation(activation, tuple(activation_params)),
        weight_on_input, (w13_scale, w2_scale), (w13_bias, w2_bias), expert_map,
    )


@reference_experts.register_fake
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


class ReferenceBackend(Backend):
    name = "torch"
    priority = 0

    def unsupported_reason(self, spec: MoESpec, platform: Platform) -> str | None:
        return None

    def layout_for(self, spec: MoESpec, platform: Platform) -> Layout:
        return CANONICAL

    def kernel_name(self, spec: MoESpec) -> str:
        return "moe_overlay::reference_experts"

    def run(
        self,
        spec: MoESpec,
        tensors: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
    ) -> torch.Tensor:
        q = spec.quant
        return torch.ops.moe_overlay.reference_experts(
            x, tensors["w13"], tensors["w2"], topk_weights, topk_ids,
            tensors.get("w13_scale"), tensors.get("w2_scale"),
            tensors.get("w13_bias"), tensors.get("w2_bias"), expert_map,
            spec.activation.kind, list(spec.activation.params), spec.apply_router_weight_on_input,
            q.weights, q.granularity or "", list(q.block), q.fp8_format, q.activations,
        )


register_backend(ReferenceBackend())
