"""The torch reference backend against a per-token, per-expert loop in float64."""

import pytest
import torch

import moe_overlay as mo
from moe_overlay.quant import quantize_fp8, quantize_mxfp4
from tests.loops import loop_dequant_fp8, loop_dequant_mxfp4, loop_moe

E, H, I, K, M = 6, 64, 32, 2, 19
ACTIVATIONS = [mo.Activation.silu(), mo.Activation.gelu(), mo.Activation.situ(4.0, 25.0),
               mo.Activation.swiglu_clamped(1.702, 7.0)]


def _routing(m, experts, k, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(m)]).int()
    weights = torch.rand(m, k, generator=gen)
    return weights, ids


def _run(spec, tensors, x, weights, ids):
    prepared = mo.PreparedExperts(spec, tensors, mo.get_backend("torch"))
    prepared.prepare()
    return prepared.apply(x, weights, ids)


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_matches_loop(activation, on_input, dtype):
    gen = torch.Generator().manual_seed(1)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) * 0.3).to(dtype)
    x = torch.randn(M, H, generator=gen).to(dtype)
    weights, ids = _routing(M, E, K, 2)
    spec = mo.MoESpec(E, H, I, K, activation, on_input, dtype=dtype)
    got = _run(spec, {"w13": w13, "w2": w2}, x, weights, ids)
    ref = loop_moe(x, w13, w2, weights, ids, activation, on_input)
    assert got.dtype == dtype and got.shape == (M, H)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.double(), ref, **tol)


def test_bias_matches_loop():
    gen = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen) * 0.2, torch.randn(E, H, I, generator=gen) * 0.2
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    x = torch.randn(M, H, generator=gen)
    weights, ids = _routing(M, E, K, 4)
    act = mo.Activation.swiglu_clamped()
    spec = mo.MoESpec(E, H, I, K, act, dtype=torch.float32, has_bias=True)
    got = _run(spec, {"w13": w13, "w2": w2, "w13_bias": b13, "w2_bias": b2}, x, weights, ids)
    ref = loop_moe(x, w13, w2, weights, ids, act, b13=b13, b2=b2)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("on_input", [False, True])
def test_expert_map_skips_non_local_experts(on_input):
    # 10 global experts, this rank holds 4 of them in slots 0..3.
    expert_map = (-1, 2, -1, 0, -1, -1, 3, -1, 1, -1)
    gen = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(4, 2 * I, H, generator=gen) * 0.3, torch.randn(4, H, I, generator=gen) * 0.3
    x = torch.randn(M, H, generator=gen)
    weights, ids = _routing(M, 10, 3, 6)
    spec = mo.MoESpec(10, H, I, 3, apply_router_weight_on_input=on_input, expert_map=expert_map,
                      dtype=torch.float32)
    got = _run(spec, {"w13": w13, "w2": w2}, x, weights, ids)
    ref = loop_moe(x, w13, w2, weights, ids, spec.activation, on_input, expert_map=list(expert_map))
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-4)
    assert got.abs().sum() > 0  # some tokens did land on local experts
    all_remote = torch.tensor([[0, 2, 4]] * M, dtype=torch.int32)
    assert torch.count_nonzero(_run(spec, {"w13": w13, "w2": w2}, x, weights, all_remote)) == 0


def _fp8_act_quant(dtype, mode, block_k=128):
    fmax = torch.finfo(dtype).max

    def quant(v):
        v = v.double()
        if mode == "fp8_token":
            s = (v.abs().max(dim=-1, keepdim=True).values / fmax).clamp_min(1e-12)
        else:  # fp8_block along K
            groups = [v[:, c : c + block_k] for c in range(0, v.shape[1], block_k)]
            s = torch.cat([(g.abs().max(dim=-1, keepdim=True).values / fmax).clamp_min(1e-12).expand_as(g)
                           for g in groups], dim=1)
        return (v / s).float().to(dtype).double() * s

    return quant


@pytest.mark.parametrize(
    "granularity,act_quant",
    [("tensor", "none"), ("channel", "none"), ("block", "none"), ("tensor", "fp8_token"),
     ("channel", "fp8_token"), ("block", "fp8_block")],
)
def test_fp8_matches_loop(granularity, act_quant):
    h, i = 128, 64
    quant = mo.QuantSpec("fp8", granularity, (64, 64), activations=act_quant)
    gen = torch.Generator().manual_seed(7)
    w13, s13 = quantize_fp8(torch.randn(3, 2 * i, h, generator=gen), quant)
    w2, s2 = quantize_fp8(torch.randn(3, h, i, generator=gen), quant)
    x = torch.randn(9, h, generator=gen).bfloat16()
    weights, ids = _routing(9, 3, 2, 8)
    spec = mo.MoESpec(3, h, i, 2, quant=quant)
    got = _run(spec, {"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2}, x, weights, ids)
    dense13 = torch.stack([loop_dequant_fp8(w13[e], s13[e], granularity, (64, 64)) for e in range(3)])
    dense2 = torch.stack([loop_dequant_fp8(w2[e], s2[e], granularity, (64, 64)) for e in range(3)])
    aq = None if act_quant == "none" else _fp8_act_quant(torch.float8_e4m3fn, act_quant, 64)
    ref = loop_moe(x, dense13, dense2, weights, ids, spec.activation, act_quant=aq)
    torch.testing.assert_close(got.double(), ref, atol=0.1, rtol=2e-2)


def test_mxfp4_matches_loop():
    h, i = 64, 64
    gen = torch.Generator().manual_seed(9)
    w13, s13 = quantize_mxfp4(torch.randn(3, 2 * i, h, generator=gen))
    w2, s2 = quantize_mxfp4(torch.randn(3, h, i, generator=gen))
    x = torch.randn(7, h, generator=gen).bfloat16()
    weights, ids = _routing(7, 3, 2, 10)
    act = mo.Activation.situ()
    spec = mo.MoESpec(3, h, i, 2, act, quant=mo.QuantSpec("mxfp4"))
    got = _run(spec, {"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2}, x, weights, ids)
    dense13 = torch.stack([loop_dequant_mxfp4(w13[e], s13[e]) for e in range(3)])
    dense2 = torch.stack([loop_dequant_mxfp4(w2[e], s2[e]) for e in range(3)])
    ref = loop_moe(x, dense13, dense2, weights, ids, act)
    torch.testing.assert_close(got.double(), ref, atol=0.1, rtol=2e-2)


def test_quantisers_round_trip_within_format_error():
    w = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(11))
    packed, scale = quantize_mxfp4(w)
    back = torch.stack([loop_dequant_mxfp4(packed[e], scale[e]) for e in range(2)]).float()
    # e2m1 keeps 1 mantissa bit: error under a quarter of each group's max magnitude
    group_max = w.abs().view(2, 64, 8, 32).amax(-1).repeat_interleave(32, -1)
    assert ((back - w).abs() <= group_max / 4 + 1e-6).all()
    quant = mo.QuantSpec("fp8", "block", (128, 128))
    q, s = quantize_fp8(w, quant)
    assert s.shape == (2, 1, 2)
    deq = torch.stack([loop_dequant_fp8(q[e], s[e], "block") for e in range(2)]).float()
    torch.testing.assert_close(deq, w, atol=0.1, rtol=0.07)
