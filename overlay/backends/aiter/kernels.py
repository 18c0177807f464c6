"""AITER's kernels as torch custom ops with fakes, so vLLM's torch.compile and graph capture
treat each as one opaque op (as the seed's PR registered them).

Registering imports nothing from AITER: each op finds its `AiterOps` by key on first call.
The fused-experts op covers all of today's `aiter.fused_moe` paths (CK 2-stage or asm
1-stage, picked by AITER): bf16, fp8 per-tensor, per-token (with the top-1 weight in stage 1,
the old `asm_moe_tkw1`), 128x128 blocks (the old `fmoe_fp8_blockscale_g1u1`) and mxfp4.
"""

from __future__ import annotations

import torch

from ...errors import MoEInputError
from ...routing import _check_logits
from .capability import ACTIVATION_KEYWORDS
from .ops import RocmAiter, bound_ops


def _handed_over(w: torch.Tensor, fp4: torch.dtype | None) -> torch.Tensor:
    """A fresh alias of a shuffled weight, flagged for AITER. AITER picks its kernel by the
    Python attribute `is_shuffled`, which `.clone()`, `.to()` and `nn.Parameter(x)` drop: a
    shuffled weight without it runs the wrong kernel. So it is set here, inside the op, on
    exactly the tensor handed to AITER, whichever path (eager, compiled, captured) got here."""
    alias = w.view(fp4 if fp4 is not None else w.dtype)
    alias.is_shuffled = True
    return alias


def _aiter_scale(s: torch.Tensor | None, quant_type: str, e8m0: torch.dtype | None) -> torch.Tensor | None:
    """Prepared scales (canonical shapes, mxfp4 ones shuffled) -> the shapes AITER reads."""
    if s is None:
        return None
    if quant_type == "per_Tensor":
        return s.view(-1, 1)  # [E] -> [E, 1]
    if quant_type == "per_Token":
        return s.unsqueeze(-1)  # [E, N] -> [E, N, 1]
    if quant_type == "per_1x32":
        return s.flatten(0, 1).view(e8m0)  # [E, N, G] -> [E*N, G]
    return s  # per_128x128: [E, N/128, K/128] as is


@torch.library.custom_op("moe_overlay::aiter_fused_moe", mutates_args=())
def aiter_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    expert_mask: torch.Tensor | None,
    quant_type: str,
    activation: str,
    doweight_stage1: bool,
    activation_params: list[float],
    ops_key: str,
) -> torch.Tensor:
    ops = bound_ops(ops_key)
    fp4, e8m0 = (ops.dtype("fp4x2"), ops.dtype("fp8_e8m0")) if quant_type == "per_1x32" else (None, None)
    kwargs = {
        "hidden_states": x,
        "w1": _handed_over(w13, fp4),
        "w2": _handed_over(w2, fp4),
        "topk_weight": topk_weights,
        "topk_ids": topk_ids,
        "expert_mask": expert_mask,
        "activation": ops.enum("ActivationType", activation),
        "quant_type": ops.enum("QuantType", quant_type),
        "doweight_stage1": doweight_stage1,
        "w1_scale": _aiter_scale(w13_scale, quant_type, e8m0),
        "w2_scale": _aiter_scale(w2_scale, quant_type, e8m0),
    }
    kwargs.update(zip(ACTIVATION_KEYWORDS[activation], activation_params, strict=True))
    return ops.call("fused_moe", **kwargs)


@aiter_fused_moe.register_fake
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(x)


def _routing_outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = logits.shape[0]
    return (torch.empty(m, top_k, dtype=torch.float32, device=logits.device),
            torch.empty(m, top_k, dtype=torch.int32, device=logits.device))


@torch.library.custom_op("moe_overlay::aiter_topk_softmax", mutates_args=())
def aiter_topk_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool, ops_key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = _routing_outputs(logits, top_k)
    bound_ops(ops_key).call(
        "topk_softmax", topk_weights=weights, topk_indices=ids, token_expert_indices=torch.empty_like(ids),
        gating_output=logits, need_renorm=renormalize,
    )
    return weights, ids


@aiter_topk_softmax.register_fake
def _(logits: torch.Tensor, top_k: int, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    return _routing_outputs(logits, top_k)


@torch.library.custom_op("moe_overlay::aiter_biased_grouped_topk", mutates_args=())
def aiter_biased_grouped_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float,
    ops_key: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = _routing_outputs(logits, top_k)
    bound_ops(ops_key).call(
        "biased_grouped_topk", gating_output=logits, correction_bias=correction_bias.to(logits.dtype),
        topk_weights=weights, topk_ids=ids, num_expert_group=num_groups, topk_group=topk_groups,
        need_renorm=renormalize, routed_scaling_factor=routed_scaling_factor,
    )
    return weights, ids


@aiter_biased_grouped_topk.register_fake
def _(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, *args: object):
    return _routing_outputs(logits, top_k)


# -- routing with AITER's kernels, same meaning as moe_overlay.routing's ----------------------


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool = True, ops_key: str = RocmAiter.key
) -> tuple[torch.Tensor, torch.Tensor]:
    """As routing.softmax_topk (Mixtral), on AITER's topk_softmax kernel."""
    _check_logits(logits, top_k)
    return torch.ops.moe_overlay.aiter_topk_softmax(logits, top_k, renormalize, ops_key)


def biased_grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    correction_bias: torch.Tensor,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    ops_key: str = RocmAiter.key,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As routing.grouped_topk with sigmoid scoring and a correction bias (DeepSeek-V3,
    Kimi), on AITER's biased_grouped_topk kernel."""
    _check_logits(logits, top_k)
    if correction_bias.shape != (logits.shape[1],):
        raise MoEInputError(
            f"correction bias must have shape ({logits.shape[1]},), got {tuple(correction_bias.shape)}")
    return torch.ops.moe_overlay.aiter_biased_grouped_topk(
        logits, correction_bias, top_k, num_groups, topk_groups, renormalize, routed_scaling_factor, ops_key)
