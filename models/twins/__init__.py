"""The tiny twins, one module per architecture; importing this registers every recipe."""

from . import (
    deepseek_v3,  # noqa: F401
    kimi_k3,  # noqa: F401
    llama4,  # noqa: F401
    mixtral,  # noqa: F401
)
