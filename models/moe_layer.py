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
from vllm.platforms import current_platform

import moe_overlay as mo

from ..patches import ledger
from ..patches.plugin import BACKEND_ENV, STRICT_ENV
from .describe_table import format_table
from .quant_methods import NotMapped, canonical_tensors, mapper_for
from .vllm_backend import VllmBackend, upstream_kernel_name

# Upstream's mark of a layer whose online-quantised weights were processed (its online methods set it,
# vLLM's layerwise loader deletes it before processing a layer again).
ONLINE_PROCESSED = "_already_called_process_weights_after_loading"

__all__ = ["NotMapped", "OverlayMoEMethod", "OverlayRoutedExperts", "adapter_scope", "spec_from_layer"]


@dataclass
class LayerRecord:
    name: str
    scope: Scope = field(repr=False, compare=False)
    routing: dict[str, Any] = field(default_factory=dict)  # upstream's, as it stays: not the adapter's
    describe: Callable[[], dict[str, Any]] = dict
    ready: bool = False

    def mark_ready(self) -> None:
        self.scope.layer_ready(self)


@dataclass
class Scope:
    architecture: str
    layers: list[LayerRecord] = field(default_factory=list)

    def add(self, name: str, routing: dict[str, Any]) -> LayerRecord:
        record = LayerRecord(name, self, routing)
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
    ledger.check_architecture(base)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        with adapter_scope(base.__name__):
            base.__init__(self, vllm_config=vllm_config, prefix=prefix)

    name = f"Overlay{base.__name__}"
    return type(name, (base,), {"__init__": __init__, "__module__": module, "__qualname__": name})


def _row(record: LayerRecord) -> dict[str, Any]:
    """`model`: the upstream class that built the layer (a speculative draft is its own model)."""
    return {"layer": record.name, "model": record.scope.architecture, **record.routing, **record.describe()}


def _routing(layer: RoutedExperts) -> dict[str, Any]:
    """What the adapter is handed of upstream's routing (its router and runner stay upstream's;
    their RoutingMethodType label is not reported: vLLM's CPURouter says Default for Llama-4)."""
    return {"top_k": layer.moe_config.experts_per_token, "weight_on_input": bool(layer.apply_router_weight_on_input)}


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
        # linear_beta None: upstream leaves `up` unclipped (SituAndMul), and so does the adapter
        return mo.Activation.situ(moe_config.activation_situ_beta, moe_config.activation_situ_linear_beta)
    raise NotMapped(f"activation {act.value!r} is not mapped to the adapter yet")


def spec_from_layer(layer: RoutedExperts, upstream: FusedMoEMethodBase) -> mo.MoESpec:
    """The adapter's description of the layer; NotMapped names what it does not model."""
    mapper = mapper_for(upstream)
    try:
        quant = mapper.spec(upstream)
    except NotMapped as why:
        raise NotMapped(f"{mapper.format}: {why}") from None
    cfg = layer.moe_config
    fused = layer.expert_map_manager.num_fused_shared_experts
    if fused:
        raise NotMapped(f"AITER's fused shared experts (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS): {fused} shared "
                        f"expert(s) run as routed experts {cfg.num_experts}..{cfg.num_experts + fused - 1}, which the "
                        "adapter does not model")
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
        quant=quant,
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
    try:
        return spec, mo.select_backend(spec, _platform(), requested, strict)
    except mo.BackendUnavailableError as why:
        raise mo.BackendUnavailableError(f"{name}: {why}") from None  # which layer cannot run


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _owned_by_the_adapter(layer) -> None:
    raise RuntimeError(
        "moe-overlay: upstream's process_weights_after_loading must not run on a layer whose experts the "
        "adapter owns (it would re-lay-out or requantise the weights the adapter prepared)"
    )


