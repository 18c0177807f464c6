"""Quantised-weight formats in their canonical form: dequantisation (what the reference
computes with) and quantisation (to make test and benchmark weights).

Weights are `[E, N, K]` (N output rows, K the reduction dim) for both w13 and w2.
"""

from __future__ import annotations

import math

import torch

from .errors import MoEInputError
from .spec import MXFP4_GROUP, QuantSpec

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127


FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")  # the MI300 family: hardware fp8 is e4m3fnuz


def native_fp8_format(arch: str) -> str:
    """The fp8 flavour a GPU's matrix cores compute in (e4m3fn on NVIDIA and gfx950)."""
    return "e4m3fnuz" if arch in FNUZ_ARCHS else "e4m3fn"


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """`[E, ceil(N/bn), ceil(K/bk)]` -> `[E, N, K]` by repeating each block's scale."""
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :rows, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, quant: QuantSpec) -> torch.Tensor:
    """fp8 `[E, N, K]` with its canonical scale -> fp32 `[E, N, K]`."""
    w = weight.float()
    s = scale.float()
    if quant.granularity == "tensor":
        return w * s.reshape(-1, 1, 1)
    if quant.granularity == "channel":
        return w * s.unsqueeze(-1)
    return w * expand_block_scale(s, w.shape[-2], w.shape[-1], quant.block)


def quantize_fp8_tensor(
    weight: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[E, N, K]` with each expert's amax `[E]` -> (fp8 weight, scale `[E]` = amax / fp8 max)."""
    fmax = fp8_max(dtype)
    scale = (amax.float() / fmax).clamp_min(1e-12)
    return (weight.float() / scale.reshape(-1, 1, 1)).clamp(-fmax, fmax).to(dtype), scale


def quantize_fp8(
    weight: torch.Tensor, quant: QuantSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 `[E, N, K]` -> (fp8 weight, canonical scale) with amax scaling."""
    dtype = quant.fp8_dtype
    w = weight.float()
    fmax = fp8_max(dtype)
    if quant.granularity == "tensor":
        return quantize_fp8_tensor(w, w.abs().amax(dim=(-2, -1)), dtype)
    if quant.granularity == "channel":
        scale = (w.abs().amax(dim=-1) / fmax).clamp_min(1e-12)
        return (w / scale.unsqueeze(-1)).clamp(-fmax, fmax).to(dtype), scale
    bn, bk = quant.block
    e, n, k = w.shape
    padded = torch.zeros(e, math.ceil(n / bn) * bn, math.ceil(k / bk) * bk, dtype=w.dtype, device=w.device)
    padded[:, :n, :k] = w
    blocks = padded.view(e, padded.shape[1] // bn, bn, padded.shape[2] // bk, bk)
    scale = (blocks.abs().amax(dim=(2, 4)) / fmax).clamp_min(1e-12)
    q = (w / expand_block_scale(scale, n, k, quant.block)).clamp(-fmax, fmax).to(dtype)
    return q, scale


def fake_quantize_activations(x: torch.Tensor, mode: str, dtype: torch.dtype, block_k: int) -> torch.Tensor:
    """What a w8a8 kernel sees of its fp32 input: dynamic fp8 quantise then dequantise."""
    if mode == "none" or x.numel() == 0:
        return x
    fmax = fp8_max(dtype)
    if mode == "fp8_tensor":
        scale = (x.abs().amax() / fmax).clamp_min(1e-12)
        return (x / scale).clamp(-fmax, fmax).to(dtype).float() * scale
    if mode == "fp8_token":
        scale = (x.abs().amax(dim=-1, keepdim=True) / fmax).clamp_min(1e-12)
        return (x / scale).clamp(-fmax, fmax).to(dtype).float() * scale
    m, k = x.shape
    groups = math.ceil(k / block_k)
    padded = torch.zeros(m, groups * block_k, dtype=x.dtype, device=x.device)
    padded[:, :k] = x
    scale = (padded.view(m, groups, block_k).abs().amax(dim=-1) / fmax).clamp_min(1e-12)
    full = scale.repeat_interleave(block_k, dim=-1)[:, :k]
    return (x / full).clamp(-fmax, fmax).to(dtype).float() * full


def _e2m1_table(device: torch.device) -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(scale.to(torch.float32) - E8M0_BIAS)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 `[E, N, K/2]` (low nibble = even k) with e8m0 `[E, N, K/32]` -> fp32 `[E, N, K]`."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise MoEInputError(
            f"mxfp4 weights and scales must be uint8, got {packed.dtype} and {scale.dtype}"
        )
    table = _e2m1_table(packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    values = table[codes]
    return values * e8m0_to_float(scale).repeat_interleave(MXFP4_GROUP, dim=-1)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32/bf16 `[E, N, K]` -> (uint8 `[E, N, K/2]`, e8m0 uint8 `[E, N, K/32]`), OCP MX rules."""
    w = weight.float()
    *lead, k = w.shape
    if k % MXFP4_GROUP:
        raise MoEInputError(f"mxfp4 needs K divisible by {MXFP4_GROUP}, got {k}")
    groups = w.view(*lead, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)
    # Shared exponent = floor(log2(amax)) - 2, since e2m1's largest power of two is 4.
    exp = torch.floor(torch.log2(amax.clamp_min(2.0**-127))) - 2
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    magnitude = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - table).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8).view(*lead, k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp + E8M0_BIAS).to(torch.uint8)
