"""The AITER backend, run through the AITER emulator, against the torch reference backend."""

import pytest
import torch

import moe_overlay as mo
from moe_overlay.backends.aiter import kernels as aiter_kernels
from tests.aiter_emulator.layers import (
    FP8_TOKEN,
    PATH_CASES,
    emulated_backend,
    random_batch,
    random_layer,
    reference_output,
    relative_error,
)

CASES = [(c, arch) for c in PATH_CASES for arch in c.archs]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _without_negative_zero(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3fnuz has no -0: converting there and back gives +0, layout.py's one exception."""
    return bits.masked_fill(bits == 0x80, 0) if dtype == torch.float8_e4m3fn else bits


@pytest.mark.parametrize("case,arch", CASES, ids=[f"{c.name}-{a}" for c, a in CASES])
def test_matches_torch_reference_and_restores_bit_exact(case, arch):
    backend, emulator = emulated_backend(arch, case.contract)
    tensors = random_layer(case.spec)
    original = {k: (v.dtype, v.shape, _bits(v)) for k, v in tensors.items()}
    batch = random_batch(case.spec)
    expected = reference_output(case.spec, tensors, batch)
    experts = mo.PreparedExperts(case.spec, tensors, backend)
    experts.prepare()
    assert experts.layout.shuffle is not None and experts.describe()["backend"] == "aiter"
    assert not torch.equal(_bits(tensors["w13"]), original["w13"][2])  # really laid out
    got = experts.apply(*batch)
    assert got.dtype == case.spec.dtype and got.shape == expected.shape
    assert relative_error(got, expected) < case.tolerance
    assert emulator.calls[-1][0] == "fused_moe"
    experts.restore()
    converted = experts.target.fp8_format is not None
    for k, (dtype, shape, bits) in original.items():
        assert (tensors[k].dtype, tensors[k].shape) == (dtype, shape)
        assert torch.equal(_bits(tensors[k]), _without_negative_zero(bits, dtype) if converted else bits)


def _uneven_batch(spec: mo.MoESpec, m: int = 13) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every other token 30x smaller than the rest and routed to the other half of the experts."""
    x, weights, _ = random_batch(spec, m)
    gen = torch.Generator().manual_seed(2)
    half = spec.num_experts // 2
    small = torch.arange(m) % 2 == 1
    ids = torch.stack([torch.randperm(half, generator=gen)[: spec.top_k] for _ in range(m)]) + half * small[:, None]
    return torch.where(small[:, None], x / 30, x), weights, ids.int()


@pytest.mark.parametrize("granularity,activations", [("channel", "fp8_token"), ("tensor", "fp8_tensor")])
def test_fnuz_checkpoint_on_gfx942_matches_closely(granularity, activations):
    """With an e4m3fnuz checkpoint nothing is converted and both sides quantise activations on
    the same grid, each scale over the same rows (per_Tensor: one over the batch, then one over
    every routed copy's stage-1 output, as the reference does): most fp8 errors cancel (the
    rest: AITER rounds stage 1 to bf16 first). On a batch whose tokens differ 30x in size, the
    small ones routed to other experts, a per-tensor scale per expert's rows puts the rows 6%
    off on average."""
    spec = mo.MoESpec(6, 256, 128, 2, quant=mo.QuantSpec("fp8", granularity, fp8_format="e4m3fnuz",
                                                          activations=activations))
    backend, _ = emulated_backend("gfx942", "installed")
    tensors = random_layer(spec)
    batch = _uneven_batch(spec)
    expected = reference_output(spec, tensors, batch).float()
    experts = mo.PreparedExperts(spec, tensors, backend)
    experts.prepare()
    assert experts.layout.fp8_format is None
    got = experts.apply(*batch).float()
    assert relative_error(got, expected) < 0.04
    assert ((got - expected).norm(dim=1) / expected.norm(dim=1)).mean() < 0.02


def test_is_shuffled_reaches_aiter_even_after_a_rewrap():
    """vLLM-style re-wrapping (nn.Parameter(t.data)) drops Python attributes such as AITER's
    `is_shuffled`; the backend sets it inside its op on exactly the tensors it hands over."""
    spec = PATH_CASES[0].spec
    backend, emulator = emulated_backend("gfx942")
    tensors = random_layer(spec)
    batch = random_batch(spec)
    experts = mo.PreparedExperts(spec, tensors, backend)
    experts.prepare()
    before = experts.apply(*batch)
    for name in ("w13", "w2"):
        tensors[name] = torch.nn.Parameter(tensors[name].data, requires_grad=False)
        assert not hasattr(tensors[name], "is_shuffled")
    assert torch.equal(experts.apply(*batch), before)
    handed = emulator.calls[-1][1]
    assert handed["w1"].is_shuffled is True and handed["w2"].is_shuffled is True
    assert handed["w1"] is not tensors["w13"] and handed["w1"].data_ptr() == tensors["w13"].data_ptr()
    assert not hasattr(tensors["w13"], "is_shuffled")  # the model's own tensors are left alone


def test_without_the_flag_aiter_reads_garbage():
    """The emulator is sensitive to the flag, as AITER is: the same shuffled bytes without
    `is_shuffled` go down the plain-layout path and come out wrong."""
    spec = PATH_CASES[0].spec
    backend, emulator = emulated_backend("gfx950")
    tensors = random_layer(spec)
    batch = random_batch(spec)
    expected = reference_output(spec, tensors, batch)
    experts = mo.PreparedExperts(spec, tensors, backend)
    experts.prepare()
    experts.apply(*batch)
    kwargs = dict(emulator.calls[-1][1])
    assert relative_error(emulator.call("fused_moe", **kwargs), expected) < 0.02
    kwargs["w1"], kwargs["w2"] = tensors["w13"].detach(), tensors["w2"].detach()
    assert relative_error(emulator.call("fused_moe", **kwargs), expected) > 0.5


def test_e4m3fn_weights_are_refused_by_gfx942():
    spec = mo.MoESpec(6, 256, 128, 2, quant=FP8_TOKEN)
    backend, emulator = emulated_backend("gfx950")
    experts = mo.PreparedExperts(spec, random_layer(spec), backend)
    experts.prepare()
    batch = random_batch(spec)
    experts.apply(*batch)
    gfx942 = emulated_backend("gfx942")[1]
    with pytest.raises(RuntimeError, match=r"computes fp8 in torch\.float8_e4m3fnuz"):
        gfx942.call("fused_moe", **emulator.calls[-1][1])


@pytest.mark.parametrize("on_input", [False, True])
def test_expert_parallel_matches_reference(on_input):
    expert_map = (-1, 0, -1, 1, 2, -1, -1, 3, -1, -1)  # this rank: global 1, 3, 4, 7
    spec = mo.MoESpec(10, 256, 128, 1 if on_input else 3, apply_router_weight_on_input=on_input,
                      expert_map=expert_map, quant=FP8_TOKEN)
    backend, emulator = emulated_backend("gfx950")
    tensors = random_layer(spec)
    batch = random_batch(spec, m=17)
    expected = reference_output(spec, tensors, batch)
    experts = mo.PreparedExperts(spec, tensors, backend)
    experts.prepare()
    got = experts.apply(*batch)
    assert expected.float().abs().sum() > 0 and relative_error(got, expected) < 0.05
    assert emulator.calls[-1][1]["expert_mask"].tolist() == [int(v >= 0) for v in expert_map]
    remote = torch.full_like(batch[2], 2)
    assert torch.count_nonzero(experts.apply(batch[0], batch[1], remote)) == 0


def test_intermediate_size_is_padded_for_the_shuffle():
    spec = mo.MoESpec(4, 256, 40, 2)
    backend, _ = emulated_backend("gfx942")
    tensors = random_layer(spec)
    original = {k: v.detach().clone() for k, v in tensors.items()}
    batch = random_batch(spec)
    expected = reference_output(spec, tensors, batch)
    experts = mo.PreparedExperts(spec, tensors, backend)
    experts.prepare()
    assert experts.layout.padded_intermediate == 64 and tensors["w2"].shape == (4, 256, 64)
    assert relative_error(experts.apply(*batch), expected) < 0.02
    experts.restore()
    assert all(torch.equal(tensors[k], v) for k, v in original.items())


class TinyMoE(torch.nn.Module):
    def __init__(self, spec, backend):
        super().__init__()
        self.params = torch.nn.ParameterDict(random_layer(spec))
        self.experts = mo.PreparedExperts(spec, dict(self.params), backend)
        self.experts.prepare()
        self.gate = torch.nn.Linear(spec.hidden_size, spec.num_experts, bias=False, dtype=spec.dtype)
        self.top_k = spec.top_k
        self.ops_key = backend.ops_key

    def forward(self, x):
        weights, ids = aiter_kernels.softmax_topk(self.gate(x), self.top_k, ops_key=self.ops_key)
        return x + self.experts.apply(x, weights, ids)


def test_fullgraph_compile_runs_aiter_ops_with_the_flag():
    torch._dynamo.reset()
    spec = mo.MoESpec(6, 256, 128, 2, quant=FP8_TOKEN)
    backend, emulator = emulated_backend("gfx942")
    module = TinyMoE(spec, backend)
    x = torch.randn(7, 256).bfloat16()
    with torch.inference_mode():
        eager = module(x)
        compiled = torch.compile(module, fullgraph=True)
        emulator.calls.clear()
        torch.testing.assert_close(compiled(x), eager)
    assert [c[0] for c in emulator.calls] == ["topk_softmax", "fused_moe"]  # the real ops ran, in the graph
    assert emulator.calls[1][1]["w1"].is_shuffled is True


def test_fused_moe_op_passes_opcheck():
    # bf16: opcheck's schema test compares inputs with allclose, which fp8 tensors lack on CPU
    spec = mo.MoESpec(4, 256, 128, 2, mo.Activation.gelu())
    backend, _ = emulated_backend("gfx950")
    tensors = random_layer(spec)
    experts = mo.PreparedExperts(spec, tensors, backend)
    experts.prepare()
    x, w, ids = random_batch(spec, m=5)
    plan = backend.plan(spec)
    args = (x, tensors["w13"].detach(), tensors["w2"].detach(), w, ids, None, None, None, plan.path.quant_type,
            plan.activation, False, [], backend.ops_key)
    torch.library.opcheck(torch.ops.moe_overlay.aiter_fused_moe.default, args)


def test_routing_ops_agree_with_the_adapters_routers():
    from moe_overlay.routing import grouped_topk, softmax_topk

    _, emulator = emulated_backend("gfx942")
    key = emulator.key
    logits = torch.randn(33, 64, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 0.1

    def by_id(weights, ids):
        order = ids.long().argsort(dim=-1)
        return weights.gather(1, order), ids.long().gather(1, order)

    for got, want in (
        (aiter_kernels.softmax_topk(logits, 4, ops_key=key), softmax_topk(logits, 4)),
        (aiter_kernels.biased_grouped_topk(logits, 6, 8, 3, bias, routed_scaling_factor=2.5, ops_key=key),
         grouped_topk(logits, 6, 8, 3, correction_bias=bias, routed_scaling_factor=2.5)),
    ):
        assert got[0].dtype == torch.float32 and got[1].dtype == torch.int32
        (gw, gi), (ww, wi) = by_id(*got), by_id(*want)
        assert torch.equal(gi, wi)
        torch.testing.assert_close(gw, ww)
    with pytest.raises(mo.MoEInputError, match="correction bias must have shape"):
        aiter_kernels.biased_grouped_topk(logits, 6, 8, 3, bias[:5], ops_key=key)
