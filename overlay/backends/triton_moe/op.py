"""`torch.ops.moe_overlay.triton_experts`: the Triton backend as one opaque custom op, with a
fake so torch.compile and vLLM's graph capture trace through it. Registering it needs no
triton; calling it does."""

from __future__ import annotations

import torch


@torch.library.custom_op("moe_overlay::triton_experts", mutates_args=())
def triton_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    activation_params: list[float],
    weight_on_input: bool,
    granularity: str,
    per_token: bool = False,
) -> torch.Tensor:
    from .launch import Layer, fused_experts

    layer = Layer.of(x, w13, w2, topk_ids.shape[1], activation, activation_params, weight_on_input, granularity or None,
                     per_token)
    return fused_experts(layer, x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map)


@triton_experts.register_fake
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)
