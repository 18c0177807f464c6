"""prepare / restore / apply: idempotence, bit-exact round trips, stable pointers, fail closed."""

import pytest
import torch

import moe_overlay as mo
from moe_overlay.layout import shuffle_tiles, unshuffle_tiles
from moe_overlay.quant import quantize_fp8
from tests.backends_for_tests import RelayoutBackend, params

E, H, I, K = 4, 64, 32, 2
SHUFFLED = mo.Layout("test-shuffle", shuffle=(16, 16))
LAYOUTS = [
    SHUFFLED,
    mo.Layout("test-interleave", gate_up="interleaved"),
    mo.Layout("test-upgate-transposed", gate_up="up_gate", transposed=True),
    mo.Layout("test-all", gate_up="interleaved", shuffle=(16, 16), transposed=True),
]


def _dense(dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return params(w13=torch.randn(E, 2 * I, H, generator=gen).to(dtype),
                  w2=torch.randn(E, H, I, generator=gen).to(dtype))


def _routed(m=11, seed=1, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(m)]).int()
    return torch.randn(m, H, generator=gen).to(dtype), torch.rand(m, K, generator=gen), ids


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_prepare_is_idempotent_in_place_and_restore_is_bit_exact(layout):
    spec = mo.MoESpec(E, H, I, K)
    tensors = _dense()
    original = {k: v.detach().clone() for k, v in tensors.items()}
    pointers = {k: v.data_ptr() for k, v in tensors.items()}
    objects = dict(tensors)
    prepared = mo.PreparedExperts(spec, tensors, RelayoutBackend(layout))
    prepared.prepare()
    once = {k: v.detach().clone() for k, v in tensors.items()}
    assert prepared.layout == layout
    assert any(not torch.equal(once[k], original[k]) for k in original)  # it really moved
    prepared.prepare()
    assert all(torch.equal(tensors[k], once[k]) for k in once)  # twice == once
    assert {k: v.data_ptr() for k, v in tensors.items()} == pointers
    assert all(tensors[k] is objects[k] for k in objects)
    prepared.restore()
    assert prepared.layout == mo.CANONICAL
    for k in original:
        assert tensors[k].shape == original[k].shape
        assert torch.equal(tensors[k].view(torch.int16), original[k].view(torch.int16))
    assert {k: v.data_ptr() for k, v in tensors.items()} == pointers


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_prepared_layouts_compute_the_same_as_canonical(layout):
    spec = mo.MoESpec(E, H, I, K)
    x, w, ids = _routed()
    expected = mo.PreparedExperts(spec, _dense(), mo.get_backend("torch")).apply(x, w, ids)
    prepared = mo.PreparedExperts(spec, _dense(), RelayoutBackend(layout))
    prepared.prepare()
    assert torch.equal(prepared.apply(x, w, ids), expected)


def test_shuffle_matches_its_definition():
    # one 16x32 bf16 tile: 16-byte runs are 8 elements; runs are laid out run-major
    x = torch.arange(16 * 32, dtype=torch.int16).view(1, 16, 32).view(torch.bfloat16)
    s = shuffle_tiles(x).view(torch.int16).flatten().tolist()
    expected = [row * 32 + run * 8 + j for run in range(4) for row in range(16) for j in range(8)]
    assert s == expected
    assert torch.equal(unshuffle_tiles(shuffle_tiles(x)).view(torch.int16), x.view(torch.int16))


def test_padding_rebinds_storage_and_restores():
    spec = mo.MoESpec(E, H, I, K)
    tensors = _dense()
    original = {k: v.detach().clone() for k, v in tensors.items()}
    layout = mo.Layout("test-pad", padded_intermediate=48, padded_hidden=80)
    prepared = mo.PreparedExperts(spec, tensors, RelayoutBackend(layout))
    x, w, ids = _routed()
    expected = mo.PreparedExperts(spec, _dense(), mo.get_backend("torch")).apply(x, w, ids)
    prepared.prepare()
    assert tensors["w13"].shape == (E, 96, 80) and tensors["w2"].shape == (E, 80, 48)
    assert torch.equal(tensors["w13"][:, I:48], torch.zeros(E, 16, 80, dtype=torch.bfloat16))
    prepared.restore()
    assert all(torch.equal(tensors[k], original[k]) for k in original)
    prepared.prepare()
    assert torch.equal(prepared.apply(x, w, ids), expected)


