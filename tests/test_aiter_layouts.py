"""The AITER layouts, bit for bit against AITER's own code (installed amd-aiter files)."""

import importlib.metadata

import pytest
import torch

import moe_overlay as mo
from moe_overlay.backends.aiter.capability import ARCHS
from moe_overlay.backends.aiter.ops import AITER_DISTRIBUTION
from moe_overlay.layout import shuffle_mx_scales, shuffle_tiles, to_canonical, to_layout
from moe_overlay.quant import (
    E8M0_BIAS,
    dequantize_fp8,
    dequantize_mxfp4,
    native_fp8_format,
    quantize_fp8,
    quantize_mxfp4,
)
from tests.aiter_emulator.layers import emulated_backend
from tests.aiter_emulator.reference import aiter_reference

try:  # AITER's sources are read from the installed amd-aiter (`make test` installs it; a GPU machine may not)
    importlib.metadata.distribution(AITER_DISTRIBUTION)
except importlib.metadata.PackageNotFoundError:
    pytest.skip("amd-aiter is not installed: these tests read AITER's own files (they run in `make test`)",
                allow_module_level=True)

REF = aiter_reference("gfx950")
GEN = torch.Generator().manual_seed(0)


def _random_bits(shape, dtype):
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * torch.empty(0, dtype=dtype).element_size()),
                         generator=GEN, dtype=torch.uint8).view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                                   torch.uint8])
@pytest.mark.parametrize("shape", [(16, 32), (3, 64, 96), (2, 512, 256)])
def test_weight_shuffle_is_aiters_shuffle_weight(dtype, shape):
    x = _random_bits(shape, dtype)
    theirs = REF.shuffle.shuffle_weight(x, layout=(16, 16))
    assert theirs.is_shuffled is True
    assert _same_bits(shuffle_tiles(x, (16, 16)), theirs)


@pytest.mark.parametrize("shape", [(1, 32, 64), (4, 256, 1792), (2, 768, 192)])
def test_mxfp4_weight_shuffle_is_aiters_a16w4_shuffle(shape):
    packed = _random_bits(shape, torch.uint8)
    theirs = REF.shuffle.shuffle_weight_a16w4(packed, 16, False)
    assert _same_bits(shuffle_tiles(packed, (16, 32)), theirs)


@pytest.mark.parametrize("experts,rows,groups", [(1, 32, 8), (3, 64, 16), (2, 3584, 112)])
def test_mx_scale_shuffle_is_aiters_a16w4_scale_shuffle(experts, rows, groups):
    s = _random_bits((experts, rows, groups), torch.uint8)
    theirs = REF.shuffle.shuffle_scale_a16w4(s.view(-1, groups), experts, False)
    assert _same_bits(shuffle_mx_scales(s).view(-1, groups), theirs)


