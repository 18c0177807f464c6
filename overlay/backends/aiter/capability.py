"""What AITER's fused MoE can run, as a table, and the plan for one layer (or why not).

Each row is one AITER path: the quantisation it takes, the `QuantType` it is called with,
the GPUs, activations and options it supports. `aiter_plan` walks a layer's spec through
the table and raises `BackendUnavailableError` with the first reason it cannot run, so
selection can say exactly why AITER was passed over. The facts come from AITER's sources
(PyPI `amd-aiter` and ROCm/aiter main, see docs/aiter.md), never from running it here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...errors import BackendUnavailableError
from ...layout import Layout
from ...quant import native_fp8_format
from ...spec import MoESpec

# gfx arch -> its GPUs (the fp8 flavour AITER computes in, its `dtypes.fp8`, is native_fp8_format's)
ARCHS = {"gfx942": "MI300X/MI325X", "gfx950": "MI350X/MI355X"}

# our activation -> (AITER ActivationType member, fused_moe keywords for its parameters)
ACTIVATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "silu": ("Silu", ()),
    "gelu": ("Gelu", ()),
    "situ": ("Situv2", ("beta", "linear_beta")),
}
ACTIVATION_KEYWORDS = dict(ACTIVATIONS.values())  # AITER ActivationType member -> its fused_moe keywords

# Set to 1, these make AITER quantise SiTU's activations (a8w4 / a4w4): not the layer we describe.
# vLLM sets AITER_SITUV2_A4W4=1 when it is imported, unless VLLM_ROCM_USE_AITER_MOE_SITUV2=a16w4.
SITU_ACTIVATION_SWITCHES = ("AITER_SITUV2_A8W4", "AITER_SITUV2_A4W4")


@dataclass(frozen=True)
class AiterFeatures:
    """What one AITER install offers: its version and the names it defines, spelt as
    `ActivationType.<member>`, `fused_moe(<keyword>=)` and `FlyDSL` (its DSL kernels)."""

    version: str
    names: frozenset[str]

    @classmethod
    def of(cls, version: str, activations: list[str], fused_moe_params: list[str], flydsl: bool) -> AiterFeatures:
        names = {f"ActivationType.{a}" for a in activations} | {f"fused_moe({p}=)" for p in fused_moe_params}
        return cls(version, frozenset(names | ({"FlyDSL"} if flydsl else set())))


@dataclass(frozen=True)
class AiterPath:
    """One row of the table: a way AITER's `fused_moe` runs a layer."""

    name: str
    quant: tuple[str, str | None, str]  # QuantSpec (weights, granularity, activations)
    quant_type: str  # AITER QuantType member it is called with
    archs: tuple[str, ...]
    activations: tuple[str, ...]
    weight_on_input: bool  # the router weight applied in stage 1 (doweight_stage1)
    expert_parallel: bool  # expert_mask
    multiple_of: tuple[int, int]  # hidden and intermediate sizes must be multiples of these...
    pads_intermediate: bool  # ...unless the intermediate size can be zero-padded up to it
    shuffle: tuple[int, int]  # weight tile shuffle
    mx_scale_shuffle: bool = False
    block: tuple[int, int] | None = None  # fp8 block size, where the path needs one
    needs: tuple[str, ...] = ()  # AiterFeatures names beyond its activation's


BOTH = ("gfx942", "gfx950")
# name, quantisation, QuantType, GPUs, activations, weight on input, expert parallel,
# (hidden, intermediate) multiples, pads intermediate, weight shuffle, [mx scale shuffle, block, needs]
PATHS = (
    AiterPath("bf16", ("none", None, "none"), "No", BOTH, ("silu", "gelu"), True, True, (32, 32), True, (16, 16)),
    AiterPath("fp8 per-tensor", ("fp8", "tensor", "fp8_tensor"), "per_Tensor", BOTH, ("silu", "gelu"),
              True, True, (32, 32), True, (16, 16)),
    AiterPath("fp8 per-token", ("fp8", "channel", "fp8_token"), "per_Token", BOTH, ("silu", "gelu"),
              True, True, (32, 32), False, (16, 16)),
    AiterPath("fp8 block 128x128", ("fp8", "block", "fp8_block"), "per_128x128", BOTH, ("silu", "gelu"),
              True, True, (128, 128), False, (16, 16), block=(128, 128)),
    # bf16 activations x mxfp4 weights: AITER's a16w4 kernels, which it runs for SiTU only.
    AiterPath("mxfp4 a16w4", ("mxfp4", None, "none"), "per_1x32", ("gfx950",), ("situ",), False, False,
              (128, 128), False, (16, 32), mx_scale_shuffle=True, needs=("FlyDSL",)),
)


@dataclass(frozen=True)
class AiterPlan:
    """How one layer runs on AITER."""

    path: AiterPath
    activation: str  # AITER ActivationType member
    activation_values: tuple[float, ...]  # the activation's parameters, in ACTIVATION_KEYWORDS' order
    doweight_stage1: bool
    layout: Layout

    @property
    def kernel(self) -> str:
        stage1_weight = ", doweight_stage1" if self.doweight_stage1 else ""
        return f"aiter.fused_moe({self.path.quant_type}, {self.activation}{stage1_weight}) [{self.path.name}]"


def _quant_key(spec: MoESpec) -> tuple[str, str | None, str]:
    q = spec.quant
    return (q.weights, q.granularity, q.activations)


