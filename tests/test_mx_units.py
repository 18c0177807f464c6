"""The mx_units layout (layout.mx_units): int16 units of four e2m1 codes, read back exactly, and
the kernels' decode of a quarter (shifts and masks to fp16, times the scale as fp16) computed in
torch from the same bits equals the canonical values."""

from __future__ import annotations

import pytest
import torch

import moe_overlay as mo
from moe_overlay.layout import MX_UNIT_K, MX_UNIT_SCALES, mx_units, mx_ununits, to_canonical, to_layout
from moe_overlay.spec import SpecError

E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6])


def decode(units: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`[E, N, K/4]` units and canonical e8m0 scales -> fp32 `[E, N, K]`, as the kernels decode:
    quarter i of each 64-K chunk by `((u << (9 - 3i)) & 0x0E00) | ((u << (3 - i)) & 0x8000)` as
    fp16, times 2^(s - 113) as fp16 (s clamped into MX_UNIT_SCALES)."""
    e, n, count = units.shape
    u = units.view(e, n, count * 4 // MX_UNIT_K, MX_UNIT_K // 4).to(torch.int32)
    quarters = []
    for i in range(4):
        bits = ((u << (9 - 3 * i)) & 0x0E00) | ((u << (3 - i)) & 0x8000)
        quarters.append(bits.to(torch.int16).view(torch.float16))
    values = torch.stack(quarters, dim=3).reshape(e, n, count * 4)  # K = 64c + 16i + j
    scale = ((scales.to(torch.int32).clamp(*MX_UNIT_SCALES) - 98) << 10).to(torch.int16).view(torch.float16)
    scale = scale.repeat_interleave(32, -1)
    return (values * scale).float()


def test_units_hold_every_code_and_read_back_exactly():
    packed = torch.randint(0, 256, (3, 16, 128), dtype=torch.uint8)
    units = mx_units(packed)
    assert units.dtype == torch.int16 and units.shape == (3, 16, 64)
    assert torch.equal(mx_ununits(units), packed)
    changed = packed.clone()
    changed[1, 2, 40] ^= 0x10  # K = 81 (the high code of byte 40): chunk 1, quarter 0, unit 16 + 1
    moved = (mx_units(changed) != units).nonzero().tolist()
    assert moved == [[1, 2, 17]]


@pytest.mark.parametrize("scale", list(MX_UNIT_SCALES))
def test_the_decode_of_units_is_the_canonical_values(scale):
    codes = torch.randint(0, 16, (2, 8, 128), dtype=torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.full((2, 8, 4), scale, dtype=torch.uint8)
    scales[0, 0, 1] = 120
    expected = E2M1[codes.long()] * torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert torch.equal(decode(mx_units(packed), scales), expected)


def test_the_layout_round_trips_and_refuses_scales_the_decode_cannot_keep_exact():
    spec = mo.MoESpec(4, 64, 32, 2, quant=mo.QuantSpec(weights="mxfp4"))
    gen = torch.Generator().manual_seed(0)
    tensors = {"w13": torch.randint(0, 256, (4, 64, 32), dtype=torch.uint8, generator=gen),
               "w2": torch.randint(0, 256, (4, 64, 16), dtype=torch.uint8, generator=gen),
               "w13_scale": torch.full((4, 64, 2), 120, dtype=torch.uint8),
               "w2_scale": torch.full((4, 64, 1), 120, dtype=torch.uint8)}
    layout = mo.Layout("triton", mx_units=("w13",))
    stored = to_layout(tensors, spec, layout)
    assert stored["w13"].dtype == torch.int16 and stored["w2"].dtype == torch.uint8
    back = to_canonical(stored, spec, layout)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    for value in (MX_UNIT_SCALES[0] - 1, MX_UNIT_SCALES[1] + 1):
        bad = {**tensors, "w13_scale": tensors["w13_scale"].clone()}
        bad["w13_scale"][2, 5, 1] = value
        with pytest.raises(SpecError, match=rf"w13_scale holds e8m0 {value} .*mx_units layout decodes"):
            to_layout(bad, spec, layout)


def test_an_all_zero_group_takes_any_scale_and_decodes_to_zeros():
    """Checkpoints give an all-zero group any e8m0 (0 where the quantiser took log2 of 0): its
    values are +-0 whatever the scale, so the layout takes it and the decode clamps it."""
    spec = mo.MoESpec(2, 64, 32, 2, quant=mo.QuantSpec(weights="mxfp4"))
    codes = torch.randint(0, 16, (2, 64, 64), dtype=torch.uint8)
    codes[1, 3, 32:] = torch.tensor([0, 8] * 16, dtype=torch.uint8)  # group 1 of row 3: +0 and -0
    w13 = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.full((2, 64, 2), 121, dtype=torch.uint8)
    scales[1, 3, 1] = 0
    tensors = {"w13": w13, "w2": torch.zeros(2, 64, 16, dtype=torch.uint8), "w13_scale": scales,
               "w2_scale": torch.full((2, 64, 1), 121, dtype=torch.uint8)}
    stored = to_layout(tensors, spec, mo.Layout("triton", mx_units=("w13",)))
    values = decode(stored["w13"], scales)
    assert torch.equal(values[1, 3, 32:], torch.zeros(32)) and torch.equal(values[1, 3, :32].abs() > 0,
                                                                            codes[1, 3, :32] % 8 > 0)
    codes[1, 3, 40] = 1  # one value of 0.5 in that group: its scale 0 is refused again
    tensors["w13"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
    with pytest.raises(SpecError, match="w13_scale holds e8m0 0 "):
        to_layout(tensors, spec, mo.Layout("triton", mx_units=("w13",)))
