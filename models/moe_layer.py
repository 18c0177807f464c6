"""vLLM glue: the out-of-tree RoutedExperts that hands a layer's experts to the adapter.

Only layers built inside an overlay architecture (see `overlay_architecture`) change;
everywhere else the subclass is upstream's RoutedExperts unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.platforms import current_platform

import moe_overlay as mo

from ..patches.plugin import BACKEND_ENV, STRICT_ENV
from .describe_table import format_table
from .vllm_backend import VllmBackend, upstream_kernel_name


class NotMapped(Exception):
    """The layer uses something the adapter does not model yet (reason in the message)."""


@dataclass
class LayerRecord:
    name: str
    scope: Scope = field(repr=False, compare=False)
    describe: Callable[[], dict[str, Any]] = dict
    ready: bool = False

    def mark_ready(self) -> None:
        self.scope.layer_ready(self)


@dataclass
class Scope:
    architecture: str
    layers: list[LayerRecord] = field(default_factory=list)

    def add(self, name: str) -> LayerRecord:
        record = LayerRecord(name, self)
        self.layers.append(record)
        return record

    def layer_ready(self, record: LayerRecord) -> None:
        record.ready = True
        if all(r.ready for r in self.layers):
            print(format_table(self.architecture, [_row(r) for r in self.layers]), file=sys.stderr, flush=True)
            for r in self.layers:
                r.ready = False  # a weight reload prints the table again


_ACTIVE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("moe_overlay_scope", default=None)
SCOPES: list[Scope] = []  # every overlay model built in this process


@contextlib.contextmanager
def adapter_scope(architecture: str) -> Iterator[Scope]:
    scope = Scope(architecture)
    SCOPES.append(scope)
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)


def overlay_architecture(base: type, module: str) -> type:
    """`base` (an upstream model class) whose MoE layers use the adapter, defined in `module`."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        with adapter_scope(base.__name__):
            base.__init__(self, vllm_config=vllm_config, prefix=prefix)

    name = f"Overlay{base.__name__}"
    return type(name, (base,), {"__init__": __init__, "__module__": module, "__qualname__": name})


def _row(record: LayerRecord) -> dict[str, Any]:
    return {"layer": record.name, **record.describe()}


def describe_rows() -> list[dict[str, Any]]:
    """Every overlay MoE layer in this process, as plain dicts."""
    return [_row(r) for scope in SCOPES for r in scope.layers]


# -- from vLLM's layer to the adapter's description ----------------------------------------


def _activation(moe_config) -> mo.Activation:
    act = moe_config.activation
    if act == MoEActivation.SILU:
        return mo.Activation.silu()
    if act == MoEActivation.GELU:
        return mo.Activation.gelu()
    if act == MoEActivation.SITU and moe_config.activation_situ_beta is not None:
        linear = moe_config.activation_situ_linear_beta
        return mo.Activation.situ(moe_config.activation_situ_beta, linear if linear is not None else 25.0)
    raise NotMapped(f"activation {act.value!r} is not mapped to the adapter yet")


def spec_from_layer(layer: RoutedExperts, upstream: FusedMoEMethodBase) -> mo.MoESpec:
    if type(upstream) is not UnquantizedFusedMoEMethod:
        raise NotMapped(f"{type(upstream).__name__} checkpoints are not mapped to the adapter yet")
    cfg = layer.moe_config
    expert_map = getattr(layer, "_expert_map", None)
    return mo.MoESpec(
        num_experts=cfg.num_experts,
        hidden_size=cfg.hidden_dim,
        intermediate_size=cfg.intermediate_size_per_partition,
        top_k=cfg.experts_per_token,
        activation=_activation(cfg),
        apply_router_weight_on_input=bool(layer.apply_router_weight_on_input),
        expert_map=None if expert_map is None else tuple(int(v) for v in expert_map.tolist()),
        dtype=cfg.in_dtype,
        has_bias=bool(cfg.has_bias),
    )


def _platform() -> mo.Platform:
    return mo.Platform.of(torch.device(current_platform.device_type))


