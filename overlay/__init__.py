"""moe-overlay: a prepared-MoE adapter for upstream vLLM (this package imports torch only)."""

from . import backends  # noqa: F401  (registers the built-in backends)
from .backend import (
    Backend,
    Platform,
    Selection,
    backend_names,
    get_backend,
    register_backend,
    select_backend,
)
from .errors import BackendUnavailableError, LayoutMismatchError, MoEInputError, MoEOverlayError, SpecError
from .layout import CANONICAL, Layout
from .prepared import PreparedExperts
from .spec import Activation, MoESpec, QuantSpec

__all__ = [
    "CANONICAL",
    "Activation",
    "Backend",
    "BackendUnavailableError",
    "Layout",
    "LayoutMismatchError",
    "MoEInputError",
    "MoEOverlayError",
    "MoESpec",
    "Platform",
    "PreparedExperts",
    "QuantSpec",
    "Selection",
    "SpecError",
    "backend_names",
    "get_backend",
    "register_backend",
    "select_backend",
]
