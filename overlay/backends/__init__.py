"""Backends register themselves on import; importing this package registers all of them."""

from . import reference  # noqa: F401
from . import triton_moe  # noqa: F401  (the Triton backend; triton itself is optional)
