"""The AITER backend: AMD's fused-MoE kernels (MI300X/MI325X gfx942, MI350X/MI355X gfx950)
behind the adapter, so their weight layouts are prepared once and can never be mismatched.

Which AITER path runs, and why not when it cannot, comes from the table in `capability`;
the kernels are reached through the custom ops of `kernels`, which reach AITER through
`ops` (the installed AITER on ROCm, or whatever `AiterOps` this backend was given).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ...backend import Backend, Platform, register_backend
from ...errors import BackendUnavailableError
from ...layout import Layout
from ...spec import MoESpec
from . import kernels  # noqa: F401  (registers the custom ops)
from .capability import AiterPlan, aiter_plan
from .ops import AiterOps, RocmAiter, bind_ops, bound_ops


class AiterBackend(Backend):
    name = "aiter"
    priority = 100

    def __init__(self, ops: AiterOps | None = None, env: Mapping[str, str] | None = None) -> None:
        """`ops`: the AITER to drive, by default the installed one (loaded on first need);
        `env`: the environment that AITER reads its switches from, by default the process's."""
        self.ops_key = bind_ops(ops) if ops is not None else RocmAiter.key
        self.env = os.environ if env is None else env
        self._plans: dict[MoESpec, AiterPlan] = {}

    @property
    def ops(self) -> AiterOps:
        return bound_ops(self.ops_key)

    def plan(self, spec: MoESpec) -> AiterPlan:
        """How `spec` runs on this AITER; BackendUnavailableError says why it cannot."""
        if spec not in self._plans:
            ops = self.ops
            self._plans[spec] = aiter_plan(spec, ops.arch, ops.features, self.env)
        return self._plans[spec]

    def unsupported_reason(self, spec: MoESpec, platform: Platform) -> str | None:
        if platform.vendor != "amd":
            return f"needs ROCm (AMD GPU); this is {platform}"
        try:
            if platform.arch != self.ops.arch:
                return f"this AITER runs on {self.ops.arch}; this layer is on {platform.arch}"
            self.plan(spec)
        except BackendUnavailableError as why:
            return str(why)
        return None

    def layout_for(self, spec: MoESpec, platform: Platform) -> Layout:
        return self.plan(spec).layout

    def kernel_name(self, spec: MoESpec) -> str:
        return self.plan(spec).kernel

    def expert_map_for(self, spec: MoESpec, device: torch.device | str) -> torch.Tensor | None:
        # AITER takes the global ids and a 0/1 mask of the experts this rank holds.
        expert_map = spec.expert_map_tensor(device)
        return None if expert_map is None else (expert_map >= 0).to(torch.int32)

    def run(
        self,
        spec: MoESpec,
        tensors: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
    ) -> torch.Tensor:
        plan = self.plan(spec)
        return torch.ops.moe_overlay.aiter_fused_moe(
            x, tensors["w13"], tensors["w2"], topk_weights, topk_ids,
            tensors.get("w13_scale"), tensors.get("w2_scale"), expert_map,
            plan.path.quant_type, plan.activation, plan.doweight_stage1, list(plan.activation_values), self.ops_key,
        )


register_backend(AiterBackend())
