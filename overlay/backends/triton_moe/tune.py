"""`moe-overlay tune`: time the Triton MoE kernels' launch configurations on this GPU for each
layer shape and token count, and write the fastest to a file the backend merges over its
table (MOE_OVERLAY_TRITON_CONFIGS, or the shipped configs/ directory).

Compiling dominates a naive search, so the candidates are first compiled in parallel
processes (Triton's disk cache keeps them), then timed one after another in this one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...backend import Platform
from ...spec import MoESpec
from ..problems import MODELS, ROUTINGS, TOKEN_COUNTS, WEIGHT_FORMATS, model, with_weights
from .configs import (
    FP8_GEMV_STEPS,
    FP8_STEP,
    FP8_TINY_DOWN_STEPS,
    GLUON_BLOCK_M,
    GLUON_MX_BLOCK_MS,
    MX_DEQUANT_BLOCK_M,
    MX_MIN_K,
    RESIDENT_MAX_I,
    TINY_DOWN_COLUMNS,
    TINY_ROUTES,
    KernelConfig,
    LaunchConfig,
    LayerShape,
    default_config,
    device_name,
    down_tile,
    is_tiny,
    merge,
    read_file,
    resident_bytes,
    resident_k,
    row_tiles,
    shared_limit,
    stage_bytes,
    tiny_route_split,
    with_dot_warps,
)
from .target import Target, add_target_argument, current_target, use_target

REG_BUDGET = 128  # fp32 accumulator registers per thread beyond which tiles spill
MAX_SPLIT_K = 16
STREAM_SPLITS = (2, 4, 8)  # streamed down: programs per row tile
COMPILE_CHUNK = 16  # kernels per compile task: small tasks keep every process busy to the end
COMPILE_EXPERTS = 4  # compile problems hold this many experts per top-k (kernels take E unspecialised)
DESCRIPTOR_TRIES = 3  # sorted-mode leaders timed again with tensor-descriptor weight tiles
PROGRESS_S = 30.0  # a point's timing pass says how far it is at most this often


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", choices=[m.name for m in MODELS],
                        help="a model's per-GPU layer under TP8 (repeatable; default: all four)")
    parser.add_argument("--shape", action="append", default=[], metavar="E,H,I,K",
                        help="another layer: local experts, hidden, intermediate, top-k (repeatable)")
    parser.add_argument("--weights", action="append", choices=WEIGHT_FORMATS,
                        help="weight format (repeatable; default: bf16)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)),
                        help="token counts to tune, comma-separated (each becomes an M bucket)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file to write; existing entries in it are kept unless re-tuned "
                             "(default: moe-overlay-triton-<device>.json here)")
    parser.add_argument("--explain", action="store_true",
                        help="also print each point's plan (the kernel and tiles of each step) and the fastest "
                             "time of each kind of launch tried")
    add_target_argument(parser)
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes that compile candidates in parallel")


@dataclass(frozen=True)
class Point:
    name: str
    spec: MoESpec
    tokens: int

    @property
    def shape(self) -> LayerShape:
        return LayerShape.of(self.spec)


def points_from_args(args: argparse.Namespace) -> list[Point]:
    names = args.model or ([] if args.shape else [m.name for m in MODELS])
    layers = [(n, model(n).spec) for n in names]
    for text in args.shape:
        e, h, i, k = (int(v) for v in text.split(","))
        layers.append((text, MoESpec(e, h, i, k)))
    tokens = [int(t) for t in args.tokens.split(",")]
    return [Point(f"{name} {weights}", with_weights(spec, weights), m)
            for weights in args.weights or ["bf16"] for name, spec in layers for m in tokens]


# -- candidates -----------------------------------------------------------------------------


def block_m_candidates(shape: LayerShape, tokens: int) -> list[int]:
    """The default block and the next larger one; also the smallest block of three row tiles
    (48, 96, 192) that holds an expert's routes with room to spare: each weight tile loaded
    (mxfp4: decoded) once for all of them, where powers of two would pad a lot or split the
    expert in two."""
    if is_tiny(tokens, shape.top_k):
        return [TINY_ROUTES]
    block_m = default_config(shape, tokens).block_m
    blocks = [block_m, block_m * 2] if block_m < 128 else [64, 128]
    per_expert = tokens * shape.top_k / shape.experts
    three_tiles = next((b for b in (48, 96, 192) if b >= 1.15 * per_expert), None)
    if per_expert >= 32 and three_tiles:
        blocks.append(three_tiles)
    return blocks


def _registers(values: int, cfg: KernelConfig, target: Target) -> int:
    """Registers a thread holds for `values` fp32 values spread over a program's lanes."""
    return values // (target.warp_size * cfg.num_warps)


