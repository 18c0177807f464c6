"""Backends register themselves on import; importing this package registers all of them."""

from . import (
    aiter_backend,  # noqa: F401
    reference,  # noqa: F401
    triton_moe,  # noqa: F401  (the Triton backend; triton itself is optional)
)
