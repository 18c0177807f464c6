"""torch.compile(fullgraph=True) treats the reference backend's custom op as one opaque op."""

import torch

import moe_overlay as mo
from moe_overlay.routing import grouped_topk


class TinyMoE(torch.nn.Module):
    def __init__(self, spec: mo.MoESpec):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.gate = torch.nn.Linear(h, e, bias=False)
        self.w13 = torch.nn.Parameter(torch.randn(e, 2 * i, h, generator=gen) * 0.2, requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.randn(e, h, i, generator=gen) * 0.2, requires_grad=False)
        self.experts = mo.PreparedExperts(spec, {"w13": self.w13, "w2": self.w2}, mo.get_backend("torch"))
        self.experts.prepare()
        self.top_k = spec.top_k

    def forward(self, x):
        weights, ids = grouped_topk(self.gate(x), self.top_k, num_groups=2, topk_groups=1)
        return x + self.experts.apply(x, weights, ids)


def test_fullgraph_compile_matches_eager():
    torch._dynamo.reset()
    spec = mo.MoESpec(8, 32, 16, 2, mo.Activation.situ(), dtype=torch.float32)
    module = TinyMoE(spec)
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():  # as vLLM runs it
        eager = module(x)
        compiled = torch.compile(module, fullgraph=True)
        torch.testing.assert_close(compiled(x), eager)
        x2 = torch.randn(5, 32)
        torch.testing.assert_close(compiled(x2), module(x2))


def test_custom_op_has_a_fake_and_passes_opcheck():
    spec = mo.MoESpec(4, 32, 16, 2, dtype=torch.float32)
    module = TinyMoE(spec)
    x = torch.randn(6, 32)
    weights, ids = grouped_topk(module.gate(x).detach(), 2)
    q = spec.quant
    args = (x, module.w13.detach(), module.w2.detach(), weights, ids, None, None, None, None, None,
            "silu", [], False, q.weights, "", list(q.block), q.fp8_format, q.activations)
    torch.library.opcheck(torch.ops.moe_overlay.reference_experts.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake_x = torch.empty(6, 32)
        out = torch.ops.moe_overlay.reference_experts(
            fake_x, torch.empty(4, 32, 32), torch.empty(4, 32, 16), torch.empty(6, 2),
            torch.empty(6, 2, dtype=torch.int32), *args[5:])
        assert out.shape == (6, 32)