def test_mx_scale_padding_is_aiter_mains():
    """Kimi-K3's w2 has K=384: 12 scale groups. AITER main pads them to 16 with 0x7F (2^0)
    before its shuffle; the installed AITER's shuffle (same order) takes only whole tiles."""
    spec = mo.MoESpec(2, 256, 384, 2, mo.Activation.situ(), quant=mo.QuantSpec("mxfp4"))
    w13, s13 = quantize_mxfp4(torch.randn(2, 768, 256, generator=GEN))
    w2, s2 = quantize_mxfp4(torch.randn(2, 256, 384, generator=GEN))
    layout = emulated_backend("gfx950")[0].plan(spec).layout
    out = to_layout({"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2}, spec, layout)
    padded = torch.cat([s2, torch.full((2, 256, 4), E8M0_BIAS, dtype=torch.uint8)], dim=-1)
    assert _same_bits(out["w2_scale"].view(-1, 16), REF.shuffle.shuffle_scale_a16w4(padded.view(-1, 16), 2, False))
    assert _same_bits(out["w13_scale"].view(-1, 8), REF.shuffle.shuffle_scale_a16w4(s13.view(-1, 8), 2, False))
    back = to_canonical(out, spec, layout)
    assert all(_same_bits(back[k], v) for k, v in {"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2}.items())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fp8_flavour_per_arch_is_aiters_dtypes_fp8(arch):
    native = mo.QuantSpec("fp8", "tensor", fp8_format=native_fp8_format(arch)).fp8_dtype
    assert aiter_reference(arch).dtypes.fp8 == native


def test_fnuz_conversion_keeps_every_e4m3fn_value():
    """All 256 e4m3fn codes: the e4m3fnuz bits with the doubled scale decode, with AITER's
    reference dequantisation (w.to(fp32) * scale), to exactly the original values."""
    spec = mo.MoESpec(1, 32, 32, 1, quant=mo.QuantSpec("fp8", "tensor", activations="fp8_tensor"))
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    tensors = {"w13": codes.repeat(8).view(1, 64, 32), "w2": codes.repeat(4).view(1, 32, 32),
               "w13_scale": torch.tensor([0.75]), "w2_scale": torch.tensor([1.5])}
    layout = emulated_backend("gfx942", "installed")[0].plan(spec).layout
    assert layout.fp8_format == "e4m3fnuz"
    out = to_layout(tensors, spec, mo.Layout("fnuz-only", fp8_format=layout.fp8_format))  # unshuffled, to compare
    assert out["w13"].dtype == aiter_reference("gfx942").dtypes.fp8
    before = dequantize_fp8(tensors["w13"], tensors["w13_scale"], spec.quant)
    after = out["w13"].to(torch.float32) * out["w13_scale"].view(-1, 1, 1)  # as torch_moe_stage1 does
    finite = ~before.isnan()
    assert finite.sum() == 8 * 254  # e4m3fn's two NaNs stay out of checkpoints
    assert torch.equal(after[finite], before[finite])


def test_block_token_and_tensor_scales_are_aiters_quantisers():
    """Our canonical scales, reshaped as the backend hands them over, equal what AITER's own
    quantiser (pertoken_quant, as its tests use it per tensor, row and 128x128 block) gives."""
    w = torch.randn(2, 256, 384, generator=GEN)
    fp8 = torch.float8_e4m3fn
    pertoken = REF.quant.pertoken_quant
    q, s = quantize_fp8(w, mo.QuantSpec("fp8", "channel"))
    aq, as_ = pertoken(w, quant_dtype=fp8)
    assert _same_bits(q, aq) and _same_bits(s.unsqueeze(-1), as_)
    q, s = quantize_fp8(w, mo.QuantSpec("fp8", "tensor"))
    aq, as_ = pertoken(w.view(2, -1), quant_dtype=fp8)
    assert _same_bits(q, aq.view(w.shape)) and _same_bits(s.view(-1, 1), as_)
    q, s = quantize_fp8(w, mo.QuantSpec("fp8", "block", (128, 128)))
    blocks = w.view(2, 2, 128, 3, 128).permute(0, 1, 3, 2, 4).reshape(2, 6, 128 * 128)
    aq, as_ = pertoken(blocks, quant_dtype=fp8)
    assert _same_bits(s, as_.view(2, 2, 3))
    assert _same_bits(q, aq.view(2, 2, 3, 128, 128).permute(0, 1, 3, 2, 4).reshape(w.shape))


def test_mxfp4_decodes_as_aiter_decodes():
    packed, scale = quantize_mxfp4(torch.randn(3, 64, 256, generator=GEN) * 4)
    theirs = REF.fp4_utils.mxfp4_to_f32(packed.view(REF.dtypes.fp4x2)).view(3, 64, 8, 32)
    theirs = theirs * REF.fp4_utils.e8m0_to_f32(scale).view(3, 64, 8, 1)
    assert torch.equal(dequantize_mxfp4(packed, scale), theirs.view(3, 64, 256))
