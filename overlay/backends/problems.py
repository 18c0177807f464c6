"""The problems the backends are checked, tuned and measured on: the four models' MoE layers
as one GPU holds them under 8-way tensor parallelism, seeded random routings and weights,
and the hardware floor of each point."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..checks import canonical_shapes
from ..quant import E8M0_BIAS, quantize_fp8, quantize_mxfp4
from ..spec import Activation, MoESpec, QuantSpec

TOKEN_COUNTS = (1, 16, 128, 1024, 8192)
ROUTINGS = 4  # routings per timed call, run back to back, so that weights come from HBM, not the L2
# fp8-*: w8a8 with 1x128 activation groups; fp8-channel-token: per-channel weights with dynamic
# per-token activations (the FP8 Maverick checkpoint's format); mxfp4: w4a16
WEIGHT_FORMATS = ("bf16", "fp16", "fp8-tensor", "fp8-channel", "fp8-block", "fp8-channel-token", "mxfp4")


@dataclass(frozen=True)
class Model:
    name: str
    spec: MoESpec


# Per-GPU shapes under TP8: I is the model's intermediate size / 8 (Kimi-K3's experts work
# in its 3584 latent). Maverick applies the router weight to the input, as Llama-4 does.
MODELS = (
    Model("Mixtral", MoESpec(8, 4096, 1792, 2)),
    Model("DeepSeek-V3", MoESpec(256, 7168, 256, 8)),
    Model("Maverick", MoESpec(128, 5120, 1024, 1, apply_router_weight_on_input=True)),
    Model("Kimi-K3", MoESpec(896, 3584, 384, 16, Activation.situ())),
)
FP8_MODELS = ("DeepSeek-V3", "Kimi-K3")
# The models whose checkpoints ship each format (their per-GPU layers); bf16 and the rest: all four.
FORMAT_MODELS = {"fp8-block": FP8_MODELS, "mxfp4": ("Kimi-K3",), "fp8-channel-token": ("Maverick",)}


def model(name: str) -> Model:
    return next(m for m in MODELS if m.name == name)


def format_models(weights: str) -> tuple[str, ...]:
    """The models whose checkpoints ship `weights` (all four for bf16 and formats none ships)."""
    return FORMAT_MODELS.get(weights, tuple(m.name for m in MODELS))


def with_weights(spec: MoESpec, weights: str) -> MoESpec:
    """`spec` with weights in one of WEIGHT_FORMATS."""
    if weights == "fp16":
        return replace(spec, dtype=torch.float16)
    if weights == "mxfp4":
        return replace(spec, quant=QuantSpec("mxfp4"))
    if weights == "fp8-channel-token":
        return replace(spec, quant=QuantSpec("fp8", "channel", (128, 128), "e4m3fn", "fp8_token"))
    if weights.startswith("fp8-"):
        return replace(spec, quant=QuantSpec("fp8", weights.removeprefix("fp8-"), (128, 128), "e4m3fn", "fp8_block"))
    return spec


def random_routing(
    num_tokens: int, spec: MoESpec, device: torch.device | str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token picks top_k distinct experts uniformly at random (a balanced router's
    statistics), with positive weights summing to one: (fp32 [M, k], int32 [M, k])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(num_tokens, spec.num_experts, generator=gen, device=device)
    ids = scores.topk(spec.top_k, dim=1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, spec.top_k, generator=gen, device=device) + 0.5
    return weights / weights.sum(dim=1, keepdim=True), ids


def random_weights(
    spec: MoESpec, device: torch.device | str, seed: int, gain: float = 2.0
) -> dict[str, torch.Tensor]:
    """Canonical expert tensors in `spec`'s quantisation, entries ~ N(0, gain^2 / K) (activations
    stay O(1) through both GEMMs), made one expert at a time so that a large layer needs no
    fp32 copy of itself."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i = spec.hidden_size, spec.intermediate_size
    parts: dict[str, list[torch.Tensor]] = {}
    for _ in range(spec.num_local_experts):
        for name, (n, k) in {"w13": (2 * i, h), "w2": (h, i)}.items():
            w = torch.randn(1, n, k, generator=gen, device=device).mul_(gain * k**-0.5)
            if spec.quant.weights == "fp8":
                w, scale = quantize_fp8(w, spec.quant)
                parts.setdefault(f"{name}_scale", []).append(scale)
            elif spec.quant.weights == "mxfp4":
                w, scale = quantize_mxfp4(w)
                parts.setdefault(f"{name}_scale", []).append(scale)
            else:
                w = w.to(spec.dtype)
            parts.setdefault(name, []).append(w)
    return {name: torch.cat(ts) for name, ts in parts.items()}


def empty_weights(spec: MoESpec, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Canonical tensors of the right shapes and dtypes, unfilled but for the scales, which
    layout steps read (zeros; e8m0 2^0, which every mxfp4 layout holds): for work that reads
    none."""
    out = {}
    for name, (shape, dtypes) in canonical_shapes(spec).items():
        dtype = spec.dtype if spec.dtype in dtypes else dtypes[0]
        if not name.endswith("_scale"):
            out[name] = torch.empty(shape, dtype=dtype, device=device)
        else:
            out[name] = torch.full(shape, E8M0_BIAS if dtype == torch.uint8 else 0, dtype=dtype, device=device)
    return out


def random_input(num_tokens: int, spec: MoESpec, device: torch.device | str, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(num_tokens, spec.hidden_size, generator=gen, device=device, dtype=spec.dtype)


def random_calls(
    num_tokens: int, spec: MoESpec, device: torch.device | str, count: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`count` different (input, routing weights, expert ids) of one point, seeded."""
    return [(random_input(num_tokens, spec, device, seed + g),
             *random_routing(num_tokens, spec, device, seed + count + g)) for g in range(count)]


@dataclass(frozen=True)
class Floor:
    """The least time a point can take: all routed experts' weights (and scales) read once
    from HBM, or all its FLOPs at the matrix rate of the format's GEMMs, whichever is longer."""

    weight_bytes: int
    flops: int
    bandwidth: float  # bytes/s
    matrix_rate: float  # FLOP/s

    @property
    def seconds(self) -> float:
        return max(self.weight_bytes / self.bandwidth, self.flops / self.matrix_rate)

    @property
    def bound(self) -> str:
        return "memory" if self.weight_bytes / self.bandwidth >= self.flops / self.matrix_rate else "compute"


def bytes_per_expert(spec: MoESpec) -> int:
    """HBM bytes of one expert as stored: its weights (packed for mxfp4) and their scales."""
    total = sum(math.prod(shape) * (spec.dtype if spec.dtype in dtypes else dtypes[0]).itemsize
                for shape, dtypes in canonical_shapes(spec).values())
    return total // spec.num_local_experts


def floor_for(spec: MoESpec, topk_ids: torch.Tensor, bandwidth: float, matrix_rate: float) -> Floor:
    """Floor of one routing: weight bytes of the distinct experts hit, FLOPs of every route."""
    distinct = int(torch.unique(topk_ids).numel())
    flops = 2 * topk_ids.numel() * 3 * spec.hidden_size * spec.intermediate_size
    return Floor(distinct * bytes_per_expert(spec), flops, bandwidth, matrix_rate)
