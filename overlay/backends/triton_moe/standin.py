"""Target mode's hold on the stand-in GPU's occupancy (target.UNIT_ENV): each kernel is held to
as many programs an SM as the AMD target's compute unit would hold of it.

A gfx942 CU has 64 KiB of LDS, the most one program may take: a program of 40 KiB runs alone
there, where an H100 or H200 SM (228 KiB of shared memory) holds five of its stand-in, and
their warps hide each other's waits as gfx942's one wave a SIMD cannot. The hold asks the
CUDA driver, through the kernel's preferred shared-memory carveout, for no more shared memory
an SM than that many programs of the stand-in's own kernel take, each with the driver's
reserved share; the driver rounds up to a carveout it has, so an SM may hold a few more
programs than the target's CU, never fewer (and one, where the target's CU could hold
none). A program's LDS on the target is the kernel's own, compiled for the target by
Triton's AMD backend (no AMD GPU needed): tile sums miss what the compiler adds (gfx950's
padded rows, gfx942's register-staged operands, a decoded tile's layout change). A kernel is
held from its second launch on (its first loads it); the benchmark and the tuner warm up
before they time.
"""

from __future__ import annotations

import ctypes
from functools import cache

from ...quant import native_fp8_format
from .target import Target, current_target

CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: percent of an SM's shared memory
SM_SHARED = 81  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
RESERVED_A_PROGRAM = 111  # CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK

_held: dict[int, tuple[int, int]] = {}  # loaded kernel (CUfunction) -> (programs an SM, carveout %); 0s: not held


def carveout_percent(programs: int, program_bytes: int, reserved_bytes: int, sm_bytes: int) -> int:
    """The carveout (percent of `sm_bytes`, rounded up) that holds `programs` programs of
    `program_bytes` shared memory and `reserved_bytes` the driver keeps for each."""
    needed = programs * (program_bytes + reserved_bytes)
    return min(max(-(-100 * needed // sm_bytes), 1), 100)


def hold(compiled: object, amd_options: dict[str, int]) -> None:
    """Hold `compiled` (a launched Triton kernel, which the target compiles with `amd_options`) to the
    programs an SM that the target's compute unit holds of it, where target mode asks
    (target.Target.unit_programs). Once a kernel."""
    function = getattr(compiled, "function", None)  # (the CPU interpreter returns no kernel)
    if not function or function in _held:
        return
    target = current_target()
    programs = percent = 0
    if target.unit_programs:
        programs = target.programs_a_unit(target_lds(compiled, amd_options, target), compiled.metadata.num_warps)
        sm_bytes, reserved = _sm_shared(_device_index())
        percent = carveout_percent(programs, compiled.metadata.shared, reserved, sm_bytes)
        _check(_cuda().cuFuncSetAttribute(ctypes.c_void_p(function), CARVEOUT, percent), "cuFuncSetAttribute")
    _held[function] = programs, percent


def prepare(compiled: object, amd_options: dict[str, int]) -> None:
    """Where target mode holds kernels, compile `compiled` (a kernel compiled, not launched: the
    tuner's compile workers) for the target too, into Triton's cache, so that holding it when
    it runs finds that compile done."""
    target = current_target()
    if target.unit_programs and compiled is not None:
        target_lds(compiled, amd_options, target)


def target_lds(compiled: object, amd_options: dict[str, int], target: Target) -> int:
    """The LDS a program of `compiled` (a kernel the stand-in compiled) takes on AMD `target`:
    its source compiled again by Triton's AMD backend for the target, with `amd_options` and the
    fp8 type the target's own launch has (gfx942: e4m3fnuz, where the stand-in runs e4m3fn)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    src = compiled.src
    fnuz = native_fp8_format(target.arch) == "e4m3fnuz"

    def own(value: object) -> object:
        if fnuz and isinstance(value, str):
            return value.replace("fp8e4nv", "fp8e4b8")
        return tl.float8e4b8 if fnuz and isinstance(value, tl.dtype) and value == tl.float8e4nv else value

    again = type(src)(src.fn, {k: own(v) for k, v in src.signature.items()},
                      {k: own(v) for k, v in src.constants.items()}, src.attrs)
    metadata = compiled.metadata
    options = {"num_warps": metadata.num_warps, "num_stages": metadata.num_stages, **amd_options}
    try:
        return triton.compile(again, target=GPUTarget("hip", target.arch, target.warp_size), options=options
                              ).metadata.shared
    except Exception as err:
        raise RuntimeError(f"{metadata.name} does not compile for {target.arch} ({type(err).__name__}), so the "
                           "stand-in cannot hold it to the programs the target's compute unit holds") from err


@cache
def _cuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _device_index() -> int:
    import torch

    return torch.cuda.current_device()


@cache
def _sm_shared(index: int) -> tuple[int, int]:
    """(shared memory an SM, reserved a program) of CUDA device `index`, in bytes."""
    device = ctypes.c_int()
    _check(_cuda().cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")

    def attribute(which: int) -> int:
        value = ctypes.c_int()
        _check(_cuda().cuDeviceGetAttribute(ctypes.byref(value), which, device), "cuDeviceGetAttribute")
        return value.value

    return attribute(SM_SHARED), attribute(RESERVED_A_PROGRAM)


def _check(result: int, call: str) -> None:
    if result:
        raise RuntimeError(f"{call} failed (CUDA error {result}) holding a kernel to a target's programs an SM")
