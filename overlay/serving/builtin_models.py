"""Where the project keeps its state (models it builds, caches) and the embedded models."""

from __future__ import annotations

import os
from pathlib import Path

from ..models import twins  # noqa: F401  (registers every twin's recipe)
from ..models.tiny import RECIPES, build

STATE_ENV = "MOE_OVERLAY_VAR"
BUILTIN_NAMES = tuple(RECIPES)


def state_dir() -> Path:
    """`./var` under the current directory (git-ignored), or $MOE_OVERLAY_VAR."""
    return Path(os.environ.get(STATE_ENV, "var")).resolve()


def builtin_dir(name: str) -> Path:
    return state_dir() / "models" / name


def ensure_builtin(name: str) -> Path:
    """Build the embedded model on first use (a no-op when an identical build exists)."""
    return build(name, builtin_dir(name))
