"""Triton's driver for a GPU that is not here, so that the real launcher compiles kernels for
it on a machine without one (amd_report.py, and the compile tests)."""

from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


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
