"""Upstream's own MoE layer outside an engine: a current VllmConfig, a world of one rank (gloo),
and `FusedMoEFactory` (router, RoutedExperts, MoERunner) as a model calls it. `config check` builds
one to learn which quant method the installed vLLM hands a deployment's MoE layers; the tests build
them to check the adapter against upstream's layers."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.distributed.parallel_state import model_parallel_is_initialized
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

_CONFIG: VllmConfig | None = None
_COUNT = [0]


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


def build_moe(**kwargs: Any) -> Any:
    """FusedMoEFactory with a fresh layer name (upstream refuses duplicates in one config); inside
    `vllm_context()`."""
    _COUNT[0] += 1
    kwargs.setdefault("prefix", f"model.layers.{_COUNT[0]}.mlp.experts")
    kwargs.setdefault("params_dtype", torch.bfloat16)
    return FusedMoEFactory(**kwargs)


def current_config() -> VllmConfig:
    assert _CONFIG is not None, "inside vllm_context() only"
    return _CONFIG