def _fits(block_m: int, cfg: KernelConfig, b_tiles: int, target: Target, shape: LayerShape, sorted_mode: bool) -> bool:
    """Shared memory of the pipelined operand tiles (fp8 activations quantised first in
    sorted mode: a byte a value), and accumulator registers per thread."""
    act_bytes = 1 if shape.fp8 and sorted_mode else 2
    return (target.shared_stages(cfg.num_stages) * stage_bytes(block_m, cfg, b_tiles, shape.weight_bytes, act_bytes)
            <= target.tile_bytes
            and _registers(b_tiles * block_m * cfg.block_n, cfg, target) <= REG_BUDGET)


def _stages(target: Target, *deep: int) -> tuple[int, ...]:
    """Pipeline depths to try: `deep` on NVIDIA; on AMD two and three (a program's 64 KiB of
    LDS on gfx942 holds few deeper rings, and AMD's pipeliner double-buffers by default)."""
    return (2, 3) if target.vendor == "amd" else deep


def gemm_candidates(block_m: int, shape: LayerShape, b_tiles: int, target: Target) -> list[KernelConfig]:
    """gate/up (two B tiles per program: gate and up, or one interleaved tile twice as wide)
    or down (one): narrow tiles for weight streaming (small blocks), big ones for the tensor
    cores (large blocks), down to stages small enough for two programs per multiprocessor
    (one's epilogue then overlaps the other's main loop)."""
    fp8 = shape.fp8
    if block_m <= 32:
        block_ks = (128,) if fp8 else (64, 128, 256)
        grid = [KernelConfig(n, k, 4, s) for n in (32, 64, 128) for k in block_ks for s in _stages(target, 3, 4)]
        if fp8:  # the weight tile as wgmma's M (plan: weight-left), also 128 rows over two warpgroups
            grid += _weight_left([*grid, KernelConfig(128, 128, 8, 3), KernelConfig(128, 128, 8, 4)], target)
    else:
        block_ks = (128,) if fp8 else (32, 64, 128)
        grid = [KernelConfig(n, k, w, s, 8) for n in (32, 64, 128, 256) for k in block_ks for w in (4, 8)
                for s in _stages(target, 3, 4)]
        if fp8 and min(t for t in row_tiles(block_m) if t) < 64:  # a block of three row tiles, one of them under
            grid += _weight_left(grid, target)  # wgmma's 64 rows (48: 32 and 16; 96: 64 and 32)
    if block_m >= 128:  # wide tiles at 16 warps: a block's rows are re-read through the L2 once per N tile
        grid += [KernelConfig(n, k, 16, s, 8) for n in (128, 256) for k in block_ks for s in _stages(target, 3, 4, 6)]
    return [c for c in grid if _fits(block_m, c, b_tiles, target, shape, sorted_mode=True)]


def _weight_left(cfgs: list[KernelConfig], target: Target) -> list[KernelConfig]:
    """fp8 candidates of few rows, again with the weight tile as the dot's left operand where it
    has the 64 rows wgmma's M takes a warpgroup (plan.Step.weight_left; Hopper only;
    DeepSeek-V3 fp8-block M=1024 on an H200, the shipped entry: 588 -> 513 us)."""
    if not target.hopper:
        return []
    return [replace(c, weight_left=True) for c in cfgs if c.num_warps >= 4 and c.block_n >= 16 * c.num_warps]


def gluon_candidates() -> list[KernelConfig]:
    """Block-fp8 gate/ups of gluon_kernels (blocks of 64 rows, 4 warps, N tiles of 64: a
    128-column dot of gate and up; NVIDIA sm_90+, plan._gate_up_step): 3 or 4 stages. On an
    H200 its M=8192 gate/up took 1348 against 1644 us (Kimi-K3) and 739 against 883
    (DeepSeek-V3) for the shipped `tl` entries. N tiles of 32 (three programs a
    multiprocessor's registers rather than two) were 18-25% slower there, so not offered."""
    return [KernelConfig(64, 128, 4, stages, gluon=True) for stages in (3, 4)]


def gluon_mx_candidates() -> list[KernelConfig]:
    """mx_words gate/ups of gluon_kernels (4 warps, N tiles of one or two 64-row wgmmas, K
    steps of 64; NVIDIA sm_90+ with mx_words, plan._gate_up_step; elsewhere the `tl` kernel runs
    them): 3 or 4 stages. On an H200, as Kimi-K3 layers with the shipped downs: 1-6% faster than
    the shipped `tl` gate/ups at M = 16 to 8192 (docs/performance.md, 2026-12-04); K steps of
    128 were slower at M = 16 to 1024, so not offered."""
    return [KernelConfig(n, 64, 4, stages, gluon=True) for n in (64, 128) for stages in (3, 4)]


