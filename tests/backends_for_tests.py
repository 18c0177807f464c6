"""Test-only backends: they need non-canonical layouts, and compute by undoing them."""

from __future__ import annotations

import torch

import moe_overlay as mo
from moe_overlay.backends.reference import ReferenceBackend
from moe_overlay.layout import to_canonical


class RelayoutBackend(ReferenceBackend):
    """Runs the reference on weights it first lays back out to canonical."""

    def __init__(self, layout: mo.Layout, name: str = "relayout", why_not: str | None = None, priority=1):
        self.layout = layout
        self.name = name
        self.why_not = why_not
        self.priority = priority

    def unsupported_reason(self, spec, platform):
        return self.why_not

    def layout_for(self, spec, platform):
        return self.layout

    def run(self, spec, tensors, x, topk_weights, topk_ids, expert_map):
        canonical = to_canonical({k: v.detach() for k, v in tensors.items()}, spec, self.layout)
        return super().run(spec, canonical, x, topk_weights, topk_ids, expert_map)


def params(**tensors: torch.Tensor) -> dict[str, torch.nn.Parameter]:
    return {k: torch.nn.Parameter(v, requires_grad=False) for k, v in tensors.items()}
