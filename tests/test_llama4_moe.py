"""Llama-4 Maverick's MoE block at module level, from the tiny twins' checkpoints.

The whole text model is built by upstream's `Llama4ForCausalLM` (overlay subclass or stock) from
the twin's config.json, its weights go through upstream's loader under the checkpoint's tensor
names and its post-processing runs, exactly as vLLM's model loader does; then upstream's
`Llama4MoE` block of each MoE layer (router, shared expert, runner) is called and compared with
the published maths written here from the checkpoint tensors: top-1 on the router logits, weight
= sigmoid(logit) multiplied into the expert's INPUT, SiLU-gated expert, plus the shared expert;
for the fp8 twin the weights are fp8 values times their per-channel scales and the activations
are quantised to fp8 per token before each projection (what w8a8 with dynamic per-token
activations computes). The same maths with the shared expert dropped or doubled, or with the
weight applied to the output, is checked to be far outside the tolerance.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="these tests build upstream's Llama-4 layers")
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.llama4 import Llama4ForCausalLM, Llama4MoE
from vllm.utils.torch_utils import set_default_torch_dtype

from moe_overlay.models import moe_layer
from moe_overlay.models.llama4 import OverlayLlama4ForCausalLM
from moe_overlay.models.moe_layer import OverlayMoEMethod, OverlayRoutedExperts
from moe_overlay.models.tiny import RECIPES
from moe_overlay.models.twins.llama4 import FP8_MAX, TinyLlama4Recipe
from moe_overlay.serving.builtin_models import ensure_builtin
from tests.vllm_layers import vllm_context

TOKENS = 64
MOE_LAYERS = [1, 3]
# ||actual - expected|| / ||expected||: fp32 is rounding only; in bf16 the shared expert and the
# block's output round to bf16 (0.5% seen with the fp8 twin; a wrong variant is 16% or more off).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
WRONG_BY_AT_LEAST = 10  # every wrong variant misses by this many tolerances


@dataclass
class Built:
    model: torch.nn.Module
    config: VllmConfig
    checkpoint: dict[str, torch.Tensor]
    recipe: TinyLlama4Recipe
    dtype: torch.dtype


@contextlib.contextmanager
def _overlay(active: bool):
    """The plugin's RoutedExperts replacement (torch backend), only while building."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_layer, "SCOPES", [])
        mp.setenv("MOE_OVERLAY_BACKEND", "torch")
        mp.delenv("MOE_OVERLAY_STRICT", raising=False)
        if active:
            mp.setitem(op_registry_oot, "RoutedExperts", OverlayRoutedExperts)
        yield


def _build(name: str, dtype: torch.dtype, overlay: bool) -> Built:
    """What vLLM's DefaultModelLoader.load_model does, with the model class chosen here."""
    path: Path = ensure_builtin(name)
    model_config = ModelConfig(model=str(path), dtype=dtype, max_model_len=512, enforce_eager=True)
    config = VllmConfig(model_config=model_config)
    cls = OverlayLlama4ForCausalLM if overlay else Llama4ForCausalLM
    with vllm_context(), set_current_vllm_config(config), _overlay(overlay):
        with set_default_torch_dtype(dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=config, model_class=cls)
        get_model_loader(config.load_config).load_weights(model, model_config)
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    return Built(model.eval(), config, load_file(str(path / "model.safetensors")), RECIPES[name], dtype)


@pytest.fixture(scope="module")
def bf16_overlay() -> Built:
    return _build("tiny-llama4-maverick", torch.float32, overlay=True)


@pytest.fixture(scope="module")
def bf16_stock() -> Built:
    return _build("tiny-llama4-maverick", torch.float32, overlay=False)


@pytest.fixture(scope="module")
def fp8_overlay() -> Built:
    return _build("tiny-llama4-maverick-fp8", torch.bfloat16, overlay=True)


# -- the published maths ------------------------------------------------------------------------


def _fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token fp8 e4m3 quantisation, returned dequantised."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def _experts(built: Built, layer: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(gate [I, H], up [I, H], down [H, I]) of every routed expert, in fp32."""
    ck, ff, i = built.checkpoint, f"model.layers.{layer}.feed_forward.experts", built.recipe.intermediate_size
    if not built.recipe.fp8:
        gate_up, down = ck[f"{ff}.gate_up_proj"].float(), ck[f"{ff}.down_proj"].float()  # [E, in, out]
        return [(g[:, :i].T, g[:, i:].T, d.T) for g, d in zip(gate_up, down, strict=True)]

    def weight(e: int, proj: str) -> torch.Tensor:
        return ck[f"{ff}.{e}.{proj}.weight"].float() * ck[f"{ff}.{e}.{proj}.weight_scale"].float()

    return [tuple(weight(e, p) for p in ("gate_proj", "up_proj", "down_proj"))
            for e in range(built.recipe.num_local_experts)]


def _mlp(x, gate, up, down, quantise=lambda t: t):
    return quantise(F.silu(quantise(x) @ gate.T) * (quantise(x) @ up.T)) @ down.T


