"""The mx_words kernels (NVIDIA, bf16 activations) on Triton's CPU interpreter.

The interpreter cannot run them as they are: it has no bf16 bit casts (the decode) and its bf16
dot is wrong. Here the decode is replaced by the same values computed in fp32 arithmetic from
the words' bit places (layout.MX_PAIR_BITS / MX_WORD_ROTATE) and the dot runs in fp32, so what is
checked is everything around them: which words each K step loads, the K splits, the row
tiles sharing a decoded weight tile, the stores. The decode
itself is checked bit for bit against a torch copy in tests/test_triton_backend.py, and the
real kernels run on the GPU lane (test_mxfp4_layers_match_the_dequantising_reference)."""

import os

import pytest
import torch

import moe_overlay as mo
from moe_overlay.backends.problems import random_input, random_routing, random_weights
from moe_overlay.backends.reference import reference_moe
from moe_overlay.backends.triton_moe.bench import relative_error
from moe_overlay.backends.triton_moe.configs import KernelConfig, LaunchConfig
from moe_overlay.layout import MX_PAIR_BITS, MX_WORD_ROTATE, Layout, to_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
    reason="CPU interpreter only (the GPU lane runs the real decode)")]

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from moe_overlay.backends.triton_moe import kernels, launch  # noqa: E402

MX_GROUP = kernels.MX_GROUP
# the word bits of each pair's (sign, exponent bit 1, exponent bit 0, mantissa), low halves;
# high halves are 16 up (mod 32)
PLACES = tuple(tuple((bit - turn) % 32 for bit, turn in zip(MX_PAIR_BITS, turns, strict=True))
               for turns in MX_WORD_ROTATE)
P0 = tuple(tl.constexpr(b) for b in PLACES[0])
P1 = tuple(tl.constexpr(b) for b in PLACES[1])
P2 = tuple(tl.constexpr(b) for b in PLACES[2])
P3 = tuple(tl.constexpr(b) for b in PLACES[3])


@triton.jit
def _bit(words, PLACE: tl.constexpr, HIGH: tl.constexpr):
    """Bit PLACE of each word (PLACE + 16 mod 32 for the high half), 0 or 1."""
    return (words >> ((PLACE + 16 * HIGH) % 32)) & 1


@triton.jit
def _value(words, S: tl.constexpr, E1: tl.constexpr, E0: tl.constexpr, M: tl.constexpr, HIGH: tl.constexpr, scale):
    """The e2m1 value whose sign, exponent and mantissa bits sit at those places, times `scale`, as fp32."""
    e = _bit(words, E1, HIGH) * 2 + _bit(words, E0, HIGH)
    m = _bit(words, M, HIGH).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where(_bit(words, S, HIGH) == 1, -v, v) * scale


@triton.jit
def _pair(words, P: tl.constexpr, scale):
    return tl.join(_value(words, P[0], P[1], P[2], P[3], 0, scale), _value(words, P[0], P[1], P[2], P[3], 1, scale))


@triton.jit
def _decode_in_arithmetic(words, scales):
    """kernels._mx_decode's result (same shape and K order) without bit casts."""
    scale = tl.broadcast_to(tl.exp2(scales.to(tl.float32) - 127.0)[:, :, None], words.shape)
    half0 = tl.join(_pair(words, P0, scale), _pair(words, P1, scale))
    half1 = tl.join(_pair(words, P2, scale), _pair(words, P3, scale))
    full = tl.permute(tl.join(half0, half1), (0, 1, 5, 4, 2, 3))
    return tl.reshape(full, [words.shape[0], words.shape[1] * MX_GROUP]).to(tl.bfloat16)


@triton.jit
def _weight_first_dot_in_fp32(acc, a, a_scale, b, b_scale, W_QUANT: tl.constexpr, A_FMT: tl.constexpr,
                              ONE_SCALE: tl.constexpr, MX_WORDS: tl.constexpr, W_LEFT: tl.constexpr,
                              MX_DEQUANT: tl.constexpr):
    """kernels._mma_step's mx_words case (the only one these layers reach), in fp32."""
    return tl.trans(tl.dot(b.to(tl.float32), tl.trans(a.to(tl.float32)), tl.trans(acc)))


def _kernel(block_n: int, block_k: int, **extra: int | bool) -> KernelConfig:
    return KernelConfig(block_n, block_k, 4, 2, **extra)


SPECS = {
    "situ-k4": mo.MoESpec(16, 256, 128, 4, mo.Activation.situ(3.0, 9.0), quant=mo.QuantSpec("mxfp4")),
    "k1-oninput-ep": mo.MoESpec(8, 192, 64, 1, apply_router_weight_on_input=True,
                                expert_map=(0, -1, 1, -1, 2, 3, -1, -1), quant=mo.QuantSpec("mxfp4")),
}
# (tokens, launch): tiny mode with the 16-row dot, the gemv gate/up unsplit (8 columns a program) and
# split 3 ways (16)
# (the down sums 3 partials, padded to 4), sorted mode with a block of two row tiles (32 and
# 16 sharing each decoded tile) and the streamed down
LAUNCHES = {
    "tiny-dot": (1, LaunchConfig(16, _kernel(16, 128, split_k=2), _kernel(16, 128))),
    "tiny-gemv": (1, LaunchConfig(16, _kernel(8, 64, gemv=True), _kernel(16, 64))),
    "tiny-gemv-split3": (3, LaunchConfig(16, _kernel(16, 64, gemv=True, split_k=3), _kernel(32, 64))),
    "sorted-two-tiles-streamed": (40, LaunchConfig(48, _kernel(32, 64), _kernel(64, 64, n_split=2))),
}


@pytest.mark.parametrize("launch_name", LAUNCHES)
@pytest.mark.parametrize("spec_name", SPECS)
def test_mx_words_kernels_around_the_decode_match_the_reference(spec_name, launch_name, monkeypatch):
    monkeypatch.setattr(kernels, "_mx_decode", _decode_in_arithmetic)
    monkeypatch.setattr(kernels, "_mma_step", _weight_first_dot_in_fp32)
    spec, (m, config) = SPECS[spec_name], LAUNCHES[launch_name]
    canonical = random_weights(spec, "cpu", seed=0)
    tensors = to_layout(canonical, spec, Layout("triton", mx_words=True))
    weights, ids = random_routing(m, spec, "cpu", seed=1)
    x = random_input(m, spec, "cpu", seed=2)
    emap = spec.expert_map_tensor("cpu")
    ref = reference_moe(x, canonical["w13"], canonical["w2"], weights, ids, spec.quant, spec.activation,
                        spec.apply_router_weight_on_input, (canonical["w13_scale"], canonical["w2_scale"]),
                        expert_map=emap)
    layer = launch.Layer.of(x, tensors["w13"], tensors["w2"],
                            spec.top_k, spec.activation.kind, list(spec.activation.params),
                            spec.apply_router_weight_on_input, None)
    assert layer.mx_words
    out = launch.fused_experts(layer, x, tensors["w13"], tensors["w2"], tensors["w13_scale"], tensors["w2_scale"],
                               weights, ids, emap, config)
    assert relative_error(out, ref) < 2e-2
