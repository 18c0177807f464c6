"""Upstream's own MoE layers on CPU without an engine (moe_overlay.models.standalone), loaded and run.

Weights go in through upstream's loader (`MoERunner.load_weights`) under checkpoint names
(`<expert>.gate_proj.weight`, `...weight_scale_inv`, `...weight_packed`), so the layer holds
exactly what a real checkpoint load would leave in it.
"""

from __future__ import annotations

import torch
from vllm.forward_context import set_forward_context

from moe_overlay.models.standalone import build_moe, current_config, vllm_context

__all__ = ["build_moe", "forward", "load", "vllm_context"]


def load(runner, checkpoint: dict[str, torch.Tensor]) -> set[str]:
    """Checkpoint tensors (names relative to the experts module) through upstream's loader,
    then the quant method's post-processing, as the model loader does."""
    loaded = set(runner.load_weights(checkpoint.items()))
    experts = runner.routed_experts
    experts.quant_method.process_weights_after_loading(experts)
    return loaded


def forward(runner, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    with set_forward_context(None, current_config()):
        return runner(x, router_logits)
