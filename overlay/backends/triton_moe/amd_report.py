"""`make amd-report`: what each AMD target (gfx942: MI300X, MI325X; gfx950: MI355X) would run,
compiled for it with Triton's AMD backend on any machine (no GPU: offline.absent_gpu stands in
for the driver), and each kernel's resources read from its AMDGCN: VGPRs and AGPRs, spills,
LDS bytes, waves a SIMD, and the matrix and other vector instructions of its main loop (one
K step).

For every layer the benchmark times in a format (problems.format_models) and every token
count, the launch is the one launch_config gives on that target: the shipped table's entry,
or the untuned default fitted to the target's LDS. It exits 1 where a kernel spills or needs
more LDS than its target has. Nothing here runs on AMD hardware: this shows what the compiler
makes of the kernels, not how fast they are.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import triton
from triton.backends import backends

from ...backend import Platform, get_backend
from ...layout import to_layout
from ..problems import TOKEN_COUNTS, empty_weights, format_models, model, random_input, random_routing, with_weights
from . import kernels, launch
from .configs import LaunchConfig, LayerShape, current_table, launch_config, lookup, table_devices
from .offline import absent_gpu, fresh_device
from .plan import gluon_kernels
from .target import AMD_TARGETS, MAX_WAVES_A_SIMD, SIMDS_A_UNIT, Target, current_target

FORMATS = ("bf16", "fp8-block", "mxfp4")
REGISTERS_A_SIMD_LANE = 512  # gfx942 and gfx950: VGPRs and AGPRs together, per lane of a SIMD
REGISTER_GRANULE = 8
COMPILE_EXPERTS = 4  # experts a top-k route compiles with (the kernels take E unspecialised)


@dataclass(frozen=True)
class Resources:
    """One compiled kernel's resources on its target."""

    kernel: str
    num_warps: int
    kpack: int  # the dots' kpack it was compiled with (plan.Step.kpack; 1: none)
    vgprs: int  # a lane's VGPRs, its AGPRs among them (the metadata's vgpr_count: LLVM's TotalNumVgprs)
    agprs: int
    vgpr_spills: int
    sgpr_spills: int
    lds: int  # bytes a workgroup
    mfma_a_step: int  # matrix instructions in the main loop (main_loop)
    valu_a_step: int  # other vector instructions there (mxfp4: the decode's among them)
    repeated: int = 1  # times the waves compute each product of its dots (repeated_dots; 1: each once)

    @classmethod
    def of(cls, name: str, gcn: str, lds: int, num_warps: int, kpack: int = 1, ttgir: str = "") -> Resources:
        def field(key: str) -> int:
            found = re.search(rf"\.{key}:\s+(\d+)", gcn)
            return int(found.group(1)) if found else 0

        return cls(name, num_warps, kpack, field("vgpr_count"), field("agpr_count"), field("vgpr_spill_count"),
                   field("sgpr_spill_count"), lds, *main_loop(gcn), repeated_dots(ttgir))

    def waves_a_simd(self, arch: str) -> int:
        """Waves of this kernel a SIMD holds at once: by registers (`vgprs`, the metadata's
        vgpr_count, is VGPRs and AGPRs together, which share the lane's 512) and by LDS (the
        workgroups a CU holds, Target.programs_a_unit, their waves over its SIMDs)."""
        used = -(-self.vgprs // REGISTER_GRANULE) * REGISTER_GRANULE
        by_registers = min(MAX_WAVES_A_SIMD, REGISTERS_A_SIMD_LANE // max(used, 1))
        if not self.lds:
            return by_registers
        programs = AMD_TARGETS[arch].programs_a_unit(self.lds, self.num_warps)
        return min(by_registers, programs * self.num_warps // SIMDS_A_UNIT)

    def problems(self, target: Target) -> list[str]:
        out = [f"{n} {kind} spilled" for n, kind in ((self.vgpr_spills, "VGPRs"), (self.sgpr_spills, "SGPRs")) if n]
        if self.lds > target.shared_bytes:
            out.append(f"{self.lds} bytes of LDS, over {target.arch}'s {target.shared_bytes}")
        if self.repeated > 1:
            out.append(f"its waves compute each product of a dot {self.repeated} times")
        return out


def repeated_dots(ttgir: str) -> int:
    """The most times the waves of a kernel compute each product of one of its dots: a dot of
    M x N whose MFMA layout puts more waves times instruction rows (columns) along M (N) than
    it has spreads the same products over several waves, each decoding its weights again (the
    compiler's choice of warpsPerCTA, in the TTGIR; 1 where every product is computed once)."""
    layouts = {}
    for name, fields in re.findall(r"^#(\w+) = #ttg\.amd_mfma<\{(.*)\}>", ttgir, re.M):
        warps, instr = (re.search(rf"{key} = \[(\d+), (\d+)", fields) for key in ("warpsPerCTA", "instrShape"))
        if warps and instr:
            layouts[name] = (int(warps[1]) * int(instr[1]), int(warps[2]) * int(instr[2]))
    most = 1
    for m, n, name in re.findall(r"tt\.dot(?:_scaled)? .*-> tensor<(\d+)x(\d+)xf32, #(\w+)>", ttgir):
        span_m, span_n = layouts.get(name, (1, 1))
        most = max(most, -(-span_m // int(m)) * -(-span_n // int(n)))
    return most


@dataclass
class _Block:
    """A basic block of AMDGCN: the loop it is in (its header's label), its matrix and other
    vector ALU instructions, and whether it stores to memory."""

    loop: str | None = None
    mfma: int = 0
    valu: int = 0
    stores: bool = False


def main_loop(gcn: str) -> tuple[int, int]:
    """(matrix instructions, other vector ALU instructions) of the loop of the kernel that has
    the most matrix instructions, its blocks as LLVM marks them: a loop's header (".LBB0_8: ;
    =>This Inner Loop Header") and its other blocks ("; in Loop: Header=BB0_8"), wherever they
    are laid out, the mark on the label's line or the next. Blocks that store to memory and
    have no matrix instruction are left out: in a loop over several tiles' K steps (the down
    kernel's), the epilogue that stores a tile runs once a tile, not a K step."""
    blocks: list[_Block] = []
    label, loop = "", None
    for line in gcn.splitlines():
        block = re.match(r"(?:\.L(BB\w+):|; %bb\.\d+:)", line)
        if block:
            label, loop = block.group(1) or "", None
            blocks.append(_Block())
        if block or re.match(r"\s+;", line):
            header = re.search(r"Header=(BB\w+)", line)
            if "Loop Header" in line:
                loop = label
            elif header:
                loop = header.group(1)
            if blocks and loop:
                blocks[-1].loop = loop
        elif loop and blocks and (op := re.match(r"\s+((?:v|buffer|global)_\w+)", line)):
            name = op.group(1)
            if name.startswith(("buffer_store", "global_store")):
                blocks[-1].stores = True
            elif name.startswith("v_mfma"):
                blocks[-1].mfma += 1
            elif name.startswith("v_"):
                blocks[-1].valu += 1
    counts: dict[str, list[int]] = {}
    for b in blocks:
        if b.loop and (b.mfma or not b.stores):
            total = counts.setdefault(b.loop, [0, 0])
            total[0] += b.mfma
            total[1] += b.valu
    mfma, valu = max(counts.values(), default=[0, 0])
    return mfma, valu


@dataclass(frozen=True)
class Launch:
    target: Target
    model: str
    weights: str
    tokens: int
    config: LaunchConfig
    tuned: bool
    kernels: tuple[Resources, ...]


def compiled(device: int) -> list[Resources]:
    """Every kernel compiled for `device` (Triton's driver stands in for it)."""
    return [Resources.of(name, k.asm["amdgcn"], k.metadata.shared, k.metadata.num_warps, k.metadata.kpack,
                         k.asm["ttgir"])
            for module in (kernels, gluon_kernels) if module is not None for name, fn in vars(module).items()
            if device in getattr(fn, "device_caches", {}) for k in fn.device_caches[device][0].values()]


def compile_launches(arch: str, weights: str, tokens: list[int]) -> Iterator[Launch]:
    """The launches `arch` runs for the layers shipped in `weights`, each compiled for it
    (under a device index of its own, so that its kernels are its alone)."""
    for name in format_models(weights):
        spec = with_weights(model(name).spec, weights)
        shape = LayerShape.of(spec)
        small = replace(spec, num_experts=min(spec.num_experts, COMPILE_EXPERTS * spec.top_k))
        layout = get_backend("triton").layout_for(small, Platform("cuda", "amd", arch))
        tensors = to_layout(empty_weights(small, "cpu"), small, layout)
        x1 = random_input(1, small, "cpu", seed=1)
        layer = launch.Layer.of(x1, tensors["w13"], tensors["w2"],
                                spec.top_k, spec.activation.kind, list(spec.activation.params),
                                spec.apply_router_weight_on_input, spec.quant.granularity,
                                spec.quant.activations == "fp8_token")
        layer = replace(layer, shape=shape)  # the full layer's shape: its launch table entry, its plan
        for m in tokens:
            device = fresh_device()
            with absent_gpu("hip", arch, device):
                target = current_target()
                config = launch_config(shape, torch.device("cpu"), m, target)
                tuned = lookup(current_table(), table_devices(torch.device("cpu"), target), shape.entries_of(target),
                                m)[1]
                w, ids = random_routing(m, small, "cpu", seed=2)
                launch.fused_experts(layer, random_input(m, small, "cpu", seed=3), tensors["w13"], tensors["w2"],
                                     tensors.get("w13_scale"), tensors.get("w2_scale"), w, ids, None, config)
            yield Launch(target, name, weights, m, config, tuned, tuple(compiled(device)))


def report(targets: list[str], formats: list[str], tokens: list[int]) -> tuple[str, list[str]]:
    """(the report as markdown, every problem found)."""
    lines = ["| target | layer | M | entry | kernel | warps | kpack | VGPRs (AGPRs too) | of them AGPRs | spills "
             "| LDS (bytes) | waves / SIMD | MFMA a K step | other VALU a K step | dots repeated |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    problems = []
    for arch in targets:
        for weights in formats:
            for found in compile_launches(arch, weights, tokens):
                print(f"compiled {arch} {found.model} {weights} M={found.tokens}: {len(found.kernels)} kernels",
                      file=sys.stderr, flush=True)
                for r in found.kernels:
                    if r.kernel.startswith(("gate_up", "down")):  # the GEMMs (the sort and sums: problems only)
                        lines.append(
                            f"| {arch} | {found.model} {weights} | {found.tokens} | "
                            f"{'tuned' if found.tuned else 'default'} | {r.kernel} | {r.num_warps} | {r.kpack} "
                            f"| {r.vgprs} | {r.agprs} | {r.vgpr_spills + r.sgpr_spills} | {r.lds} "
                            f"| {r.waves_a_simd(arch)} | {r.mfma_a_step} | {r.valu_a_step} | {r.repeated}x |")
                problems += [f"{arch} {found.model} {weights} M={found.tokens} {r.kernel}: {p}"
                             for r in found.kernels for p in r.problems(found.target)]
    return "\n".join(lines) + "\n", problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", choices=list(AMD_TARGETS), help="default: both")
    parser.add_argument("--weights", action="append", choices=FORMATS, help="default: bf16, fp8-block and mxfp4")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)))
    args = parser.parse_args(argv)
    if "amd" not in backends:
        print(f"this Triton ({triton.__version__}) has no AMD backend")
        return 1
    table, problems = report(args.target or list(AMD_TARGETS), args.weights or list(FORMATS),
                             [int(t) for t in args.tokens.split(",")])
    print(f"Compiled with Triton {triton.__version__}'s AMD backend; nothing ran on AMD hardware.\n")
    print(table)
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
