"""Small random MoE layers on every AITER path, and AITER backends driving an emulator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import moe_overlay as mo
from moe_overlay.backends.aiter.backend import AiterBackend
from moe_overlay.backends.aiter.check import FP8_BLOCK, FP8_TENSOR, FP8_TOKEN
from moe_overlay.backends.problems import random_weights

from .emulator import AiterEmulator
from .sources import AiterContract, installed_contract, main_contract

MXFP4 = mo.QuantSpec("mxfp4")


@dataclass(frozen=True)
class PathCase:
    name: str
    spec: mo.MoESpec
    archs: tuple[str, ...]
    contract: str  # "installed" or "main": the oldest AITER known to run it
    tolerance: float  # max |aiter - torch| / max |torch|


def _spec(quant=FP8_TENSOR, k=2, act=None, on_input=False, i=128, **kw) -> mo.MoESpec:
    return mo.MoESpec(6, 256, i, k, act or mo.Activation.silu(), on_input, quant=quant, **kw)


BOTH = ("gfx942", "gfx950")
# fp8: both sides quantise activations, on grids that differ on gfx942 (AITER's e4m3fnuz, the
# reference's e4m3fn), so their fp8 errors do not cancel there.
PATH_CASES = [
    PathCase("bf16-silu", _spec(mo.QuantSpec()), BOTH, "installed", 0.02),
    PathCase("fp16-gelu-weight-on-input", _spec(mo.QuantSpec(), 1, mo.Activation.gelu(), True, dtype=torch.float16),
             BOTH, "installed", 0.02),
    PathCase("fp8-tensor", _spec(FP8_TENSOR), BOTH, "installed", 0.12),
    PathCase("fp8-token-weight-on-input", _spec(FP8_TOKEN, 1, on_input=True), BOTH, "installed", 0.12),
    PathCase("fp8-token-k4", _spec(FP8_TOKEN, 4), BOTH, "installed", 0.12),
    PathCase("fp8-block", _spec(FP8_BLOCK, 3, i=256), BOTH, "installed", 0.12),
    PathCase("mxfp4-situ", _spec(MXFP4, 4, mo.Activation.situ()), ("gfx950",), "main", 0.02),
    PathCase("mxfp4-situ-kimi-w2-groups", _spec(MXFP4, 2, mo.Activation.situ(2.0, 10.0), i=384), ("gfx950",), "main",
             0.02),
]
CONTRACTS = {"installed": installed_contract, "main": main_contract}


def emulated_backend(arch: str, contract: AiterContract | str = "main",
                     env: dict[str, str] | None = None) -> tuple[AiterBackend, AiterEmulator]:
    """An AITER backend on an emulated `arch`, both in `env` (default: none of AITER's switches,
    whatever this process has: importing vLLM sets AITER_SITUV2_A4W4=1)."""
    if isinstance(contract, str):
        contract = CONTRACTS[contract]()
    emulator = AiterEmulator(arch, contract, env or {})
    return AiterBackend(emulator, env or {}), emulator


def random_layer(spec: mo.MoESpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical tensors for `spec`, as nn.Parameters (what a model holds)."""
    tensors = random_weights(spec, "cpu", seed, gain=1.0)
    return {k: torch.nn.Parameter(v, requires_grad=False) for k, v in tensors.items()}


def random_batch(spec: mo.MoESpec, m: int = 13, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(spec.num_experts, generator=gen)[: spec.top_k] for _ in range(m)]).int()
    weights = torch.rand(m, spec.top_k, generator=gen)
    return torch.randn(m, spec.hidden_size, generator=gen).to(spec.dtype), weights, ids


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def reference_output(spec: mo.MoESpec, tensors: dict[str, torch.Tensor], batch) -> torch.Tensor:
    canonical = {k: v.detach().clone() for k, v in tensors.items()}
    return mo.PreparedExperts(spec, canonical, mo.get_backend("torch")).apply(*batch)
