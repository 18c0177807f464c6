"""The Triton backend: a fused-MoE kernel for any GPU that Triton compiles for (NVIDIA, and
ROCm's Triton on gfx942/gfx950), e.g. Kimi-K3's mxfp4 SiTU experts on gfx942, where AITER has
no kernel (on gfx950 AITER has one and comes first in auto order)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch

from ...backend import Backend, Platform, register_backend
from ...errors import MoEInputError
from ...layout import CANONICAL, MX_UNIT_K, MX_WORD_K, MX_WORD_ROWS, Layout, refuse_e8m0_outside
from ...quant import E8M0_BIAS, FNUZ_ARCHS, native_fp8_format
from ...spec import MoESpec
from . import op  # noqa: F401  (registers torch.ops.moe_overlay.triton_experts)
from .configs import LayerShape, current_table, device_name, is_tuned, table_devices
from .target import Target, platform_target

ACTIVATIONS = ("silu", "situ")
FP16_MAX = torch.finfo(torch.float16).max
FP8_AMD_ARCHS = (*FNUZ_ARCHS, "gfx950")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _nvidia_capability(platform: Platform) -> int:
    return int(platform.arch.removeprefix("sm_")) if platform.arch else 0


class TritonBackend(Backend):
    name = "triton"
    priority = 80

    def unsupported_reason(self, spec: MoESpec, platform: Platform) -> str | None:
        if not triton_installed():
            return "triton is not installed"
        if platform.device_type != "cuda":
            return f"needs a CUDA or ROCm GPU; this layer is on {platform}"
        if platform.vendor == "nvidia" and _nvidia_capability(platform) < 80:
            return f"needs sm_80 or newer for bf16 tensor cores; this GPU is {platform.arch}"
        if spec.activation.kind not in ACTIVATIONS:
            return f"activation {spec.activation.kind} is not implemented (only {', '.join(ACTIVATIONS)})"
        if spec.activation.kind == "situ" and not spec.activation.clips_up:
            return "situ with up unclipped (linear_beta unset) is not implemented"
        if spec.has_bias:
            return "expert biases are not implemented"
        if spec.dtype == torch.float32:
            return "float32 layers are not supported (bf16 or fp16 activations only)"
        if spec.quant.weights == "mxfp4" and platform.vendor == "amd" and platform.arch not in FP8_AMD_ARCHS:
            return f"mxfp4 (tl.dot_scaled) needs gfx942 or gfx950 on ROCm; this GPU is {platform.arch}"
        if spec.quant.weights == "fp8":
            return self._fp8_reason(spec, platform)
        return None

    @staticmethod
    def _fp8_reason(spec: MoESpec, platform: Platform) -> str | None:
        q = spec.quant
        if q.activations not in ("fp8_block", "fp8_token"):
            return (f"fp8 weights run as w8a8 with dynamic 1x128 activation groups (activations='fp8_block') "
                    f"or per-token scales ('fp8_token'), not {q.activations!r}")
        if q.activations == "fp8_token" and q.granularity == "block":
            return "per-token fp8 activations run with per-tensor or per-channel weight scales, not 128x128 blocks"
        if q.granularity == "block" and q.block != (128, 128):
            return f"fp8 block scales must be 128x128, not {q.block[0]}x{q.block[1]}"
        if platform.vendor == "nvidia":
            if q.fp8_format != "e4m3fn":
                return f"{q.fp8_format} weights need ROCm (gfx942); NVIDIA GPUs use e4m3fn"
            if _nvidia_capability(platform) < 89:
                return f"fp8 needs sm_89 or newer; this GPU is {platform.arch}"
        elif platform.arch not in FP8_AMD_ARCHS:
            return f"fp8 needs gfx942 or gfx950; this GPU is {platform.arch}"
        elif q.fp8_format == "e4m3fnuz" and native_fp8_format(platform.arch) != "e4m3fnuz":
            return f"e4m3fnuz weights need gfx942; {platform.arch} uses e4m3fn"
        return None

    def layout_for(self, spec: MoESpec, platform: Platform) -> Layout:
        # [E, N, K] with K contiguous, as canonical: what wgmma (fp8 needs exactly that) and
        # MFMA read best. bf16/fp16 gate and up rows are interleaved, so one dot computes both;
        # fp8 stays canonical, only its flavour changes: MI300's hardware fp8 is e4m3fnuz.
        # mxfp4 with bf16 activations: recoded words (layout.mx_words), decoded by shifts and
        # masks, 512 contiguous bytes a K step of 16 rows, where the target says so
        # (target.Target.mx_words: measured, docs/performance.md); the gate/up's as int16 units
        # for fp16 dots where the target says so (target.Target.mx_units, H whole 64-K chunks),
        # the down's too where its fp16 input holds the activation (_down_units_fit); else
        # canonical bytes for tl.dot_scaled (gfx950's fp4 conversion).
        if LayerShape.of(spec).interleaved:
            return Layout("triton", gate_up="interleaved")
        if spec.quant.weights == "mxfp4" and _mx_words_fit(spec, _target(platform)):
            return Layout("triton", mx_words=True)
        if spec.quant.weights == "mxfp4" and _target(platform).mx_units and spec.hidden_size % MX_UNIT_K == 0:
            return Layout("triton", mx_units=("w13", "w2") if _down_units_fit(spec) else ("w13",))
        native = native_fp8_format(platform.arch or "")
        if spec.quant.weights == "fp8" and spec.quant.fp8_format == "e4m3fn" and native == "e4m3fnuz":
            return Layout("triton", fp8_format="e4m3fnuz")
        return CANONICAL

    def check_weights(self, spec: MoESpec, tensors: Mapping[str, torch.Tensor], layout: Layout) -> None:
        # canonical mxfp4: the one-token gemv and the decode a program (mx_dequant) scale in fp32
        # by 2^(s - 127 + E2M1_SMALL_EXP); mx_words checks its own, smaller bound (layout.py)
        if spec.quant.weights != "mxfp4" or layout.mx_words:
            return
        from .kernels import E2M1_SMALL_EXP

        for name in ("w13_scale", "w2_scale"):
            refuse_e8m0_outside(tensors[name], name, 0, 2 * E8M0_BIAS - E2M1_SMALL_EXP.value,  # 240: 2^113
                                "the Triton backend's mxfp4 kernels take")

    def kernel_name(self, spec: MoESpec) -> str:
        return f"moe_overlay::triton_experts ({LayerShape.of(spec).weights}, {spec.activation})"

    def run(
        self,
        spec: MoESpec,
        tensors: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
    ) -> torch.Tensor:
        w13 = tensors["w13"]
        if spec.quant.weights == "none" and w13.dtype != x.dtype:
            raise MoEInputError(
                f"the Triton backend needs {x.dtype} weights for {x.dtype} activations, got {w13.dtype}")
        return torch.ops.moe_overlay.triton_experts(
            x, w13, tensors["w2"], topk_weights, topk_ids, tensors.get("w13_scale"), tensors.get("w2_scale"),
            expert_map, spec.activation.kind, list(spec.activation.params), spec.apply_router_weight_on_input,
            spec.quant.granularity or "", spec.quant.activations == "fp8_token",
        )

    def is_tuned(self, spec: MoESpec, platform: Platform) -> bool | None:
        if platform.device_type != "cuda":
            return None
        device = torch.device("cuda", torch.cuda.current_device())
        target = _target(platform)
        return is_tuned(current_table(), table_devices(device, target), LayerShape.of(spec).entries_of(target))


def _target(platform: Platform) -> Target:
    """The Triton target of a GPU (target.py), in target mode the one it stands in for."""
    gpu = platform.vendor == "nvidia" and torch.cuda.is_available()
    return platform_target(platform.vendor, platform.arch or "",
                           device_name(torch.device("cuda", torch.cuda.current_device())) if gpu else "")


def _down_units_fit(spec: MoESpec) -> bool:
    """Whether the down's mxfp4 weights run as mx_units: their fp16 dots take the activation in
    fp16, which holds SiTU's (at most beta * linear_beta in magnitude) where that product is
    below fp16's 65504 (SiLU's has no bound), and I is whole 64-K chunks."""
    beta, linear_beta = spec.activation.params if spec.activation.kind == "situ" else (0.0, 0.0)
    return spec.activation.kind == "situ" and beta * linear_beta < FP16_MAX and spec.intermediate_size % MX_UNIT_K == 0


def _mx_words_fit(spec: MoESpec, target: Target) -> bool:
    """Whether an mxfp4 layer runs from recoded words: the target's mxfp4 layout, bf16
    activations, and rows and K of both weights whole word groups."""
    h, i = spec.hidden_size, spec.intermediate_size
    return (target.mx_words and spec.dtype == torch.bfloat16
            and all(n % MX_WORD_ROWS == 0 and k % MX_WORD_K == 0 for n, k in ((2 * i, h), (h, i))))


register_backend(TritonBackend())