def gluon_mx_tiny_candidates(shape: LayerShape) -> list[KernelConfig]:
    """Tiny-mode mx_words gate/ups of gluon_kernels (4 warps, N tiles of one or two 64-row
    wgmmas, K steps of one or two 64-K word chunks, 3 or 4 stages), K split 1 to 14 ways where
    the split shares the layer's K steps evenly (plan._gate_up_step: otherwise the `tl` kernel
    would run the entry). On an H200, Kimi-K3 M=1 with the shipped down: 25.1 us with N tiles
    of 64, K steps of 64 and a split of 4, against 25.8 for the `tl` gate/up; unsplit 33-34 us
    (96 programs), split 8 or 14 27-31 (docs/performance.md, 2026-12-04)."""
    return [KernelConfig(n, k, 4, stages, split_k=split, gluon=True) for n in (64, 128) for k in (64, 128)
            for stages in (3, 4) for split in (1, 2, 4, 7, 8, 14)
            if shape.inter % n == 0 and shape.hidden % k == 0 and shape.hidden // k % split == 0]


def gluon_mx_down_candidates() -> list[KernelConfig]:
    """Streamed mx_words downs of gluon_kernels (4 warps, N tiles of two halves of one or two
    64-row wgmmas, K steps of 64, 3 or 4 stages, 1 to 16 programs per block; NVIDIA sm_90+
    with mx_words, plan._down_step; elsewhere kernels.down_kernel runs them)."""
    return [KernelConfig(n, 64, 4, stages, n_split=split, gluon=True) for n in (128, 256) for stages in (3, 4)
            for split in (1, 2, 4, 8, 16)]


def gluon_mx_tiny_down_candidates(shape: LayerShape) -> list[KernelConfig]:
    """Tiny-mode mx_words downs of gluon_kernels (4 warps, N tiles of two 64- or 128-row
    halves, K steps of one or two word chunks, 2 to 4 stages, a token's routes shared by
    programs of at most launch.TINY_DOWN_COLUMNS routes; NVIDIA sm_90+ with mx_words,
    plan._down_step). On an H200, Kimi-K3 M=1 with the Gluon tiny gate/up: 24.2 us
    with N tiles of 128, K steps of 128, 2 stages and a route a program, against 25.0 for the
    `tl` down; 4 routes a program 37-49 (docs/performance.md, 2026-12-04)."""
    def shares(split: int) -> bool:  # `split` programs a token, each within the wgmma's columns
        routes, programs = tiny_route_split(shape.top_k, split)
        return programs == split and routes <= TINY_DOWN_COLUMNS

    return [KernelConfig(n, k, 4, stages, split_k=split, gluon=True) for n in (128, 256) for k in (64, 128)
            for stages in (2, 3, 4) for split in (1, 2, 4, 8, 16)
            if shares(split) and shape.hidden % n == 0 and shape.inter % k == 0]


def gate_up_tiny_candidates(shape: LayerShape, target: Target) -> list[KernelConfig]:
    """One expert's rows at most: narrow N tiles and K split over programs to keep HBM busy
    (bf16/fp16 tiles of 8 columns are 16 interleaved gate/up rows, a dot's least N), and 8
    warps for wider tiles (more warps in flight: the one-token gate/up runs under one wave,
    register-bound; DeepSeek-V3 fp8-block 21.6 -> 20.5 us a layer on an H200). Three stages
    too, not only four and six: less shared memory a program, more programs a multiprocessor
    (fp8-block gate/ups on an H200: DeepSeek-V3's 14.3 -> 13.9 us, Kimi-K3's 18.9 -> 17.6; two
    stages never won). Also the gemv kernel, a route per program: 2 * BLOCK_N x BLOCK_K
    products in registers, 8 to 64 per thread, one stage (its loop has no dot, and Triton
    pipelines only loops with one: more stages compile the same kernel); fp8 steps one
    128-wide group or two and takes wider N tiles, up to 128 one-byte weights a thread (on an
    H200 the block-fp8 one-token gate/up, alone: DeepSeek-V3's best 12.7 us with two groups a
    step, 16 columns, 2 warps, K split 8, against 13.8 with one; Kimi-K3's 16.4 against 16.7)."""
    fp8 = shape.fp8
    block_ks = (128,) if fp8 else (64, 128, 256)
    block_ns = (16, 32, 64, 128) if fp8 else (8, 16, 32, 64)  # fp8: 64 weight rows and up are wgmma's M
    grid = [KernelConfig(n, k, w, stages, split_k=s) for n in block_ns for k in block_ks for w in (2, 4)
            for stages in _stages(target, 3, 4, 6) for s in (1, 2, 4, 8, MAX_SPLIT_K)]
    grid += [KernelConfig(n, k, 8, 3, split_k=s) for n in block_ns if n >= 32 for k in block_ks for s in (2, 4, 8)]
    if fp8:
        grid += _weight_left(grid, target)
    gemv_ns, gemv_ks = ((8, 16, 32), FP8_GEMV_STEPS) if fp8 else ((4, 8, 16), (128, 256, 512))
    most = 128 if fp8 else 64
    gemv = [KernelConfig(n, k, w, 1, split_k=s, gemv=True) for n in gemv_ns for k in gemv_ks
            for w in (2, 4, 8) for s in (1, 2, 4, 8, MAX_SPLIT_K)
            if 8 <= 2 * n * k // (target.warp_size * w) <= most]
    return [c for c in grid if _fits(TINY_ROUTES, c, 2, target, shape, sorted_mode=False)] + gemv


def resident_down_candidates(block_m: int, shape: LayerShape, target: Target) -> list[KernelConfig]:
    """down_resident_kernel (bf16/fp16 and block fp8, I of at most RESIDENT_MAX_I): the
    activation block and num_stages weight tiles of all of I in shared memory; 1 to 4
    programs per M block (block fp8: 1 or 2, up to 5 stages, and with weight-left dots for
    rows under wgmma's 64). Block fp8 at M=8192 on an H200, the activation tile loaded once
    rather than once per N tile (with its quantisation): DeepSeek-V3's down 597-630 -> 502 us,
    Kimi-K3's 981-996 -> 823."""
    if shape.inter > RESIDENT_MAX_I or not (shape.interleaved or shape.resident_fp8):
        return []
    if shape.interleaved:
        k = sum(resident_k(shape.inter))
        grid = [KernelConfig(n, k, w, s, n_split=split) for n in (32, 64, 128, 256) for w in (4, 8) for s in (2, 3)
                for split in (1, 2, 4)]
    else:
        grid = [KernelConfig(n, FP8_STEP, 4, s, n_split=split, descriptors=target.hopper, resident=True)
                for n in (32, 64, 128) for s in _stages(target, 3, 4, 5) for split in (1, 2)]
        grid += _weight_left(grid, target) if block_m < 64 else []
    return [c for c in grid if resident_bytes(block_m, c, shape, target) <= target.tile_bytes
            and _registers(block_m * c.block_n, c, target) <= REG_BUDGET]


def whole_block_candidates(block_m: int, shape: LayerShape, target: Target) -> list[KernelConfig]:
    """down_kernel a whole block of three row tiles a program (KernelConfig.whole_block): each
    weight tile loaded, and mxfp4's decoded, once for the block, not once for each third; the
    tiles that fit its rows."""
    if not row_tiles(block_m)[1]:
        return []
    return [replace(c, whole_block=True) for c in gemm_candidates(block_m, shape, 1, target)]


def streamed_down_candidates(tiled: list[KernelConfig], interleaved: bool) -> list[KernelConfig]:
    """down_kernel streamed (fp8 and mxfp4; bf16/fp16 have the resident down): each tiled
    candidate with STREAM_SPLITS programs per row tile."""
    return [] if interleaved else [replace(c, n_split=split) for c in tiled for split in STREAM_SPLITS]


def down_tiny_candidates(fp8: bool, top_k: int, inter: int, target: Target) -> list[KernelConfig]:
    """Matrix-vector products of a token's routes at once: [routes, BLOCK_N, BLOCK_K] weight
    tiles and [routes, BLOCK_K] activations in registers, the routes all k or shared by 2 or 4
    programs (split_k: more programs where one token's H / BLOCK_N leave multiprocessors
    idle). Wide BLOCK_K (up to all of I; fp8 too, one to four 128-wide groups) keeps enough
    bytes in flight when few programs run, and under PDL more of the weights load before the
    down waits for its gate/up (Maverick fp8-channel-token M=1 on an H200: steps of 512, the
    layer 19.0 -> 14.3 us). One stage: no dot, so nothing for Triton to pipeline."""
    widest = min(1024, 1 << (inter - 1).bit_length())
    steps = FP8_TINY_DOWN_STEPS if fp8 else (64, 128, 256, 512, 1024)  # fp8: whole 128-wide groups
    block_ks = tuple(k for k in steps if k <= widest or (fp8 and k == FP8_STEP))
    k_pad = 1 << (top_k - 1).bit_length()
    return [KernelConfig(n, k, w, 1, split_k=split) for n in (16, 32, 64) for k in block_ks for w in (4, 8)
            for split in (1, 2, 4) if split <= k_pad and k_pad // split * n * k // (target.warp_size * w) <= REG_BUDGET]


@dataclass(frozen=True)
class Candidates:
    block_m: int
    gate_up: list[KernelConfig]
    down: list[KernelConfig]


def candidates(point: Point, target: Target) -> list[Candidates]:
    """Every launch the tuner times at `point` on `target`: what fits its shared memory, and
    the NVIDIA-only kernels (Gluon) where the target is Hopper."""
    fp8, top_k, inter = point.shape.fp8, point.spec.top_k, point.spec.intermediate_size
    gluon = target.hopper
    if is_tiny(point.tokens, top_k):
        gate_ups, downs = gate_up_tiny_candidates(point.shape, target), down_tiny_candidates(fp8, top_k, inter, target)
        if gluon and point.shape.weights == "mxfp4":
            gate_ups += gluon_mx_tiny_candidates(point.shape)
            downs += gluon_mx_tiny_down_candidates(point.shape)
        return [_as_run(point.shape, _runnable(point.shape, Candidates(TINY_ROUTES, gate_ups, downs)), True, target)]
    cands = []
    for b in block_m_candidates(point.shape, point.tokens):
        tiled = gemm_candidates(down_tile(b), point.shape, 1, target) + whole_block_candidates(b, point.shape, target)
        downs = (tiled + resident_down_candidates(down_tile(b), point.shape, target)
                 + streamed_down_candidates(tiled, point.shape.interleaved))
        gate_ups = gemm_candidates(b, point.shape, 2, target)
        if gluon and point.shape.weights == "fp8-block" and b == GLUON_BLOCK_M:
            gate_ups += gluon_candidates()
        elif gluon and point.shape.weights == "mxfp4" and b in GLUON_MX_BLOCK_MS:
            gate_ups += gluon_mx_candidates()
            downs += gluon_mx_down_candidates()
        elif point.shape.weights == "mxfp4" and not (target.mx_words or target.fp4_instructions) \
                and b >= MX_DEQUANT_BLOCK_M and not target.mx_units:  # units have their own decode (plan.py)
            gate_ups += [replace(c, mx_dequant=True) for c in gate_ups]
            downs += [replace(c, mx_dequant=True) for c in downs]
        cands.append(_as_run(point.shape, _runnable(point.shape, Candidates(b, gate_ups, downs)), False, target))
    return cands


def _as_run(shape: LayerShape, cands: Candidates, tiny: bool, target: Target) -> Candidates:
    """Each candidate with the warps its dots run on (configs.with_dot_warps, as the plan has them:
    on AMD no more than their MFMA tiles; the gemv gate/up and tiny mode's down have no dot),
    each once: an entry records what runs, and no launch is timed twice."""
    b = cands.block_m
    gate_ups = [g if g.gemv else with_dot_warps(g, b, shape, target, gate_up=True) for g in cands.gate_up]
    downs = cands.down if tiny else [with_dot_warps(d, b, shape, target, gate_up=False) for d in cands.down]
    return Candidates(cands.block_m, list(dict.fromkeys(gate_ups)), list(dict.fromkeys(downs)))


def _without(cands: Candidates, left_out: set[Kernel]) -> Candidates:
    return Candidates(cands.block_m, [g for g in cands.gate_up if ("gate_up", g) not in left_out],
                      [d for d in cands.down if ("down", d) not in left_out])


def _runnable(shape: LayerShape, cands: Candidates) -> Candidates:
    """mxfp4 (canonical packed weights): K steps of MX_MIN_K at least, as launch_config's
    rules have it; others as they are."""
    if shape.weights != "mxfp4":
        return cands
    return Candidates(cands.block_m, [g for g in cands.gate_up if g.block_k >= MX_MIN_K],
                      [d for d in cands.down if d.block_k >= MX_MIN_K])


# -- running the kernels of one candidate ---------------------------------------------------


class Problem:
    """One point's weights, routings and buffers. The weights are random, in the backend's
    layout for this GPU (what prepare() makes: mxfp4 words on NVIDIA, say)."""

    def __init__(self, point: Point, routings: int, random: bool, platform: Platform | None = None) -> None:
        """On this GPU, or with `platform` on the CPU (tensors to compile for an absent GPU)."""
        import torch

        from ...layout import to_layout
        from ..problems import empty_weights, random_calls, random_weights
        from . import launch
        from .backend import TritonBackend

        spec, device = point.spec, torch.device("cpu" if platform else "cuda")
        self.point, self.device = point, device
        # compiling needs shapes and dtypes only
        canonical = random_weights(spec, device, seed=0) if random else empty_weights(spec, device)
        self.tensors = to_layout(canonical, spec, TritonBackend().layout_for(spec, platform or Platform.of(device)))
        self.inputs = random_calls(point.tokens, spec, device, routings, seed=100)
        act = spec.activation
        self.layer = launch.Layer.of(self.inputs[0][0], self.tensors["w13"], self.tensors["w2"],
                                     spec.top_k, act.kind, list(act.params),
                                     spec.apply_router_weight_on_input, spec.quant.granularity,
                                     spec.quant.activations == "fp8_token")
        self.tiny = is_tiny(point.tokens, spec.top_k)

    def runners(self, block_m: int) -> tuple[Callable[[KernelConfig], None], Callable[[KernelConfig], None]]:
        """(run gate/up with a config, run down and the top-k sum with a config), each over
        every routing."""
        import torch

        from . import launch

        t, spec, layer = self.tensors, self.point.spec, self.layer
        inter, hidden, routes = spec.intermediate_size, spec.hidden_size, self.point.tokens * spec.top_k
        aligns = [None if self.tiny else launch.align(ids, None, spec.num_local_experts, block_m)
                  for _, _, ids in self.inputs]
        if self.tiny:  # room for the largest K split
            acts = [launch.TinyOut.empty(routes, inter, MAX_SPLIT_K, self.device) for _ in aligns]
            for tiny in acts:
                tiny.act.zero_()
        else:
            acts = [torch.zeros(a.num_blocks * block_m, inter, dtype=layer.act_dtype(spec.dtype), device=self.device)
                    for a in aligns]
        outs = [torch.empty(self.point.tokens, hidden, dtype=spec.dtype, device=self.device) for _ in self.inputs]

        def gate_up(cfg: KernelConfig) -> None:
            plan = launch.plan_for(layer, LaunchConfig(block_m, cfg, cfg), self.tiny)
            for (x, w, ids), a, act in zip(self.inputs, aligns, acts, strict=True):
                launch.gate_up(x, t["w13"], t.get("w13_scale"), w, ids, None, a, layer, plan, act)

        def down(cfg: KernelConfig) -> None:
            plan = launch.plan_for(layer, LaunchConfig(block_m, cfg, cfg), self.tiny)
            for (_, w, ids), a, act, out in zip(self.inputs, aligns, acts, outs, strict=True):
                if a is None:
                    launch.down_tiny(act.act, t["w2"], t.get("w2_scale"), w, ids, None, layer, plan, out)
                else:
                    launch.down_and_sum(act, t["w2"], t.get("w2_scale"), w, ids, None, a, layer, plan, out)

        return gate_up, down

    def run_layer(self, config: LaunchConfig) -> None:
        """The whole layer with a launch config, one routing after another."""
        from . import launch

        t = self.tensors
        for x, w, ids in self.inputs:
            launch.fused_experts(self.layer, x, t["w13"], t["w2"], t.get("w13_scale"), t.get("w2_scale"), w, ids,
                                 None, config)


Kernel = tuple[str, KernelConfig]  # ("gate_up" | "down", config)


def compile_tasks(plan: list[tuple[Point, list[Candidates]]]) -> list[tuple[Point, int, list[Kernel]]]:
    """Every kernel to compile, in chunks of COMPILE_CHUNK: (point, block_m, kernels)."""
    tasks = []
    for point, cands in plan:
        for c in cands:
            kernels = [("gate_up", g) for g in c.gate_up] + [("down", d) for d in c.down]
            tasks += [(point, c.block_m, kernels[i : i + COMPILE_CHUNK]) for i in range(0, len(kernels), COMPILE_CHUNK)]
    return tasks


def _compile(task: tuple[Point, int, list[Kernel]]) -> tuple[list[str], list[Kernel]]:
    """Worker: compile some kernels of one point into Triton's disk cache: (why each that
    failed did, the kernels an AMD target cannot take). On an AMD target each is also compiled for it with
    Triton's AMD backend (no AMD GPU needed), and one that spills registers or needs more LDS
    than the target has, or whose waves compute the same products of a dot, is named, for the
    timing pass to leave out: the GPU standing in would run it at a speed the target cannot reach."""
    from .launch import compile_only

    point, block_m, kernels = task
    experts = min(point.spec.num_experts, COMPILE_EXPERTS * point.spec.top_k)  # less memory per process
    small = replace(point, spec=replace(point.spec, num_experts=experts))
    failures = []
    with compile_only():
        gate_up, down = Problem(small, 1, random=False).runners(block_m)
        for kind, cfg in kernels:
            try:
                (gate_up if kind == "gate_up" else down)(cfg)
            except Exception as err:  # e.g. out of shared memory: the timing pass skips it too
                failures.append(_why(err))
    return failures, _amd_rejects(small, block_m, kernels)


def _why(err: Exception) -> str:
    """An exception's type and the last line of its message (Triton's compile errors end with
    the cause), short enough to print."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1][:300] if lines else ''}"


def amd_checked(target: Target) -> bool:
    """Whether the tuner compiles each candidate for `target` with Triton's AMD backend: an AMD
    target, and a Triton that has the backend."""
    from triton.backends import backends

    return target.vendor == "amd" and "amd" in backends


def _amd_rejects(point: Point, block_m: int, kernels: list[Kernel]) -> list[Kernel]:
    """The kernels that spill, overflow the LDS or repeat a dot's products on several waves when
    compiled for the AMD target stood in for (amd_report's reading of the AMDGCN and TTGIR); none
    where the target is not AMD."""
    from .amd_report import compiled
    from .offline import absent_gpu, fresh_device

    target = current_target()
    if not amd_checked(target):
        return []
    problem = Problem(point, 1, random=False, platform=Platform("cuda", "amd", target.arch))
    with absent_gpu("hip", target.arch, fresh_device()):  # the routing's sort, compiled once
        gate_up, down = problem.runners(block_m)
    rejects = []
    for kind, cfg in kernels:
        device = fresh_device()
        try:
            with absent_gpu("hip", target.arch, device):
                (gate_up if kind == "gate_up" else down)(cfg)
        except Exception:  # the target cannot compile it: not a candidate either
            rejects.append((kind, cfg))
            continue
        if any(r.problems(target) for r in compiled(device)):
            rejects.append((kind, cfg))
    return rejects


def _timed(run: Callable[[KernelConfig], None], cfgs: Sequence[KernelConfig],
           errors: list[str] | None = None) -> list[tuple[KernelConfig, float]]:
    """The configs that run, with their seconds for all routings, fastest first; why each
    other did not, appended to `errors`."""
    from .timing import graph_replay_seconds

    timed = []
    for cfg in cfgs:
        try:
            timed.append((cfg, graph_replay_seconds(lambda cfg=cfg: run(cfg), replays=5, warmup_s=0.01,
                                                    min_timed_s=0.005)))
        except Exception as err:
            if errors is not None:
                errors.append(_why(err))
    return sorted(timed, key=lambda r: r[1])


def _fastest(run: Callable[[KernelConfig], None], cfgs: Sequence[KernelConfig],
             descriptors: bool, errors: list[str]) -> tuple[KernelConfig, float] | None:
    """The fastest config that runs, or None when none does. With `descriptors`, the
    DESCRIPTOR_TRIES fastest are also timed with their weight tiles read through tensor
    descriptors: which is faster depends on the point (on an H200 descriptors made M=8192
    layers 2-9% faster and one-token layers up to 3% slower, and favoured other warp counts),
    and trying only the leaders keeps the search from doubling."""
    timed = _timed(run, cfgs, errors)
    if descriptors and timed:
        tries = [replace(c, descriptors=True) for c, _ in timed[:DESCRIPTOR_TRIES]]
        timed = sorted(timed[:1] + _timed(run, tries, errors), key=lambda r: r[1])
    return timed[0] if timed else None


def tune_point(point: Point, cands: list[Candidates], target: Target) -> tuple[LaunchConfig, float, list[str]]:
    """The fastest (block_m, gate/up, down) for one point on `target`, its time per call in
    seconds, and (for --explain) its plan and the fastest time of each kind of launch tried."""
    problem = Problem(point, ROUTINGS, random=True)
    descriptors = target.hopper and not problem.tiny  # tensor descriptors: Hopper's, in sorted mode
    pairs: list[tuple[LaunchConfig, float]] = []
    kinds: list[str] = []
    errors: list[str] = []  # why candidates did not run
    total, done, started, said = sum(len(c.gate_up) + len(c.down) for c in cands), 0, time.time(), time.time()

    def us(seconds: float) -> str:
        return f"{seconds / ROUTINGS * 1e6:.1f}"

    def count_timed(kernels: int) -> None:
        """Counts kernels timed; says so every PROGRESS_S (a point can take minutes)."""
        nonlocal done, said
        done += kernels
        if time.time() - said >= PROGRESS_S:
            said = time.time()
            print(f"    {point.name} M={point.tokens}: timed {done}/{total} kernels [{said - started:.0f}s]",
                  flush=True)

    for c in cands:
        gate_up, down = problem.runners(c.block_m)
        by_kind: dict[str, list[KernelConfig]] = {}
        for d in c.down:
            kind = point.shape.down_kind(d)
            by_kind.setdefault(f"{kind}/{d.n_split}" if d.n_split else kind, []).append(d)
        downs = {k: r for k, ds in by_kind.items()  # mxfp4 tiles are read by plain loads
                 if (r := _fastest(down, ds, descriptors and point.shape.weights != "mxfp4", errors))}
        count_timed(len(c.down))
        for split, gemv in sorted({(g.split_k, g.gemv) for g in c.gate_up}):
            group = [g for g in c.gate_up if (g.split_k, g.gemv) == (split, gemv)]
            gu = _fastest(gate_up, group, descriptors and point.shape.interleaved, errors)
            count_timed(len(group))
            if gu is None or not downs:
                continue
            down_cfg, down_s = min(downs.values(), key=lambda r: r[1])
            kinds.append(f"block_m {c.block_m} split_k {split}{' gemv' if gemv else ''}: gate/up {us(gu[1])} us, "
                         "down " + ", ".join(f"{k} {us(s)}" for k, (_, s) in downs.items()))
            pairs.append((LaunchConfig(c.block_m, gu[0], down_cfg), gu[1] + down_s))
    if not pairs:
        raise RuntimeError(f"no candidate launch configuration ran for {point.name} M={point.tokens}"
                           + "".join(f"; {n} x {why}" for why, n in Counter(errors).most_common(3)))
    if problem.tiny and not (pairs := _with_pdl(problem, _leaders(pairs), kinds, target)):
        raise RuntimeError(f"no one-token layer ran for {point.name} M={point.tokens}")
    best = min(pairs, key=lambda r: r[1])
    from . import launch

    return best[0], best[1] / ROUTINGS, [f"plan: {launch.plan_for(problem.layer, best[0], problem.tiny).describe()}",
                                         *kinds]


def _leaders(pairs: list[tuple[LaunchConfig, float]]) -> list[LaunchConfig]:
    """The fastest pair (gate/up and down timed apart) of each kind of gate/up, dot and gemv,
    fastest first: tiny mode times these again as whole layers (_with_pdl)."""
    leaders: dict[bool, LaunchConfig] = {}
    for config, _ in sorted(pairs, key=lambda r: r[1]):
        leaders.setdefault(config.gate_up.gemv, config)
    return list(leaders.values())


def _with_pdl(problem: Problem, leaders: list[LaunchConfig], kinds: list[str],
              target: Target) -> list[tuple[LaunchConfig, float]]:
    """Tiny mode's pairs of launches timed together, each leader's down started by
    programmatic dependent launch and not (where the target has it: Hopper): the layers
    that ran and their seconds, for the fastest to be kept. PDL's gain is an overlap the
    kernels' separate timings cannot show: on an H200 1-2 us for most one-token layers, and a
    loss of 1 us for Kimi-K3's bf16 one. It differs by gate/up: beside the gemv's light
    programs the down starts sooner (Kimi-K3 fp8-block: the gemv gate/up 0.9 us faster alone,
    its layer 2.7 us), so a leader of each kind runs."""
    timed: list[tuple[LaunchConfig, float]] = []
    for config in leaders:
        variants = [replace(config, down=replace(config.down, pdl=pdl)) for pdl in (False, True)]
        runs = _timed(problem.run_layer, variants if target.hopper else variants[:1])
        kinds.append(f"layer, {'gemv' if config.gate_up.gemv else 'dot'} gate/up: " + ", ".join(
            f"{'PDL' if c.down.pdl else 'no PDL'} {s / ROUTINGS * 1e6:.1f} us"
            for c, s in sorted(runs, key=lambda r: r[0].down.pdl)))
        timed += runs
    return timed


def run(args: argparse.Namespace) -> int:
    import multiprocessing

    import torch

    if not torch.cuda.is_available():
        print("moe-overlay tune needs a CUDA or ROCm GPU")
        return 1
    use_target(args.target, args.unit_programs)
    gpu = torch.device("cuda", torch.cuda.current_device())
    target = current_target()
    target = replace(target, shared_bytes=shared_limit(gpu, target))
    # the table's key: the GPU's name, or in target mode the target's (its architecture)
    device = target.arch if target.stands_in else device_name(gpu)
    out = args.out or Path(f"moe-overlay-triton-{device.replace(' ', '_')}.json")
    points = points_from_args(args)
    plan = [(p, candidates(p, target)) for p in points]
    tasks = compile_tasks(plan)
    total = sum(len(kernels) for _, _, kernels in tasks)
    print(f"tuning {len(points)} points for {target.describe()}: {total} kernels to compile with {args.jobs} "
          "processes", flush=True)
    if amd_checked(target):
        print(f"  each also compiled for {target.arch} with Triton's AMD backend: those that spill, overflow "
              "its LDS or compute a dot's products on several waves are not timed", flush=True)
    elif target.vendor == "amd":
        print(f"  this Triton has no AMD backend: nothing is compiled for {target.arch}; make amd-report checks "
              "the entries", flush=True)
    started = time.time()
    failed: Counter[str] = Counter()  # why kernels failed to compile
    left_out: dict[tuple[str, int, int], set[Kernel]] = defaultdict(set)  # (point, tokens, block_m): kernels
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = zip(tasks, pool.map(_compile, tasks), strict=True)
        for done, ((point, block_m, _), (failures, rejects)) in enumerate(results, 1):
            failed.update(failures)
            left_out[point.name, point.tokens, block_m].update(rejects)
            if done % 10 == 0 or done == len(tasks):
                count = sum(map(len, left_out.values()))
                print(f"  compiled {done}/{len(tasks)} tasks ({failed.total()} kernels failed"
                      + (f", {count} left out for {target.arch}" if amd_checked(target) else "")
                      + f") [{time.time() - started:.0f}s]", flush=True)
    for why, n in failed.most_common(3):
        print(f"  {n} failed with {why}", flush=True)
    plan = [(p, [_without(c, left_out.get((p.name, p.tokens, c.block_m), set())) for c in cands])
            for p, cands in plan]
    table: dict[str, Any] = read_file(out) if out.exists() else {}
    for n, (point, cands) in enumerate(plan, 1):
        config, seconds, kinds = tune_point(point, cands, target)
        entry = {**config.to_json(), "tuned_us": round(seconds * 1e6, 1)}
        table = merge(table, {device: {point.shape.entries_of(target).key: {str(point.tokens): entry}}})
        out.write_text(json.dumps({"devices": table}, indent=1, sort_keys=True) + "\n")
        print(f"[{n}/{len(plan)}] {point.name} M={point.tokens}: {seconds * 1e6:.1f} us  {config} "
              f"[{time.time() - started:.0f}s]", flush=True)
        if args.explain:
            print("".join(f"    {line}\n" for line in kinds), end="", flush=True)
    print(f"wrote {out}; the backend reads it when {out} is listed in MOE_OVERLAY_TRITON_CONFIGS "
          "or placed in the package's configs/ directory")
    return 0
