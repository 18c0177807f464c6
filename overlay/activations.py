"""Gated activations on `[..., 2I]` (gate half first, then up half) -> `[..., I]`, in fp32."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .spec import Activation


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate) * up


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """Kimi-K3's SiTU: beta*tanh(g/beta)*sigmoid(g) * betaL*tanh(u/betaL); an infinite betaL
    (unset) leaves u unclipped."""
    gated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if math.isinf(linear_beta):
        return gated * up
    return gated * (linear_beta * torch.tanh(up / linear_beta))


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss: gate clamped above at limit, up to [-limit, limit]; g*sigmoid(alpha*g)*(u+1)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1.0)


def apply_gated(act: Activation, gate_up: torch.Tensor) -> torch.Tensor:
    """Apply `act` to `gate_up` (computed in fp32 whatever the input dtype)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    if act.kind == "silu":
        return silu_and_mul(gate, up)
    if act.kind == "gelu":
        return gelu_and_mul(gate, up)
    if act.kind == "situ":
        return situ_and_mul(gate, up, act.param("beta"), act.param("linear_beta"))
    if act.kind == "swiglu_clamped":
        return swiglu_clamped(gate, up, act.param("alpha"), act.param("limit"))
    raise AssertionError(f"unreachable: activation {act.kind!r} passed Activation's check")
