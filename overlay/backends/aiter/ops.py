"""The only place that touches the `aiter` package: importing it (guarded, on first use),
and the handful of its functions the AITER backend calls.

Everything else talks to an `AiterOps`: the installed AITER on ROCm (`RocmAiter`), or, in
the tests, an emulator built from AITER's own reference code. Ops objects are bound under
a key, which the custom ops take as an argument, so a compiled graph stays bound to them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from types import ModuleType
from typing import Any, Protocol

import torch

from ...backend import Platform
from ...errors import BackendUnavailableError
from .capability import AiterFeatures

# Every AITER function the backend calls: name -> the module that defines it
# (tests parse `<module path>.py` in AITER's sources to check each call's keywords).
AITER_FUNCTIONS = {
    "fused_moe": "aiter.fused_moe",
    "topk_softmax": "aiter.ops.moe_op",
    "biased_grouped_topk": "aiter.ops.topk",
}
AITER_ENUMS = ("ActivationType", "QuantType")
AITER_DISTRIBUTION = "amd-aiter"


class AiterOps(Protocol):
    """AITER as the backend sees it."""

    key: str  # what the custom ops are told, to find these ops again
    arch: str  # the gfx arch its kernels run on
    features: AiterFeatures

    def call(self, function: str, **kwargs: Any) -> Any:
        """Call AITER function `function` (a key of AITER_FUNCTIONS), keywords only."""

    def enum(self, enum: str, member: str) -> Any:
        """An AITER enum member, e.g. enum("QuantType", "per_Token")."""

    def dtype(self, name: str) -> torch.dtype:
        """AITER's `dtypes.<name>`, e.g. fp4x2 or fp8_e8m0."""


def import_aiter() -> ModuleType:
    """`import aiter`, turning its failure into a reason. Without ROCm, AITER's import raises
    SystemExit or RuntimeError (it probes for hipcc and the ROCm install), not ImportError."""
    try:
        return importlib.import_module("aiter")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit included, on purpose
        raise BackendUnavailableError(
            f"AITER cannot be imported here ({type(exc).__name__}: {exc}); it needs ROCm and the "
            f"{AITER_DISTRIBUTION} package"
        ) from exc


class RocmAiter:
    """The installed AITER, on the current ROCm device."""

    key = "rocm"

    def __init__(self) -> None:
        aiter = import_aiter()
        self._functions = {name: getattr(importlib.import_module(module), name)
                           for name, module in AITER_FUNCTIONS.items()}
        self._enums = {name: getattr(aiter, name) for name in AITER_ENUMS}
        self._dtypes = aiter.dtypes
        self.arch = Platform.of(torch.device("cuda")).arch or "unknown"
        fused_moe_module = importlib.import_module(AITER_FUNCTIONS["fused_moe"])
        flydsl = getattr(fused_moe_module, "is_flydsl_available", lambda: False)()
        self.features = AiterFeatures.of(
            _version(aiter),
            list(self._enums["ActivationType"].__members__),
            list(inspect.signature(self._functions["fused_moe"]).parameters),
            bool(flydsl),
        )

    def call(self, function: str, **kwargs: Any) -> Any:
        return self._functions[function](**kwargs)

    def enum(self, enum: str, member: str) -> Any:
        return getattr(self._enums[enum], member)

    def dtype(self, name: str) -> torch.dtype:
        return getattr(self._dtypes, name)


def _version(aiter: ModuleType) -> str:
    try:
        return importlib.metadata.version(AITER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # a source checkout
        return str(getattr(aiter, "__version__", "unknown"))


_BOUND: dict[str, AiterOps] = {}
_ROCM_FAILURE: list[BackendUnavailableError] = []  # why the installed AITER could not load, once known


def bind_ops(ops: AiterOps) -> str:
    """Make `ops` reachable from the custom ops under `ops.key`; returns the key."""
    _BOUND[ops.key] = ops
    return ops.key


def bound_ops(key: str) -> AiterOps:
    """The ops bound under `key`; the installed AITER is loaded on first use of its key
    (and a failure to load it is remembered: every layer asks)."""
    if key in _BOUND:
        return _BOUND[key]
    if key != RocmAiter.key:
        raise BackendUnavailableError(f"no AITER ops bound under {key!r}")
    if not _ROCM_FAILURE:
        try:
            return _BOUND.setdefault(key, RocmAiter())
        except BackendUnavailableError as exc:
            _ROCM_FAILURE.append(exc)
    raise _ROCM_FAILURE[0]
