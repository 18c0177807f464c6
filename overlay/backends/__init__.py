"""Backends register themselves on import; importing this package registers all of them."""

from . import reference  # noqa: F401