def _find_path(spec: MoESpec, arch: str) -> AiterPath:
    paths = [p for p in PATHS if p.quant == _quant_key(spec)]
    if not paths:
        runs = "; ".join(f"{p.name} ({', '.join(v for v in p.quant if v and v != 'none') or 'unquantised'})"
                         for p in PATHS)
        raise BackendUnavailableError(f"AITER has no fused MoE for {spec.quant}; it runs: {runs}")
    for path in paths:
        if arch in path.archs:
            return path
    gpus = " or ".join(f"{a} ({ARCHS[a]})" for a in paths[0].archs)
    raise BackendUnavailableError(f"AITER's {paths[0].name} fused MoE needs {gpus}; this is {arch}")


def _padded_intermediate(spec: MoESpec, path: AiterPath) -> int | None:
    mult_h, mult_i = path.multiple_of
    h, i = spec.hidden_size, spec.intermediate_size
    if h % mult_h:
        raise BackendUnavailableError(
            f"AITER's {path.name} fused MoE needs a hidden size divisible by {mult_h}; got {h}")
    if i % mult_i == 0:
        return None
    if not path.pads_intermediate:
        raise BackendUnavailableError(
            f"AITER's {path.name} fused MoE needs an intermediate size divisible by {mult_i}; got {i}")
    return -(-i // mult_i) * mult_i


def _fp8_target(spec: MoESpec, arch: str) -> str | None:
    native = native_fp8_format(arch)
    if spec.quant.weights != "fp8" or spec.quant.fp8_format == native:
        return None
    if (spec.quant.fp8_format, native) != ("e4m3fn", "e4m3fnuz"):
        raise BackendUnavailableError(
            f"{spec.quant.fp8_format} weights cannot run on {arch}, which computes in {native}")
    return native


def _check_options(spec: MoESpec, path: AiterPath, features: AiterFeatures, env: Mapping[str, str]) -> None:
    if spec.activation.kind not in path.activations:
        raise BackendUnavailableError(
            f"AITER's {path.name} fused MoE runs {', '.join(path.activations)}; this layer uses {spec.activation}")
    if path.block is not None and spec.quant.block != path.block:
        raise BackendUnavailableError(f"AITER's {path.name} fused MoE needs {path.block[0]}x{path.block[1]} blocks; "
                                      f"this layer has {spec.quant.block[0]}x{spec.quant.block[1]}")
    if spec.apply_router_weight_on_input and not path.weight_on_input:
        raise BackendUnavailableError(f"AITER's {path.name} fused MoE cannot apply the router weight to the input")
    if spec.expert_map is not None:
        if not path.expert_parallel:
            raise BackendUnavailableError(f"AITER's {path.name} fused MoE has no expert parallelism (expert_mask)")
        local = [g for g, slot in sorted(enumerate(spec.expert_map), key=lambda p: p[1]) if slot >= 0]
        if local != sorted(local):
            raise BackendUnavailableError(
                "AITER numbers a rank's experts in global order (expert_mask); this expert_map orders them otherwise")
    if spec.activation.kind == "situ" and not spec.activation.clips_up:
        # vLLM takes AITER's SiTU only with linear_beta set too (mxfp4.py's gfx950 check)
        raise BackendUnavailableError(
            "AITER's Situv2 clips up with linear_beta; this layer leaves up unclipped (linear_beta unset)")
    aiter_act, params = ACTIVATIONS[spec.activation.kind]
    needed = (f"ActivationType.{aiter_act}", *(f"fused_moe({p}=)" for p in params), *path.needs)
    missing = [n for n in needed if n not in features.names]
    if missing:
        raise BackendUnavailableError(
            f"the installed AITER {features.version} lacks {', '.join(missing)}, which its {path.name} "
            f"{spec.activation.kind} needs; a newer AITER has it (docs/aiter.md)")
    switched = [s for s in SITU_ACTIVATION_SWITCHES if spec.activation.kind == "situ" and env.get(s, "0") == "1"]
    if switched:
        raise BackendUnavailableError(
            f"{switched[0]}=1 makes AITER quantise SiTU activations, which this weight-only layer does not "
            "describe; unset it (vLLM sets it unless VLLM_ROCM_USE_AITER_MOE_SITUV2=a16w4)")


def aiter_plan(spec: MoESpec, arch: str | None, features: AiterFeatures, env: Mapping[str, str]) -> AiterPlan:
    """The AITER path, activation and weight layout for `spec` on `arch`, or
    BackendUnavailableError naming the first thing AITER cannot do."""
    if arch not in ARCHS:
        gpus = ", ".join(f"{a} ({g})" for a, g in ARCHS.items())
        raise BackendUnavailableError(f"AITER's fused MoE runs on {gpus}; this is {arch}")
    if spec.dtype not in (torch.bfloat16, torch.float16):
        raise BackendUnavailableError(f"AITER's fused MoE computes in bfloat16 or float16; this layer is {spec.dtype}")
    if spec.has_bias:
        raise BackendUnavailableError("AITER's fused MoE paths used here take no expert biases")
    path = _find_path(spec, arch)
    _check_options(spec, path, features, env)
    layout = Layout(
        "aiter",
        fp8_format=_fp8_target(spec, arch),
        padded_intermediate=_padded_intermediate(spec, path),
        shuffle=path.shuffle,
        mx_scale_shuffle=path.mx_scale_shuffle,
    )
    aiter_act, keywords = ACTIVATIONS[spec.activation.kind]
    values = tuple(spec.activation.param(k) for k in keywords)  # our parameter names are AITER's keywords
    return AiterPlan(path, aiter_act, values, spec.apply_router_weight_on_input, layout)
