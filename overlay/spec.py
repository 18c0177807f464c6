"""What a MoE layer is: the description every backend and layout is checked against."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import SpecError

ACTIVATION_PARAMS: dict[str, tuple[str, ...]] = {
    "silu": (),
    "gelu": (),
    "situ": ("beta", "linear_beta"),
    "swiglu_clamped": ("alpha", "limit"),
}


@dataclass(frozen=True)
class Activation:
    """A gated activation: `act(gate) * up` with the gate rows first in w13."""

    kind: str = "silu"
    params: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        names = ACTIVATION_PARAMS.get(self.kind)
        if names is None:
            raise SpecError(
                f"activation {self.kind!r} is not known; expected one of {sorted(ACTIVATION_PARAMS)}"
            )
        if len(self.params) != len(names):
            raise SpecError(
                f"activation {self.kind!r} takes parameters {names}, got {self.params!r}"
            )

    @classmethod
    def silu(cls) -> Activation:
        return cls("silu")

    @classmethod
    def gelu(cls) -> Activation:
        return cls("gelu")

    @classmethod
    def situ(cls, beta: float = 4.0, linear_beta: float | None = 25.0) -> Activation:
        """Kimi's SiTU; `linear_beta` None (upstream's "unset") leaves `up` unclipped, stored as
        infinity: the limit of linear_beta * tanh(up / linear_beta)."""
        return cls("situ", (float(beta), math.inf if linear_beta is None else float(linear_beta)))

    @property
    def clips_up(self) -> bool:
        """SiTU with a finite linear_beta (up softly clipped); False for every other activation."""
        return self.kind == "situ" and math.isfinite(self.param("linear_beta"))

    @classmethod
    def swiglu_clamped(cls, alpha: float = 1.702, limit: float = 7.0) -> Activation:
        return cls("swiglu_clamped", (float(alpha), float(limit)))

    def param(self, name: str) -> float:
        return self.params[ACTIVATION_PARAMS[self.kind].index(name)]

    def __str__(self) -> str:
        if not self.params:
            return self.kind
        pairs = ", ".join(f"{n}={v:g}" for n, v in zip(ACTIVATION_PARAMS[self.kind], self.params, strict=True))
        return f"{self.kind}({pairs})"


WEIGHT_QUANTS = ("none", "fp8", "mxfp4")
FP8_GRANULARITIES = ("tensor", "channel", "block")
ACTIVATION_QUANTS = ("none", "fp8_tensor", "fp8_token", "fp8_block")
FP8_FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
MXFP4_GROUP = 32


@dataclass(frozen=True)
class QuantSpec:
    """How the expert weights (and, for w8a8 kernels, the activations) are quantised.

    Canonical scale shapes: fp8 tensor `[E]`; channel `[E, N]`; block
    `[E, ceil(N/bn), ceil(K/bk)]`; mxfp4 packs two e2m1 values per uint8 along K
    (low nibble first) with one e8m0 (uint8) scale per 32 values: `[E, N, K/32]`.
    """

    weights: str = "none"
    granularity: str | None = None
    block: tuple[int, int] = (128, 128)
    fp8_format: str = "e4m3fn"
    activations: str = "none"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_QUANTS:
            raise SpecError(f"weight quantisation {self.weights!r} is not one of {WEIGHT_QUANTS}")
        if self.weights == "fp8" and self.granularity not in FP8_GRANULARITIES:
            raise SpecError(
                f"fp8 weights need granularity in {FP8_GRANULARITIES}, got {self.granularity!r}"
            )
        if self.weights != "fp8" and self.granularity is not None:
            raise SpecError(f"granularity {self.granularity!r} applies to fp8 weights only")
        if self.fp8_format not in FP8_FORMATS:
            raise SpecError(f"fp8 format {self.fp8_format!r} is not one of {sorted(FP8_FORMATS)}")
        if self.activations not in ACTIVATION_QUANTS:
            raise SpecError(
                f"activation quantisation {self.activations!r} is not one of {ACTIVATION_QUANTS}"
            )
        if self.activations != "none" and self.weights != "fp8":
            raise SpecError("fp8 activation quantisation needs fp8 weights (w8a8)")
        if len(self.block) != 2 or min(self.block) <= 0:
            raise SpecError(f"block must be two positive sizes, got {self.block!r}")

    @property
    def fp8_dtype(self) -> torch.dtype:
        return FP8_FORMATS[self.fp8_format]

    def __str__(self) -> str:
        if self.weights == "none":
            return "none"
        if self.weights == "mxfp4":
            return "mxfp4 (e2m1, e8m0 scale per 32)"
        gran = f"block{self.block[0]}x{self.block[1]}" if self.granularity == "block" else self.granularity
        act = "" if self.activations == "none" else f", activations {self.activations}"
        return f"fp8 {self.fp8_format} per-{gran}{act}"


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer as the adapter sees it (sizes are this rank's partition)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    activation: Activation = field(default_factory=Activation.silu)
    apply_router_weight_on_input: bool = False
    # Expert parallelism: global expert id -> local slot, or -1 when not on this rank.
    expert_map: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.bfloat16
    quant: QuantSpec = field(default_factory=QuantSpec)
    has_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise SpecError(f"{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise SpecError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise SpecError(f"activation dtype {self.dtype} is not float32, bfloat16 or float16")
        if self.expert_map is not None:
            self._check_expert_map()
        if self.quant.weights == "mxfp4" and (
            self.hidden_size % MXFP4_GROUP or self.intermediate_size % MXFP4_GROUP
        ):
            raise SpecError(
                f"mxfp4 needs hidden_size and intermediate_size divisible by {MXFP4_GROUP}, "
                f"got {self.hidden_size} and {self.intermediate_size}"
            )

    def _check_expert_map(self) -> None:
        emap = self.expert_map
        assert emap is not None
        if len(emap) != self.num_experts:
            raise SpecError(f"expert_map has {len(emap)} entries for {self.num_experts} experts")
        local = sorted(v for v in emap if v >= 0)
        if local != list(range(len(local))) or any(v < -1 for v in emap):
            raise SpecError("expert_map must send each local slot 0..L-1 exactly once, others to -1")
        if not local:
            raise SpecError("expert_map leaves no expert on this rank")

    @property
    def num_local_experts(self) -> int:
        if self.expert_map is None:
            return self.num_experts
        return sum(1 for v in self.expert_map if v >= 0)

    def expert_map_tensor(self, device: torch.device | str) -> torch.Tensor | None:
        if self.expert_map is None:
            return None
        return torch.tensor(self.expert_map, dtype=torch.int32, device=device)
