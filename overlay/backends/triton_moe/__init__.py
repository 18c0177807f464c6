"""The portable Triton fused-MoE backend (registered as "triton"; triton itself is optional)."""

from . import backend  # noqa: F401  (registers the backend)