def expected(built: Built, layer: int, x: torch.Tensor, *, shared: float = 1.0,
             weight_on_input: bool = True) -> torch.Tensor:
    ck, ff = built.checkpoint, f"model.layers.{layer}.feed_forward"
    x = x.float()
    logits = x @ ck[f"{ff}.router.weight"].float().T
    top = logits.argmax(dim=-1)
    weight = torch.sigmoid(logits.gather(1, top[:, None]))
    quantise = _fp8_per_token if built.recipe.fp8 else (lambda t: t)
    experts = _experts(built, layer)
    routed = torch.zeros_like(x)
    for t in range(x.shape[0]):
        gate, up, down = experts[int(top[t])]
        if weight_on_input:
            routed[t] = _mlp(x[t:t + 1] * weight[t], gate, up, down, quantise)[0]
        else:
            routed[t] = weight[t] * _mlp(x[t:t + 1], gate, up, down, quantise)[0]
    se = f"{ff}.shared_expert"
    shared_out = _mlp(x, *(ck[f"{se}.{p}.weight"].float() for p in ("gate_proj", "up_proj", "down_proj")))
    return routed + shared * shared_out


def _block(built: Built, layer: int) -> Llama4MoE:
    block = built.model.model.layers[layer].feed_forward
    assert isinstance(block, Llama4MoE)
    return block


def _input(built: Built, layer: int) -> torch.Tensor:
    """Tokens whose top-1 choice is clear (so rounding cannot flip it) and that reach most experts."""
    gen = torch.Generator().manual_seed(layer)
    x = torch.randn(TOKENS, built.recipe.hidden_size, generator=gen).to(built.dtype)
    logits = x.float() @ built.checkpoint[f"model.layers.{layer}.feed_forward.router.weight"].float().T
    top2 = logits.topk(2, dim=-1).values
    x = x[(top2[:, 0] - top2[:, 1]) > 0.05]
    assert x.shape[0] >= TOKENS // 2 and len(set(logits.argmax(-1).tolist())) >= built.recipe.num_local_experts - 2
    return x


def _run(built: Built, layer: int, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), set_current_vllm_config(built.config), set_forward_context(None, built.config):
        return _block(built, layer)(x).float()


def _relative(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return float((actual - reference).norm() / reference.norm())


def _assert_published_maths(built: Built, layer: int) -> None:
    x = _input(built, layer)
    actual, tol = _run(built, layer, x), TOLERANCE[built.dtype]
    assert _relative(actual, expected(built, layer, x)) < tol
    wrong = {"shared expert dropped": expected(built, layer, x, shared=0.0),
             "shared expert doubled": expected(built, layer, x, shared=2.0),
             "weight on the output": expected(built, layer, x, weight_on_input=False)}
    for what, reference in wrong.items():
        assert _relative(actual, reference) > WRONG_BY_AT_LEAST * tol, what


# -- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", MOE_LAYERS)
def test_overlay_bf16_twin_computes_the_published_maths(bf16_overlay, layer):
    _assert_published_maths(bf16_overlay, layer)


@pytest.mark.parametrize("layer", MOE_LAYERS)
def test_stock_upstream_computes_the_same_maths(bf16_stock, layer):
    """The maths above is what upstream's own CPU kernel computes for this block."""
    _assert_published_maths(bf16_stock, layer)


@pytest.mark.parametrize("layer", MOE_LAYERS)
def test_overlay_fp8_twin_computes_the_published_maths(fp8_overlay, layer):
    _assert_published_maths(fp8_overlay, layer)


@pytest.mark.parametrize("fixture", ["bf16_overlay", "fp8_overlay"])
def test_the_adapter_runs_every_routed_experts_layer_and_nothing_else(fixture, request):
    built = request.getfixturevalue(fixture)
    on_adapter = {name: m.quant_method.spec for name, m in built.model.named_modules()
                  if isinstance(m, RoutedExperts) and isinstance(m.quant_method, OverlayMoEMethod)}
    assert sorted(on_adapter) == [f"model.layers.{i}.feed_forward.experts.routed_experts" for i in MOE_LAYERS]
    for spec in on_adapter.values():
        assert spec.top_k == 1 and spec.apply_router_weight_on_input and spec.activation.kind == "silu"
        assert spec.num_experts == built.recipe.num_local_experts
        assert str(spec.quant) == ("fp8 e4m3fn per-channel, activations fp8_token" if built.recipe.fp8 else "none")
    layers = built.model.model.layers
    assert all(isinstance(layers[i].feed_forward.shared_expert, LlamaMLP) for i in MOE_LAYERS)
    dense = [i for i in range(built.recipe.num_hidden_layers) if i not in MOE_LAYERS]
    assert all(isinstance(layers[i].feed_forward, LlamaMLP) for i in dense)


def test_stock_vllm_cpu_cannot_load_the_fp8_twin():
    """What the CPU lane does with the FP8 checkpoint's experts without the overlay: its fp8 MoE
    experts take 128x128 block weights only, so no backend is found and loading fails."""
    with pytest.raises(ValueError, match="Unsupported FP8 MoE backend: NONE"):
        _build("tiny-llama4-maverick-fp8", torch.bfloat16, overlay=False)
