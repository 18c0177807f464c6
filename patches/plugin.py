"""The vLLM general plugin: runs in every vLLM process (API server, engine core, workers).

Idempotent per process. `MOE_OVERLAY_DISABLE=1` leaves vLLM stock; vLLM's own
`VLLM_PLUGINS` allow-list decides whether this runs at all.
"""

from __future__ import annotations

import os
import sys

from . import ledger

DISABLE_ENV = "MOE_OVERLAY_DISABLE"
BACKEND_ENV = "MOE_OVERLAY_BACKEND"  # auto, or a backend name, for every overlay MoE layer
STRICT_ENV = "MOE_OVERLAY_STRICT"  # 1: a layer the requested backend cannot run is an error
RPC_METHOD = "moe_overlay_describe"  # the worker method that /v1/moe gathers through collective_rpc
# Architecture name -> the overlay class that replaces upstream's, imported lazily by vLLM.
ARCHITECTURES = {
    "MixtralForCausalLM": "moe_overlay.models.mixtral:OverlayMixtralForCausalLM",
    "DeepseekV3ForCausalLM": "moe_overlay.models.deepseek_v3:OverlayDeepseekV3ForCausalLM",
    "DeepSeekMTPModel": "moe_overlay.models.deepseek_v3:OverlayDeepSeekMTP",  # DeepSeek-V3's MTP draft
    "KimiK3ForConditionalGeneration": "moe_overlay.models.kimi_k3:OverlayKimiK3ForConditionalGeneration",
    "KimiLinearForCausalLM": "moe_overlay.models.kimi_k3:OverlayKimiLinearForCausalLM",
    "KimiK3MTPModel": "moe_overlay.models.kimi_k3:OverlayKimiK3MTP",  # Kimi-K3's MTP draft
    "Llama4ForCausalLM": "moe_overlay.models.llama4:OverlayLlama4ForCausalLM",
    "Llama4ForConditionalGeneration": "moe_overlay.models.llama4:OverlayLlama4ForConditionalGeneration",
}

_installed_in_pid: int | None = None


def _say(message: str) -> None:
    print(f"[moe-overlay] pid {os.getpid()}: {message}", file=sys.stderr, flush=True)


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "0") == "1"


def register() -> None:
    """Entry point of the `vllm.general_plugins` group."""
    global _installed_in_pid
    if _installed_in_pid == os.getpid():
        return
    _installed_in_pid = os.getpid()
    if disabled():
        _say(f"disabled by {DISABLE_ENV}=1: vLLM runs stock")
        return
    ledger.check()
    _install()
    backend = os.environ.get(BACKEND_ENV, "auto")
    _say(f"plugin active (backend {backend}; architectures {', '.join(ARCHITECTURES)})")


def _install() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
    from vllm.v1.worker.worker_base import WorkerBase

    from ..models.moe_layer import OverlayRoutedExperts, describe_rows

    current = op_registry_oot.get("RoutedExperts")
    if current is None:
        PluggableLayer.register_oot(OverlayRoutedExperts, name="RoutedExperts")
    elif current is not OverlayRoutedExperts:
        raise ledger.ContractDriftError(
            f"another plugin already replaced vLLM's RoutedExperts with {current.__module__}.{current.__name__}; "
            "moe-overlay cannot install its adapter beside it"
        )
    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)

    def moe_overlay_describe(self) -> list[dict]:
        return describe_rows()

    setattr(WorkerBase, RPC_METHOD, moe_overlay_describe)
