"""The AITER backend (registered as "aiter"): capability (which AITER path a layer takes, and
why not), ops (the only module that imports the `aiter` package), kernels (the torch custom
ops that reach it), backend, and check (the self-check on an AMD GPU). AITER itself is optional."""

from . import backend  # noqa: F401  (registers the backend)
