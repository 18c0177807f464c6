"""The backend interface, the registry, and selection with a reason for every choice."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .errors import BackendUnavailableError
from .layout import Layout
from .spec import MoESpec


@dataclass(frozen=True)
class Platform:
    """Where a layer runs: `vendor` is cpu, nvidia or amd; `arch` e.g. gfx942 or sm_90."""

    device_type: str
    vendor: str
    arch: str | None = None

    @classmethod
    def of(cls, device: torch.device | str) -> Platform:
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device.type, "cpu" if device.type == "cpu" else device.type)
        props = torch.cuda.get_device_properties(device)
        if torch.version.hip is not None:
            return cls("cuda", "amd", props.gcnArchName.split(":")[0])
        return cls("cuda", "nvidia", f"sm_{props.major}{props.minor}")

    def __str__(self) -> str:
        return f"{self.vendor}:{self.arch}" if self.arch else self.vendor


class Backend(ABC):
    """A fused-experts implementation. Stateless: per-layer state lives in PreparedExperts."""

    name: str = ""
    priority: int = 0  # auto selection tries higher first: the fastest correct one wins

    @abstractmethod
    def unsupported_reason(self, spec: MoESpec, platform: Platform) -> str | None:
        """None when this backend can run `spec` on `platform`, else why not (one line)."""

    @abstractmethod
    def layout_for(self, spec: MoESpec, platform: Platform) -> Layout:
        """The physical layout this backend's kernel needs for `spec`."""

    @abstractmethod
    def kernel_name(self, spec: MoESpec) -> str:
        """The kernel (or op) that will run, for describe()."""

    @abstractmethod
    def run(
        self,
        spec: MoESpec,
        tensors: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None,
    ) -> torch.Tensor:
        """Fused experts on weights already in `layout_for(spec)`; returns `[M, H]` in x's dtype.
        `expert_map` is what `expert_map_for(spec)` built for this layer."""

    def check_weights(self, spec: MoESpec, tensors: Mapping[str, torch.Tensor], layout: Layout) -> None:
        """Refuse, naming the tensor and value (SpecError), canonical weights whose values this
        backend's kernels cannot run exactly in `layout` (its layout_for); prepare() asks
        before laying them out."""
        return None

    def expert_map_for(self, spec: MoESpec, device: torch.device | str) -> torch.Tensor | None:
        """The layer's expert map as run() takes it, built once per layer: by default global
        id -> local slot, -1 for experts on other ranks; None without expert parallelism."""
        return spec.expert_map_tensor(device)

    def is_tuned(self, spec: MoESpec, platform: Platform) -> bool | None:
        """Whether a tuned launch configuration exists for this shape (None: not applicable)."""
        return None


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    if not backend.name:
        raise ValueError(f"{type(backend).__name__} has no name")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BackendUnavailableError(
            f"no backend named {name!r}; known backends: {backend_names()}"
        ) from None


def backend_names() -> list[str]:
    return [b.name for b in sorted(_REGISTRY.values(), key=lambda b: -b.priority)]


@dataclass(frozen=True)
class Selection:
    backend: Backend
    reason: str
    rejected: dict[str, str] = field(default_factory=dict)


def select_backend(
    spec: MoESpec,
    platform: Platform,
    requested: str | Sequence[str] = "auto",
    strict: bool = False,
) -> Selection:
    """Pick a backend for a layer: the first of `requested` that fits, else (unless
    `strict`) the first that fits in auto order. Every backend passed over gets its reason."""
    wanted = [requested] if isinstance(requested, str) else list(requested)
    auto = wanted == ["auto"]
    order = backend_names() if auto else [get_backend(n).name for n in wanted]
    rejected: dict[str, str] = {}
    for name in order:
        why = _REGISTRY[name].unsupported_reason(spec, platform)
        if why is None:
            how = "first in auto order" if auto else f"requested ({', '.join(wanted)})"
            reason = f"{how} that supports this layer on {platform}"
            if auto and rejected:  # why the faster ones were passed over, e.g. AITER's missing kernel
                reason += f" (passed over: {'; '.join(f'{n}: {w}' for n, w in rejected.items())})"
            return Selection(_REGISTRY[name], reason, rejected)
        rejected[name] = why
    if strict or auto:
        detail = "; ".join(f"{n}: {w}" for n, w in rejected.items())
        raise BackendUnavailableError(
            f"no {'' if auto else 'requested '}backend can run this layer on {platform}: {detail}"
        )
    fallback = select_backend(spec, platform, "auto")
    reason = f"requested {', '.join(wanted)} cannot run it; fell back to the {fallback.reason}"
    return Selection(fallback.backend, reason, {**rejected, **fallback.rejected})