class OverlayMoEMethod(FusedMoEMethodBase):
    """The layer's quant method when an adapter backend runs it: upstream's method still
    creates the weights and its loader fills them (the checkpoint's format); the quant-method
    table maps them to the adapter's canonical tensors, which the adapter prepares and runs.

    Shared experts and routed scaling stay upstream's: this method has no modular kernel, so
    `mk_can_overlap_shared_experts` is False and the MoE runner runs the shared experts itself and
    adds their output; the router (or the runner) applies routed_scaling_factor. `apply` gets
    the routed tokens and weights as upstream computed them and returns the routed experts' sum
    only (see tests/test_shared_experts.py)."""

    def __init__(self, upstream: FusedMoEMethodBase, spec: mo.MoESpec, selection: mo.Selection,
                 record: LayerRecord) -> None:
        super().__init__(upstream.moe)
        self.upstream = upstream
        self.spec = spec
        self.selection = selection
        self.record = record
        self.prepared: mo.PreparedExperts | None = None
        # Upstream's post-processing (re-layout, requantisation, renaming *_packed) must never
        # touch the weights the adapter owns; fail loudly should anything call it.
        upstream.process_weights_after_loading = _owned_by_the_adapter  # type: ignore[method-assign]

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        return False  # the runner runs the shared experts; apply never calls them

    @property
    def uses_meta_device(self) -> bool:  # type: ignore[override]
        """Online quantisation: upstream's method creates the bf16 weights on the meta device and
        vLLM's layerwise loader processes the layer once its weights are in; the model loader reads
        this to finish such layers, and to accept scales that no checkpoint carries."""
        return self.upstream.uses_meta_device

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        self.upstream.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                                     params_dtype, **extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer):
        if self.spec.quant.weights != "none":
            # Upstream's config describes its own kernel's view of post-processed weights (merged
            # per-tensor scales, static input scales, backend-specific forms); built from the raw
            # checkpoint tensors it can assert or mislead, and nothing of the adapter reads it.
            return None
        return self.upstream.get_fused_moe_quant_config(layer)

    def process_weights_after_loading(self, layer) -> None:
        if self.uses_meta_device and getattr(layer, ONLINE_PROCESSED, False):
            return  # the layerwise loader processed it (it clears the flag first): the model loader's pass
        # Views of upstream's parameters (weights and scales) in canonical form, never copies.
        tensors = canonical_tensors(self.upstream, layer, self.spec)
        if self.prepared is None:
            self.prepared = mo.PreparedExperts(self.spec, tensors, self.selection)
        elif _storage(tensors["w13"]) != _storage(self.prepared.tensors["w13"]):
            # vLLM's layerwise reload: the new weights are in tensors built for the reload, which
            # vLLM copies into the layer's own parameters right after this. The adapter stays on
            # its own tensors (the layer's, and a merged per-tensor scale of its own): they take
            # the new values here and are laid out below; the reload's are laid out for the copy.
            self.prepared.restore()
            for name, tensor in tensors.items():
                self.prepared.tensors[name].copy_(tensor)
            mo.PreparedExperts(self.spec, tensors, self.selection).prepare()
            self.prepared.mark_reloaded()
        else:
            # The loader restored before writing: all canonical now. Views are taken afresh
            # (a per-tensor fp8 reload merges the w1/w3 scales again).
            self.prepared.tensors.update(tensors)
            self.prepared.mark_reloaded()
        self.prepared.prepare()
        if self.uses_meta_device:
            setattr(layer, ONLINE_PROCESSED, True)
        self.record.mark_ready()

    def restore_before_write(self) -> None:
        if self.prepared is not None:
            self.prepared.restore()

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        # shared_experts / shared_experts_input are handed over for kernels that overlap them
        # internally (MK_INTERNAL_OVERLAPPED); this one does not (mk_can_overlap_shared_experts is
        # False), so the runner has already run them and adds their output: calling them here
        # would count them twice.
        assert self.prepared is not None, "process_weights_after_loading has not run"
        return self.prepared.apply(x, topk_weights.to(torch.float32), topk_ids.to(torch.int32))

    def describe(self) -> dict[str, Any]:
        checkpoint = mapper_for(self.upstream).format
        if self.prepared is None:
            return {"backend": self.selection.backend.name, "reason": self.selection.reason,
                    "quantisation": str(self.spec.quant), "checkpoint": checkpoint,
                    "rejected": dict(self.selection.rejected), "prepared": False}
        return {**self.prepared.describe(), "checkpoint": checkpoint}


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
        record = scope.add(prefix, _routing(self))
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
        # update never mixes layouts and the next prepare() never shuffles twice. Not for a meta
        # parameter: vLLM's layerwise reload calls the loader on one only to count the elements
        # it copies, and would count the restore's copies too and finish the layer too early.
        if isinstance(self.quant_method, OverlayMoEMethod) and not param.is_meta:
            self.quant_method.restore_before_write()
        return super().weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success)


OverlayRoutedExperts.weight_loader.supports_moe_loading = True  # type: ignore[attr-defined]