def test_fnuz_conversion_doubles_scales_and_restores():
    quant = mo.QuantSpec("fp8", "channel")
    spec = mo.MoESpec(E, H, I, K, quant=quant)
    gen = torch.Generator().manual_seed(4)
    w13, s13 = quantize_fp8(torch.randn(E, 2 * I, H, generator=gen), quant)
    w2, s2 = quantize_fp8(torch.randn(E, H, I, generator=gen), quant)
    w13.view(torch.int8)[0, 0, 0] = -128  # a -0.0, which e4m3fnuz cannot hold
    tensors = params(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2)
    original = {k: v.detach().clone() for k, v in tensors.items()}
    ptr = tensors["w13"].data_ptr()
    layout = mo.Layout("test-fnuz", fp8_format="e4m3fnuz", shuffle=(16, 16))
    prepared = mo.PreparedExperts(spec, tensors, RelayoutBackend(layout))
    x, w, ids = _routed()
    expected = mo.PreparedExperts(spec, dict(original), mo.get_backend("torch")).apply(x, w, ids)
    prepared.prepare()
    assert tensors["w13"].dtype == torch.float8_e4m3fnuz and tensors["w13"].data_ptr() == ptr
    assert not torch.isnan(tensors["w13"].float()).any()
    torch.testing.assert_close(tensors["w13_scale"], original["w13_scale"] * 2)
    assert torch.equal(prepared.apply(x, w, ids), expected)
    prepared.restore()
    assert tensors["w13"].dtype == torch.float8_e4m3fn
    restored = tensors["w13"].view(torch.uint8).clone()
    assert restored[0, 0, 0] == 0  # -0 came back as +0: the one documented exception
    restored[0, 0, 0] = original["w13"].view(torch.uint8)[0, 0, 0]
    assert torch.equal(restored, original["w13"].view(torch.uint8))
    assert torch.equal(tensors["w2"].view(torch.uint8), original["w2"].view(torch.uint8))
    assert torch.equal(tensors["w13_scale"], original["w13_scale"])


def test_apply_on_mismatched_layout_names_both():
    spec = mo.MoESpec(E, H, I, K)
    prepared = mo.PreparedExperts(spec, _dense(), RelayoutBackend(SHUFFLED))
    x, w, ids = _routed()
    with pytest.raises(mo.LayoutMismatchError) as err:
        prepared.apply(x, w, ids)  # never prepared
    assert "test-shuffle" in str(err.value) and "name='canonical'" in str(err.value)


def test_reload_without_mark_is_refused_and_mark_reloaded_relays_out():
    spec = mo.MoESpec(E, H, I, K)
    tensors = _dense()
    fresh = {k: v.detach().clone() for k, v in tensors.items()}
    prepared = mo.PreparedExperts(spec, tensors, RelayoutBackend(SHUFFLED))
    prepared.prepare()
    x, w, ids = _routed()
    before = prepared.apply(x, w, ids)
    for k in tensors:  # a weight sync writes canonical data into the same storage
        tensors[k].data.copy_(fresh[k])
    prepared.mark_reloaded()
    with pytest.raises(mo.LayoutMismatchError):
        prepared.apply(x, w, ids)
    prepared.prepare()
    assert torch.equal(prepared.apply(x, w, ids), before)


def test_describe_is_a_plain_dict():
    spec = mo.MoESpec(E, H, I, K)
    prepared = mo.PreparedExperts(spec, _dense(), RelayoutBackend(SHUFFLED))
    prepared.prepare()
    info = prepared.describe()
    assert info["backend"] == "relayout" and info["layout"] == "test-shuffle/shuffle16x16"
    assert info["quantisation"] == "none" and info["prepared"] is True
    assert {"kernel", "reason", "tuned"} <= set(info)
