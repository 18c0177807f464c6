"""Triton's driver for a GPU that is not here, so that the real launcher compiles kernels for
it on a machine without one (amd_report.py, the tuner's AMD check, and the compile tests)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver


class AbsentGpu(DriverBase):
    """Triton's driver for a GPU that is not here: the target to compile for and a device index
    of its own (Triton keeps compiled kernels per device index); nothing launches."""

    def __init__(self, target: GPUTarget, device: int) -> None:
        self.target = target
        self.device = device

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("nothing launches")

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self) -> None:
        raise NotImplementedError("nothing is timed")

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


_devices = itertools.count(3000)


def fresh_device() -> int:
    """A device index no GPU here has and no kernel was compiled under (Triton keeps compiled
    kernels per device index): what one compilation finds under it is its own."""
    return next(_devices)


@contextmanager
def absent_gpu(backend: str, arch: str, device: int) -> Iterator[None]:
    """Within it, Triton compiles for `arch` of `backend` ("hip", "cuda") under device index
    `device` (its kernels kept apart from others'), and launches compile only."""
    from .launch import compile_only

    driver.set_active(AbsentGpu(GPUTarget(backend, arch, 64 if backend == "hip" else 32), device))
    try:
        with compile_only():
            yield
    finally:
        driver.set_active(None)
