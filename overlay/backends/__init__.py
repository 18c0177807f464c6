"""Backends register themselves on import; importing this package registers all of them."""

from . import (
    aiter,  # noqa: F401  (the AITER backend; amd-aiter itself is optional)
    reference,  # noqa: F401
    triton_moe,  # noqa: F401  (the Triton backend; triton itself is optional)
)
