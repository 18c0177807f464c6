"""Upstream's own MoE layers on CPU without an engine: a VllmConfig, a one-process gloo group,
and `FusedMoEFactory` (router, RoutedExperts, MoERunner) as a model would call it.

Weights go in through upstream's loader (`MoERunner.load_weights`) under checkpoint names
(`<expert>.gate_proj.weight`, `...weight_scale_inv`, `...weight_packed`), so the layer holds
exactly what a real checkpoint load would leave in it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.distributed.parallel_state import model_parallel_is_initialized
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

_CONFIG: VllmConfig | None = None


@contextlib.contextmanager
def vllm_context() -> Iterator[VllmConfig]:
    """A current VllmConfig and (once per process) a world of one rank, tensor parallel 1."""
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = VllmConfig()
    with set_current_vllm_config(_CONFIG):
        if not model_parallel_is_initialized():
            init = os.path.join(tempfile.mkdtemp(prefix="moe-overlay-dist-"), "init")
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"file://{init}", backend="gloo")
            initialize_model_parallel(1, 1)
        yield _CONFIG


_COUNT = [0]


def build_moe(**kwargs):
    """FusedMoEFactory with a fresh layer name (upstream refuses duplicates in one config)."""
    _COUNT[0] += 1
    kwargs.setdefault("prefix", f"model.layers.{_COUNT[0]}.mlp.experts")
    kwargs.setdefault("params_dtype", torch.bfloat16)
    return FusedMoEFactory(**kwargs)


def load(runner, checkpoint: dict[str, torch.Tensor]) -> set[str]:
    """Checkpoint tensors (names relative to the experts module) through upstream's loader,
    then the quant method's post-processing, as the model loader does."""
    loaded = set(runner.load_weights(checkpoint.items()))
    experts = runner.routed_experts
    experts.quant_method.process_weights_after_loading(experts)
    return loaded


def forward(runner, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    with set_forward_context(None, _CONFIG):
        return runner(x, router_logits)
