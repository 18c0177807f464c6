"""Bad input gets one clear error naming the problem, never a crash deep inside torch."""

import pytest
import torch

import moe_overlay as mo
from tests.backends_for_tests import params

E, H, I, K = 4, 32, 16, 2


def _prepared(**spec_kw):
    spec = mo.MoESpec(E, H, I, K, dtype=torch.float32, **spec_kw)
    e = spec.num_local_experts
    return mo.PreparedExperts(spec, params(w13=torch.randn(e, 2 * I, H), w2=torch.randn(e, H, I)),
                              mo.get_backend("torch"))


def _call(prepared, m=3, x_dtype=torch.float32, ids_dtype=torch.int32, w_dtype=torch.float32,
          ids=None, h=H, k=K):
    x = torch.randn(m, h, dtype=x_dtype)
    w = torch.rand(m, k, dtype=w_dtype)
    ids = torch.zeros(m, k, dtype=ids_dtype) if ids is None else ids
    return prepared.apply(x, w, ids)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"ids_dtype": torch.int64}, r"topk_ids must be torch.int32, got torch.int64"),
        ({"w_dtype": torch.bfloat16}, r"topk_weights must be torch.float32"),
        ({"x_dtype": torch.bfloat16}, r"hidden states are torch.bfloat16 but the layer was described as"),
        ({"h": H + 1}, r"hidden states must be \[tokens, 32\], got \(3, 33\)"),
        ({"k": K + 1}, r"topk_ids must have shape \(3, 2\)"),
        ({"ids": torch.tensor([[0, 1], [2, 4], [0, 1]], dtype=torch.int32)}, r"outside \[0, 4\) experts"),
        ({"ids": torch.tensor([[0, -1], [2, 3], [0, 1]], dtype=torch.int32)}, r"\[-1, 3\]"),
    ],
)
def test_bad_call(kwargs, message):
    with pytest.raises(mo.MoEInputError, match=message):
        _call(_prepared(), **kwargs)


def test_ids_range_uses_global_experts_with_an_expert_map():
    prepared = _prepared(expert_map=(0, -1, 1, -1))
    out = _call(prepared, ids=torch.tensor([[1, 3]] * 3, dtype=torch.int32))
    assert torch.count_nonzero(out) == 0
    with pytest.raises(mo.MoEInputError, match=r"outside \[0, 4\)"):
        _call(prepared, ids=torch.tensor([[1, 4]] * 3, dtype=torch.int32))


def test_empty_batch_returns_empty():
    out = _call(_prepared(), m=0)
    assert out.shape == (0, H) and out.dtype == torch.float32


def test_mismatched_devices():
    prepared = _prepared()
    x = torch.randn(3, H, device="meta")
    with pytest.raises(mo.MoEInputError, match=r"hidden states are on meta but the expert weights are on cpu"):
        prepared.apply(x, torch.rand(3, K), torch.zeros(3, K, dtype=torch.int32))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: mo.MoESpec(4, 32, 16, 5), r"top_k=5 exceeds num_experts=4"),
        (lambda: mo.MoESpec(0, 32, 16, 1), r"num_experts must be a positive integer, got 0"),
        (lambda: mo.MoESpec(4, 32, 16, 1, expert_map=(0, 0, -1, -1)), r"expert_map must send"),
        (lambda: mo.MoESpec(4, 32, 16, 1, expert_map=(0, -1)), r"expert_map has 2 entries for 4"),
        (lambda: mo.MoESpec(4, 32, 16, 1, dtype=torch.int8), r"activation dtype torch.int8"),
        (lambda: mo.MoESpec(4, 48, 16, 1, quant=mo.QuantSpec("mxfp4")), r"divisible by 32"),
        (lambda: mo.Activation("relu"), r"activation 'relu' is not known"),
        (lambda: mo.Activation("situ", (1.0,)), r"takes parameters \('beta', 'linear_beta'\)"),
        (lambda: mo.QuantSpec("fp8"), r"fp8 weights need granularity"),
        (lambda: mo.QuantSpec("int4"), r"weight quantisation 'int4'"),
        (lambda: mo.QuantSpec("none", activations="fp8_token"), r"needs fp8 weights"),
        (lambda: mo.Layout(gate_up="sideways"), r"gate_up order 'sideways'"),
    ],
)
def test_bad_description(make, message):
    with pytest.raises(mo.SpecError, match=message):
        make()


@pytest.mark.parametrize(
    "tensors,message",
    [
        ({"w13": torch.randn(E, 2 * I, H)}, r"missing \['w2'\]"),
        ({"w13": torch.randn(E, 2 * I, H), "w2": torch.randn(E, H, I), "bias": torch.zeros(1)},
         r"unexpected \['bias'\]"),
        ({"w13": torch.randn(E, I, H), "w2": torch.randn(E, H, I)},
         r"w13 has shape \(4, 16, 32\), expected \(4, 32, 32\)"),
        ({"w13": torch.randn(E, 2 * I, H).to(torch.float8_e4m3fn), "w2": torch.randn(E, H, I)},
         r"w13 has dtype torch.float8_e4m3fn"),
        ({"w13": torch.randn(E, 2 * I, H), "w2": torch.randn(E, H, I, device="meta")}, r"several devices"),
    ],
)
def test_bad_weights(tensors, message):
    spec = mo.MoESpec(E, H, I, K, dtype=torch.float32)
    with pytest.raises(mo.MoEInputError, match=message):
        mo.PreparedExperts(spec, tensors, mo.get_backend("torch"))


def test_shuffle_on_unfit_shape_is_refused_and_nothing_changes():
    from tests.backends_for_tests import RelayoutBackend

    spec = mo.MoESpec(E, 40, 16, K, dtype=torch.float32)  # K=40 is not a multiple of 32
    tensors = params(w13=torch.randn(E, 32, 40), w2=torch.randn(E, 40, 16))
    before = {k: v.clone() for k, v in tensors.items()}
    prepared = mo.PreparedExperts(spec, tensors, RelayoutBackend(mo.Layout("t", shuffle=(16, 16))))
    with pytest.raises(mo.SpecError, match=r"K % 32 == 0"):
        prepared.prepare()
    assert prepared.layout == mo.CANONICAL
    assert all(torch.equal(tensors[k], before[k]) for k in before)
