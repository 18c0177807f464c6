"""Which quant method the installed vLLM hands a deployment's MoE layers, and whether the overlay
maps it: what `config check` prints, before anything starts.

Upstream answers, as at start-up: its ModelConfig reads the checkpoint's config.json with the
deployment's `--quantization` (per-architecture rewrites included: Kimi-K3's compressed-tensors
mxfp4 becomes quant_method mxfp4), `VllmConfig.get_quantization_config` makes the quantisation
config (`--quantization fp8` on a bf16 checkpoint: online fp8), and one MoE layer built with it on
this machine by `FusedMoEFactory` gets its quant method. The quant-method table
(models/quant_methods.py) then maps it to the adapter or says why not. A checkpoint on the hub is
stood in for by the tiny twin with its architecture and quantization_config (STAND_INS); a local
checkpoint is read from its folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .builtin_models import ensure_builtin
from .config import ConfigError, Deployment

# hub checkpoint of a shipped config -> the twin with its architecture and quantization_config
STAND_INS = {
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "tiny-mixtral",
    "deepseek-ai/DeepSeek-V3": "tiny-deepseek-v3-fp8",
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct": "tiny-llama4-maverick",
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8": "tiny-llama4-maverick-fp8",
    "moonshotai/Kimi-K3": "tiny-kimi-k3",
}
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 256, 256, 2  # any layer: the method depends on the format


class NotBuiltHere(Exception):
    """The installed vLLM builds no MoE layer for the deployment on this machine: it picks the
    layer's experts kernel as it builds the quant method (vLLM 0.31's mxfp4), and none of its
    kernels for that format runs here (a CPU without AMX tiles, say)."""


@dataclass(frozen=True)
class MoEQuant:
    """Upstream's quant method for the deployment's MoE layers and the table's verdict."""

    method: str
    quant: str | None  # the adapter's quantisation when mapped
    why: str | None = None  # why not, when not mapped

    @property
    def mapped(self) -> bool:
        return self.quant is not None

    def __str__(self) -> str:
        return f"{self.method} -> {self.quant}" if self.mapped else f"{self.method}, not mapped: {self.why}"


def checkpoint_folder(deployment: Deployment) -> tuple[Path, str] | None:
    """The folder whose config.json stands for the deployment's checkpoint, and what it is."""
    if deployment.builtin:
        return ensure_builtin(deployment.builtin), deployment.builtin
    if deployment.model in STAND_INS:
        twin = STAND_INS[deployment.model]
        return ensure_builtin(twin), f"{deployment.model} as its twin {twin}"
    folder = Path(deployment.model)
    return (folder, str(folder)) if (folder / "config.json").is_file() else None


def _model_config(folder: Path, deployment: Deployment):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(folder), quantization=deployment.quantization, dtype=deployment.dtype,
                       trust_remote_code="--trust-remote-code" in deployment.extra_flags, skip_tokenizer_init=True)


def speculative_draft(folder: Path, deployment: Deployment) -> str:
    """The draft the installed vLLM builds for the deployment's speculative_config (its own
    SpeculativeConfig, as at start-up) and whether the overlay installs into its MoE layers."""
    from vllm.config import ParallelConfig
    from vllm.config.speculative import SpeculativeConfig

    from ..patches.plugin import ARCHITECTURES

    values = json.loads(deployment.speculative or "{}")
    target = _model_config(folder, deployment)
    if values.get("model") is None and not getattr(target.hf_text_config, "num_nextn_predict_layers", 0):
        if deployment.model in STAND_INS:  # the twin cannot tell whether the hub checkpoint has them
            return f"not checked: the twin {STAND_INS[deployment.model]} has no MTP layers to stand in for its draft"
        raise ConfigError(f"{deployment.source}: speculative_config.method: {values['method']} drafts with the "
                          f"checkpoint's MTP layers, and {folder} has none (num_nextn_predict_layers 0)")
    # Which draft is built does not depend on parallelism (checked against parallel.tensor when the file
    # is read), and a twin's few attention heads would not divide a real deployment's tensor size.
    values.pop("draft_tensor_parallel_size", None)
    draft = SpeculativeConfig(**values, target_model_config=target,
                              target_parallel_config=ParallelConfig()).draft_model_config
    architecture = draft.architectures[0]
    where = "the overlay's (MoE layers on the adapter)" if architecture in ARCHITECTURES else \
        "not the overlay's: any MoE layers it has stay stock and /v1/moe does not list them"
    return f"method {values['method']} drafts with {architecture}, {where}"


def moe_quant(folder: Path, deployment: Deployment) -> MoEQuant:
    """Build one MoE layer as the installed vLLM would for this checkpoint and deployment."""
    from vllm.config import LoadConfig, VllmConfig

    from ..models.quant_methods import NotMapped, mapper_for
    from ..models.standalone import build_moe, vllm_context
    from .vllm_args import vllm_version

    model_config = _model_config(folder, deployment)
    quant_config = VllmConfig.get_quantization_config(model_config, LoadConfig())
    with vllm_context():
        try:
            method = build_moe(num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                               intermediate_size=INTERMEDIATE, quant_config=quant_config).routed_experts.quant_method
        except NotImplementedError as err:  # upstream's kernel choice, made while the method is built
            raise NotBuiltHere(f"vLLM {vllm_version()}'s {type(quant_config).__name__} builds no MoE layer on this "
                               f"machine ({err}); the deployment's GPU picks its own kernel") from err
    name = type(method).__name__
    try:
        return MoEQuant(name, str(mapper_for(method).spec(method)))
    except NotMapped as why:
        return MoEQuant(name, None, str(why))
