"""Prepared experts: one layer's weights, the layout they are in, and the backend that runs them."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

from .backend import Backend, Platform, Selection
from .checks import check_canonical_weights, check_inputs
from .layout import CANONICAL, Layout, require_layout, to_canonical, to_layout
from .spec import MoESpec


def _write_in_place(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Make `dst` hold `src`. Reuses dst's storage when the byte count matches (the data
    pointer stays put, so captured graphs stay valid), otherwise rebinds `dst.data`."""
    src = src.contiguous()
    same_bytes = dst.numel() * dst.element_size() == src.numel() * src.element_size()
    if same_bytes and dst.is_contiguous() and dst.device == src.device:
        flat = dst.data.reshape(-1).view(torch.uint8)
        flat.copy_(src.reshape(-1).view(torch.uint8))
        dst.data = flat.view(src.dtype).view(src.shape)
    else:
        dst.data = src


class PreparedExperts:
    """Owns the layout of one layer's expert tensors.

    `tensors` maps names (w13, w2, w13_scale, ...) to the layer's own tensors or
    Parameters in canonical layout; they are kept by reference and re-laid-out in place.
    """

    def __init__(
        self,
        spec: MoESpec,
        tensors: MutableMapping[str, torch.Tensor],
        selection: Selection | Backend,
    ) -> None:
        check_canonical_weights(spec, tensors)
        if isinstance(selection, Backend):
            selection = Selection(selection, "given explicitly")
        self.spec = spec
        self.tensors = tensors
        self.selection = selection
        device = next(iter(tensors.values())).device
        self.platform = Platform.of(device)
        self.target = selection.backend.layout_for(spec, self.platform)
        self._layout: Layout = CANONICAL
        self._expert_map = self.backend.expert_map_for(spec, device)

    @property
    def backend(self) -> Backend:
        return self.selection.backend

    @property
    def layout(self) -> Layout:
        return self._layout

    def prepare(self) -> None:
        """Canonical -> the backend's layout, once; a second call does nothing (where the layout
        is canonical, the backend's check_weights runs again)."""
        if self._layout == CANONICAL:
            self.backend.check_weights(self.spec, self.tensors, self.target)
        if self._layout == self.target:
            return
        require_layout(self._layout, CANONICAL, "prepare()")
        self._rewrite(to_layout(dict(self.tensors), self.spec, self.target))
        self._layout = self.target

    def restore(self) -> None:
        """Back to canonical, bit for bit (e.g. before handing weights to a checkpoint writer)."""
        if self._layout == CANONICAL:
            return
        self._rewrite(to_canonical(dict(self.tensors), self.spec, self._layout))
        self._layout = CANONICAL

    def mark_reloaded(self) -> None:
        """The tensors were just overwritten with canonical data (weight reload, wake-up):
        record it so the next prepare() lays them out again instead of trusting stale state."""
        check_canonical_weights(self.spec, self.tensors)
        self._layout = CANONICAL

    def _rewrite(self, new: dict[str, torch.Tensor]) -> None:
        for name, value in new.items():
            _write_in_place(self.tensors[name], value)

    def apply(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Fused experts for routed tokens: `[M, H]` in, `[M, H]` out (same dtype)."""
        require_layout(self._layout, self.target, f"backend {self.backend.name!r}")
        check_inputs(self.spec, x, topk_weights, topk_ids, self.tensors["w13"].device)
        if x.shape[0] == 0:
            return x.new_empty(x.shape)
        return self.backend.run(self.spec, self.tensors, x, topk_weights, topk_ids, self._expert_map)

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "backend": self.backend.name,
            "kernel": self.backend.kernel_name(spec),
            "layout": str(self._layout),
            "target_layout": str(self.target),
            "prepared": self._layout == self.target,
            "quantisation": str(spec.quant),
            "activation": str(spec.activation),
            "experts": f"{spec.num_local_experts}/{spec.num_experts}",
            "top_k": spec.top_k,
            "shape": f"H={spec.hidden_size} I={spec.intermediate_size}",
            "reason": self.selection.reason,
            "rejected": dict(self.selection.rejected),
            "tuned": self.backend.is_tuned(spec, self.platform),
            "platform": str(self.platform),
        }
