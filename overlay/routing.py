"""Routers: router logits -> (fp32 weights [M, k], int32 expert ids [M, k]).

Ties go to the lower expert id (a stable sort), so results are reproducible on
every device and comparable with any other implementation that says the same.
"""

from __future__ import annotations

import torch

from .errors import MoEInputError


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise MoEInputError(f"router logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise MoEInputError(f"router logits must be floating point, got {logits.dtype}")
    if not 0 < top_k <= logits.shape[1]:
        raise MoEInputError(f"top_k={top_k} must be in 1..{logits.shape[1]} (the number of experts)")


def stable_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, largest first, ties broken by the lower index."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return values.gather(-1, order), order


def _finish(weights: torch.Tensor, ids: torch.Tensor, renormalize: bool, scale: float = 1.0):
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if scale != 1.0:
        weights = weights * scale
    return weights.to(torch.float32), ids.to(torch.int32)


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral: softmax over all experts, keep the top-k, optionally renormalise."""
    _check_logits(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = stable_topk(probs, top_k)
    return _finish(weights, ids, renormalize)


def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    num_groups: int = 1,
    topk_groups: int = 1,
    scoring: str = "sigmoid",
    correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi: scores (+ bias for selection only), keep the best groups, top-k.

    A group's score is the sum of its two best biased scores (its best alone when a
    group holds one expert). Weights are the unbiased scores of the chosen experts.
    """
    _check_logits(logits, top_k)
    num_tokens, num_experts = logits.shape
    if num_groups <= 0 or num_experts % num_groups:
        raise MoEInputError(f"num_groups={num_groups} must divide the {num_experts} experts")
    if not 0 < topk_groups <= num_groups:
        raise MoEInputError(f"topk_groups={topk_groups} must be in 1..{num_groups}")
    per_group = num_experts // num_groups
    if top_k > topk_groups * per_group:
        raise MoEInputError(
            f"top_k={top_k} exceeds the {topk_groups * per_group} experts in the kept groups"
        )
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    elif scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    else:
        raise MoEInputError(f"scoring {scoring!r} is not 'sigmoid' or 'softmax'")
    choice = scores
    if correction_bias is not None:
        if correction_bias.shape != (num_experts,):
            raise MoEInputError(
                f"correction bias must have shape ({num_experts},), got {tuple(correction_bias.shape)}"
            )
        choice = scores + correction_bias.to(device=scores.device, dtype=torch.float32)
    if num_groups > 1:
        grouped = choice.view(num_tokens, num_groups, per_group)
        group_scores = stable_topk(grouped, min(2, per_group))[0].sum(dim=-1)
        kept = stable_topk(group_scores, topk_groups)[1]
        keep_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        keep_mask = keep_mask.repeat_interleave(per_group, dim=1)
        choice = choice.masked_fill(~keep_mask, float("-inf"))
    ids = stable_topk(choice, top_k)[1]
    return _finish(scores.gather(1, ids), ids, renormalize, routed_scaling_factor)


def sigmoid_top1(logits: torch.Tensor, top_k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-4: top-k on the raw logits, each weight = sigmoid(its logit), no renormalisation.

    Llama-4 applies the weight to the expert's input (MoESpec.apply_router_weight_on_input).
    """
    _check_logits(logits, top_k)
    values, ids = stable_topk(logits.float(), top_k)
    return _finish(torch.sigmoid(values), ids, renormalize=False)
