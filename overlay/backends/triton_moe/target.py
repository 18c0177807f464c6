"""What the GPU the kernels compile for can do, decided here and nowhere else: the layout of
mxfp4 weights, which launch-table entries apply, how much shared memory (LDS) a program may
take, and whether the NVIDIA-only kernels (gluon_kernels.py) and launch features exist.

Targets are named by architecture: gfx942 (MI300X, MI325X), gfx950 (MI355X), sm_XY (NVIDIA).
Target mode: MOE_OVERLAY_TRITON_TARGET=gfx942 (or gfx950) on an NVIDIA GPU makes that GPU
stand in for the AMD target. The backend then runs exactly what the target would: its mxfp4
layout, its launch-table entries (or the untuned defaults), fitted to its LDS, and none of
NVIDIA's features. What a stand-in cannot reproduce, the target's timings do not show: the
AMD compiler and its matrix instructions, a wave of 64 lanes (4 warps are 256 threads
there, 128 here), gfx950's fp4 conversion instructions (tl.dot_scaled's decode runs in
plain instructions here), and fp8's flavour (gfx942's e4m3fnuz runs as e4m3fn: same bytes,
same speed). `make amd-report` compiles the target's entries for the target itself.
MOE_OVERLAY_TRITON_UNIT_PROGRAMS=1 (`--unit-programs`) also holds each kernel to as many
programs an SM as the target's compute unit would hold (standin.py), by LDS and wave slots.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from functools import cache

TARGET_ENV = "MOE_OVERLAY_TRITON_TARGET"
MX_LAYOUT_ENV = "MOE_OVERLAY_TRITON_MX_LAYOUT"  # words | bytes | units: measure another mxfp4 layout on a target
MX_LAYOUTS = ("words", "bytes", "units")
UNIT_ENV = "MOE_OVERLAY_TRITON_UNIT_PROGRAMS"  # 1: a stand-in's SM holds the programs a target's CU would (standin.py)
MAX_WAVES_A_SIMD = 8  # gfx942 and gfx950
SIMDS_A_UNIT = 4  # an AMD compute unit's SIMDs: a program's waves spread over them
NVIDIA_SHARED_BYTES = 227 * 1024  # a program's shared memory at most on Hopper (sm_90); the device says its own


@dataclass(frozen=True)
class Target:
    """A GPU architecture as the kernels see it."""

    arch: str  # gfx942, gfx950, sm_90, ...; "interpreter" for Triton's CPU interpreter
    vendor: str  # amd, nvidia or cpu (the interpreter)
    shared_bytes: int  # shared memory (LDS) a program may use; 0: no limit (the interpreter)
    warp_size: int  # lanes a warp (a wave on AMD)
    hopper: bool = False  # NVIDIA sm_90+: Gluon wgmma kernels, PDL, tensor descriptors, weight-left fp8 dots
    mx_words: bool = False  # mxfp4 with bf16 activations as recoded int32 words (layout.mx_words), decoded by
    # integer operations into a bf16 dot; else packed bytes through tl.dot_scaled
    mx_units: bool = False  # mxfp4 gate/up weights as int16 units of four e2m1 (layout.mx_units), decoded by
    # shifts and masks into fp16 dots of K 16 with fp16 activations (launch.fp16_rows); the down's packed bytes
    mx_entries: str = ""  # the mxfp4 layout MX_LAYOUT_ENV asks for where the target's own is another: mxfp4
    # shapes read and the tuner writes launch entries of their own for it (configs.LayerShape.layout)
    stands_in: str = ""  # the GPU that runs this target's kernels in target mode (its name), else ""
    stages_in_registers: int = 0  # pipeline stages the compiler holds in registers, not shared memory
    scratch_bytes: int = 0  # shared memory the compiler takes beyond the pipelined tiles (scales, barriers)
    kpack: int = 1  # dots' operands read kpack times as much K a lane from LDS (Triton's AMD `kpack`; gfx942 only)
    mfma_size: int = 0  # Triton's AMD `matrix_instr_nonkdim`: 16 for 16x16 MFMAs (0: the compiler's choice)
    fp4_instructions: bool = False  # e2m1 conversion instructions (gfx950): tl.dot_scaled's decode is one a pair
    resident_in_registers: bool = False  # the resident down's activation block passes through shared memory
    # once and stays in registers, its buffer then reused by the weight stages (AMD: `make amd-report`'s LDS)
    unit_programs: bool = False  # target mode (UNIT_ENV): each kernel held on the stand-in to as many programs an SM
    # as the target's compute unit holds (programs_a_unit; standin.hold)

    @property
    def tile_bytes(self) -> int:
        """Shared memory a program's pipelined tiles may take (0: no limit)."""
        return max(self.shared_bytes - self.scratch_bytes, 0) if self.shared_bytes else 0

    def shared_stages(self, num_stages: int) -> int:
        """Stages of a `num_stages` pipeline that take shared memory: on gfx942 Triton's stream
        pipeliner prefetches one into registers (2 stages: one LDS buffer), gfx950 and NVIDIA
        copy every stage straight into shared memory (seen in the compiled kernels' LDS:
        `make amd-report`)."""
        return max(1, num_stages - self.stages_in_registers)

    def compile_options(self, kpack: int) -> dict[str, int]:
        """Triton compile options of a dot kernel run with `kpack` (plan.Step.kpack): only where
        Triton compiles for the AMD target itself; a stand-in's compiler has no such option."""
        return {} if self.stands_in else self.amd_options(kpack)

    def amd_options(self, kpack: int) -> dict[str, int]:
        """The options Triton's AMD backend compiles a dot kernel of `kpack` (plan.Step.kpack) with
        for this target (none for a target that is not AMD), also where a stand-in runs it:
        target mode's hold compiles it for the target (standin.target_lds)."""
        if self.vendor != "amd":
            return {}
        return {"matrix_instr_nonkdim": self.mfma_size, **({"kpack": kpack} if kpack > 1 else {})}

    def programs_a_unit(self, lds_bytes: int, num_warps: int) -> int:
        """Programs of `num_warps` warps (waves on AMD) and `lds_bytes` of LDS that one compute
        unit of this AMD target holds at once (0: one does not fit): its LDS (a CU's, the most a
        program may take: 64 KiB on gfx942, 160 on gfx950) over theirs, and MAX_WAVES_A_SIMD
        waves on each of its SIMDs. Registers are not counted (amd_report.Resources.waves_a_simd
        adds them)."""
        by_waves = MAX_WAVES_A_SIMD * SIMDS_A_UNIT // num_warps
        return min(self.shared_bytes // lds_bytes, by_waves) if lds_bytes else by_waves

    def dot_warps(self, num_warps: int, rows: int, columns: int) -> int:
        """The warps a kernel of `num_warps` runs whose dots are `rows` x `columns`: on a target
        with an MFMA size (AMD), no more than the dots' MFMA tiles, halving (Triton's AMD backend
        gives each wave a tile at least, so spare waves would compute the same products again,
        each decoding the weights again: amd_report.repeated_dots); elsewhere `num_warps`."""
        if not self.mfma_size:
            return num_warps
        tiles = max((rows // self.mfma_size) * (columns // self.mfma_size), 1)
        while num_warps > tiles:
            num_warps //= 2
        return num_warps

    @property
    def table_keys(self) -> tuple[str, ...]:
        """The launch table's device keys this target reads, after the device's own name on
        a real GPU of it: AMD entries are kept by architecture (MI300X and MI325X are gfx942)."""
        return (self.arch,) if self.vendor == "amd" else ()

    @property
    def mx_layout(self) -> str:
        """Its mxfp4 layout: one of MX_LAYOUTS."""
        return "words" if self.mx_words else "units" if self.mx_units else "bytes"

    def describe(self) -> str:
        kind = {"words": "words", "units": "units (the down's packed bytes unless SiTU bounds its input)",
                "bytes": "packed bytes (tl.dot_scaled)"}[self.mx_layout]
        if self.mx_entries:
            kind += f", its own launch entries ({self.mx_entries})"
        where = f"stood in for by {self.stands_in}" if self.stands_in else "this GPU"
        nvidia = "Gluon, PDL, tensor descriptors" if self.hopper else "no NVIDIA-only kernels"
        unit = ", an SM holding the programs a compute unit would" if self.unit_programs else ""
        return (f"target {self.arch} ({where}): {self.shared_bytes // 1024} KiB of shared memory a program, "
                f"mxfp4 as {kind}, {nvidia}{unit}")


# AMD Instinct targets: 64 KiB of LDS a workgroup on gfx942, 160 KiB on gfx950; kernels took up
# to 2 KiB beyond their tiles there (make amd-report, Triton 3.9), so 4 KiB are kept aside.
# gfx942's dots read their operands with kpack 2 (16 bytes a lane, ds_read_b128), as vLLM's
# MI300X fused-MoE entries do: fewer VGPRs and vector instructions in most of the shipped
# launches (docs/performance.md); gfx950's Triton ignores kpack. Both take 16x16 MFMAs, as those
# entries do: with the compiler's own choice (32x32 from 32 rows), a dot of fewer 32x32 tiles
# than waves has waves computing the same products, each decoding the weights again
# (amd_report.repeated_dots: 22 of the shipped launches at cd53631, 4 with 16x16).
AMD_SCRATCH = 4096
AMD_TARGETS = {
    "gfx942": Target("gfx942", "amd", 64 * 1024, 64, stages_in_registers=1, scratch_bytes=AMD_SCRATCH, kpack=2,
                     mfma_size=16, resident_in_registers=True),
    "gfx950": Target("gfx950", "amd", 160 * 1024, 64, scratch_bytes=AMD_SCRATCH, fp4_instructions=True,
                     mfma_size=16, resident_in_registers=True),
}
INTERPRETER = Target("interpreter", "cpu", 0, 32)


def amd_target(arch: str) -> Target:
    """An AMD target by architecture; one not listed gets gfx942's limits (64 KiB of LDS)."""
    return AMD_TARGETS.get(arch) or replace(AMD_TARGETS["gfx942"], arch=arch)


def nvidia_target(capability: int, shared_bytes: int = NVIDIA_SHARED_BYTES) -> Target:
    """NVIDIA by compute capability (90 for sm_90): mxfp4 as words on every NVIDIA GPU (faster
    than tl.dot_scaled's decode on an H200: docs/performance.md)."""
    return Target(f"sm_{capability}", "nvidia", shared_bytes, 32, hopper=capability >= 90, mx_words=True)


def stand_in(real: Target, device_name: str) -> Target:
    """`real` as target mode has it: the target named by MOE_OVERLAY_TRITON_TARGET (an NVIDIA
    GPU standing in for it), and the mxfp4 layout MOE_OVERLAY_TRITON_MX_LAYOUT asks for."""
    named = os.environ.get(TARGET_ENV, "")
    target = real
    if named:
        if named not in AMD_TARGETS:
            raise ValueError(f"{TARGET_ENV}={named!r} is not a target; use one of {', '.join(AMD_TARGETS)}")
        if real.vendor == "amd" and real.arch != named:
            raise ValueError(f"{TARGET_ENV}={named} cannot run on {real.arch}: an AMD GPU runs as itself")
        if real.vendor == "nvidia":
            target = replace(AMD_TARGETS[named], stands_in=device_name, unit_programs=_unit_programs())
    elif _unit_programs():
        raise ValueError(f"{UNIT_ENV}=1 is for target mode: set {TARGET_ENV} too (gfx942 or gfx950)")
    layout = os.environ.get(MX_LAYOUT_ENV, "")
    if layout:
        if layout not in MX_LAYOUTS:
            raise ValueError(f"{MX_LAYOUT_ENV}={layout!r} is not an mxfp4 layout; use one of {', '.join(MX_LAYOUTS)}")
        if layout != target.mx_layout:
            target = replace(target, mx_words=layout == "words", mx_units=layout == "units", mx_entries=layout)
    return target


def _unit_programs() -> bool:
    value = os.environ.get(UNIT_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{UNIT_ENV}={value!r}: use 1 (an SM holds a compute unit's programs) or 0")
    return value == "1"


def platform_target(vendor: str, arch: str, device_name: str) -> Target:
    """The target of a GPU as torch describes it (backend.Platform: amd with gfx942, nvidia
    with sm_90; anything else: the interpreter's), in target mode the one it stands in for,
    with the mxfp4 layout MX_LAYOUT_ENV names."""
    if vendor not in ("amd", "nvidia"):
        return stand_in(INTERPRETER, "")
    real = amd_target(arch) if vendor == "amd" else nvidia_target(int(arch.removeprefix("sm_")))
    return stand_in(real, device_name)


def current_target() -> Target:
    """The target Triton compiles for now (its active driver: a GPU here, or one that is not,
    as the compile tests set), in target mode the one it stands in for."""
    import triton

    from . import kernels

    if not isinstance(kernels.gate_up_kernel, triton.runtime.jit.JITFunction):
        return platform_target("cpu", "", "")
    gpu = triton.runtime.driver.active.get_current_target()
    return _target_of(gpu.backend, str(gpu.arch), os.environ.get(TARGET_ENV, ""),
                      os.environ.get(MX_LAYOUT_ENV, ""), os.environ.get(UNIT_ENV, ""))


@cache
def _target_of(backend: str, arch: str, named: str, layout: str, unit: str) -> Target:
    """(The environment's three names key the cache: stand_in reads them.)"""
    if backend == "hip":
        return platform_target("amd", arch, arch)
    return platform_target("nvidia", f"sm_{arch}", _device_name())


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "an NVIDIA GPU"


def add_target_argument(parser: argparse.ArgumentParser) -> None:
    """`--target`, for the benchmark and the tuner (`make bench-gpu TARGET=gfx942`)."""
    parser.add_argument("--target", choices=list(AMD_TARGETS), default=os.environ.get(TARGET_ENV) or None,
                        help=f"target mode: this NVIDIA GPU stands in for an AMD target, running only what it "
                             f"would (default: ${TARGET_ENV}, else the GPU as itself)")
    parser.add_argument("--unit-programs", action="store_true", default=os.environ.get(UNIT_ENV) == "1",
                        help=f"target mode: also hold each kernel to as many programs an SM as the target's "
                             f"compute unit holds, by its LDS and wave slots (default: ${UNIT_ENV}=1)")


def use_target(named: str | None, unit_programs: bool = False) -> None:
    """Target mode from here on, for this process and those it starts (the tuner's compilers)."""
    if unit_programs and not (named or os.environ.get(TARGET_ENV)):
        raise SystemExit(f"--unit-programs is for target mode: name a target with --target (or {TARGET_ENV})")
    if named:
        os.environ[TARGET_ENV] = named
    if unit_programs:
        os.environ[UNIT_ENV] = "1"
