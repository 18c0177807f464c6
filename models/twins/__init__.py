"""The tiny twins, one module per architecture; importing this registers every recipe."""

from . import mixtral  # noqa: F401
