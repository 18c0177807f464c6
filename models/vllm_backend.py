"""The `vllm` backend: upstream vLLM's own kernel, for A/B against the adapter and as fallback.

It takes part in selection and description like any backend. When it is chosen the glue
leaves upstream's quant method on the layer untouched, so the layer runs exactly as stock
vLLM (same weights post-processing, same kernel, no wrapper on the hot path).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

import moe_overlay as mo


def upstream_kernel_name(method: object) -> str:
    """Which upstream kernel a quant method runs (known once its weights are processed)."""
    kernel = getattr(method, "moe_kernel", None)
    backend = getattr(method, "unquantized_backend", None)
    prefix = f"{type(method).__name__}"
    if backend is not None:
        prefix += f"[{getattr(backend, 'value', backend)}]"
    if kernel is None:
        return prefix
    return f"{prefix}/{type(kernel.fused_experts).__name__}"


class VllmBackend(mo.Backend):
    name = "vllm"
    priority = 50  # above the torch reference, below the adapter's own GPU kernels

    def unsupported_reason(self, spec: mo.MoESpec, platform: mo.Platform) -> str | None:
        if platform.device_type == "cpu" and spec.quant.weights != "none" and not torch.cpu._is_amx_tile_supported():
            # Every quantised CPU experts class of vLLM (fused_moe/experts/cpu_moe.py) needs AMX tiles;
            # without them its oracles find no backend and loading fails ("Unsupported FP8 MoE backend").
            return f"vLLM's CPU lane has no {spec.quant.weights} MoE kernel on a CPU without AMX tiles"
        return None  # otherwise whatever vLLM loaded, vLLM can run

    def layout_for(self, spec: mo.MoESpec, platform: mo.Platform) -> mo.Layout:
        return mo.Layout("vllm")

    def kernel_name(self, spec: mo.MoESpec) -> str:
        return "vLLM's own fused-MoE kernel"

    def run(self, spec: mo.MoESpec, tensors: Mapping[str, torch.Tensor], x: torch.Tensor,
            topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
        raise mo.BackendUnavailableError(
            "the vllm backend runs inside vLLM's own MoE layer (the overlay leaves upstream's quant "
            "method in place), not through PreparedExperts"
        )


mo.register_backend(VllmBackend())