def _select(name: str, layer: RoutedExperts, upstream: FusedMoEMethodBase) -> tuple[mo.MoESpec | None, mo.Selection]:
    requested = os.environ.get(BACKEND_ENV, "auto") or "auto"
    strict = os.environ.get(STRICT_ENV, "0") == "1"
    try:
        spec = spec_from_layer(layer, upstream)
    except NotMapped as why:
        if strict and requested not in ("auto", VllmBackend.name):
            raise mo.BackendUnavailableError(f"{name}: {why}; strict mode refuses vLLM's kernel") from None
        return None, mo.Selection(mo.get_backend(VllmBackend.name), f"{why}: vLLM's own kernel runs it")
    return spec, mo.select_backend(spec, _platform(), requested, strict)


class OverlayMoEMethod(FusedMoEMethodBase):
    """The layer's quant method when an adapter backend runs it: upstream's method still
    creates the canonical weights; the adapter prepares them and runs the experts."""

    def __init__(self, upstream: FusedMoEMethodBase, spec: mo.MoESpec, selection: mo.Selection,
                 record: LayerRecord) -> None:
        super().__init__(upstream.moe)
        self.upstream = upstream
        self.spec = spec
        self.selection = selection
        self.record = record
        self.prepared: mo.PreparedExperts | None = None

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        self.upstream.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                                     params_dtype, **extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer):
        return self.upstream.get_fused_moe_quant_config(layer)

    def process_weights_after_loading(self, layer) -> None:
        if self.prepared is None:
            tensors = {"w13": layer.w13_weight, "w2": layer.w2_weight}
            if self.spec.has_bias:
                tensors.update(w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
            self.prepared = mo.PreparedExperts(self.spec, tensors, self.selection)
        else:
            self.prepared.mark_reloaded()  # the loader restored before writing: all canonical now
        self.prepared.prepare()
        self.record.mark_ready()

    def restore_before_write(self) -> None:
        if self.prepared is not None:
            self.prepared.restore()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        assert self.prepared is not None, "process_weights_after_loading has not run"
        return self.prepared.apply(x, topk_weights.to(torch.float32), topk_ids.to(torch.int32))

    def describe(self) -> dict[str, Any]:
        if self.prepared is None:
            return {"backend": self.selection.backend.name, "reason": self.selection.reason,
                    "rejected": dict(self.selection.rejected), "prepared": False}
        return self.prepared.describe()


def _describe_upstream(upstream: FusedMoEMethodBase, spec: mo.MoESpec | None, selection: mo.Selection):
    def describe() -> dict[str, Any]:
        return {
            "backend": VllmBackend.name,
            "kernel": upstream_kernel_name(upstream),
            "layout": "owned by vLLM",
            "quantisation": str(spec.quant) if spec else type(upstream).__name__,
            "reason": selection.reason,
            "rejected": dict(selection.rejected),
            "tuned": None,
            "platform": str(_platform()),
        }

    return describe


def _track_upstream(upstream: FusedMoEMethodBase, record: LayerRecord) -> None:
    """Mark the layer ready once upstream's own post-processing has run."""
    original = upstream.process_weights_after_loading

    def process_weights_after_loading(layer) -> None:
        original(layer)
        record.mark_ready()

    upstream.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]


class OverlayRoutedExperts(RoutedExperts):
    """Upstream's RoutedExperts; inside an overlay architecture its experts go to the adapter."""

    def _get_quant_method(self, prefix, quant_config, moe_config):
        upstream = super()._get_quant_method(prefix, quant_config, moe_config)
        scope = _ACTIVE.get()
        if scope is None:
            return upstream
        spec, selection = _select(prefix, self, upstream)
        record = scope.add(prefix)
        if spec is None or selection.backend.name == VllmBackend.name:
            # A/B and fallback: upstream's own method, untouched, so it runs exactly as stock.
            record.describe = _describe_upstream(upstream, spec, selection)
            _track_upstream(upstream, record)
            return upstream
        method = OverlayMoEMethod(upstream, spec, selection, record)
        record.describe = method.describe
        return method

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        # A reload writes canonical data: lay the whole layer back first, so a partial
        # update never mixes layouts and the next prepare() never shuffles twice.
        if isinstance(self.quant_method, OverlayMoEMethod):
            self.quant_method.restore_before_write()
        return super().weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success)


OverlayRoutedExperts.weight_loader.supports_moe_loading = True  # type: ignore[attr-defined]
