"""Host side of the Triton kernels: buffers, grids and launches. Needs triton at import.

Nothing here reads device memory back to the host: every size comes from tensor shapes and
the launch table, and blocks past the real padded total exit on the device, so the whole
call can be captured in a CUDA graph.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from . import kernels, standin
from .configs import (
    FP8_GEMV_STEPS,
    TINY_DOWN_COLUMNS,
    KernelConfig,
    LaunchConfig,
    down_tiles,
    is_tiny,
    launch_config,
    resident_k,
    row_tiles,
    tiny_route_split,
)
from .plan import (
    FP8_TL,
    GEMV,
    GLUON_BLOCK_FP8,
    GLUON_MX,
    GLUON_MX_TINY,
    QUANT_GROUP,
    RESIDENT,
    Layer,
    Plan,
    Step,
    gluon_kernels,
    make_plan,
)
from .target import Target, current_target

A_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # tl.dot_scaled's names of the 16-bit activations
ACTIVATIONS = {"silu": kernels.SILU, "situ": kernels.SITU}
ALIGN_CHUNKS = (256, 4096)  # routes per sort program: the fewest and the most (align_chunk)
ALIGN_PROGRAMS = 32  # sort programs a call aims at
ALIGN_TABLE_ROWS = 8  # count-table rows the scatter programs read per step
REDUCE_BLOCK_H = 1024
QUANT_ROWS = 32
FP16_ROW_MAX = 2.0**15  # fp16_rows: a row's largest value below it, half fp16's largest (its power of two rounds up)
FP8_W_QUANT = {kernels.W_TENSOR.value, kernels.W_CHANNEL.value, kernels.W_BLOCK.value}
PINGPONG_FAILS_FROM = (3, 8)  # Triton releases whose AMD block-pingpong pass fails on fp8 dots for gfx950


_COMPILE_ONLY: ContextVar[bool] = ContextVar("compile_only", default=False)


@contextmanager
def compile_only() -> Iterator[None]:
    """Within it, launches compile their kernels (into Triton's disk cache) and run nothing:
    the tuner compiles in parallel processes, then times in one."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


def _launch(kernel: triton.JITFunction, grid: tuple[int, ...], *args: object, target: Target | None = None,
            kpack: int = 1, **kwargs: object) -> None:
    """Launch (or, within compile_only, compile) `kernel`; a plan's dot kernel names the plan's
    `target` and its dots' `kpack` (plan.Step.kpack): the AMD compile options it takes where
    Triton compiles for AMD, and target mode's hold compiles it for the target with them."""
    amd = target.amd_options(kpack) if target else {}
    if target:
        kwargs |= target.compile_options(kpack)
    w_quant = kwargs.get("W_QUANT")  # fp8 dots: W_QUANT's fp8 formats, or the resident down's FP8_STEPS
    fp8 = getattr(w_quant, "value", w_quant) in FP8_W_QUANT or bool(kwargs.get("FP8_STEPS"))
    if (fp8 and isinstance(kernel, triton.runtime.jit.JITFunction)  # (Triton's CPU interpreter: no JITFunction)
            and _block_pingpong_fails((target or current_target()).arch)):
        with triton.knobs.amd.scope():
            triton.knobs.amd.use_block_pingpong = False
            _compile_or_run(kernel, grid, args, kwargs, amd)
    else:
        _compile_or_run(kernel, grid, args, kwargs, amd)


def _compile_or_run(kernel: triton.JITFunction, grid: tuple[int, ...], args: tuple[object, ...],
                    kwargs: dict[str, object], amd: dict[str, int]) -> None:
    if _COMPILE_ONLY.get():
        standin.prepare(kernel.warmup(*args, grid=grid, **kwargs), amd)
    else:
        standin.hold(kernel[grid](*args, **kwargs), amd)


@cache
def _block_pingpong_fails(arch: str) -> bool:
    """Whether fp8 launches for AMD `arch` (the GPU's, or the one target mode's hold compiles
    for) compile without Triton's AMD block-pingpong pass: on gfx950 from Triton 3.8 on, that
    pass fails on the fp8 gate/up kernel ("PassManager::run failed"); 3.6 and 3.7 compile it
    with the pass. Seen by compiling every kernel for gfx942 and gfx950 on a machine without a
    GPU (tests/test_triton_amd_compile.py)."""
    version = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    return arch == "gfx950" and version >= PINGPONG_FAILS_FROM


@dataclass(frozen=True)
class Alignment:
    """Routes sorted by local expert, padded per expert to block_m (kernels.align_*_kernel)."""

    sorted_routes: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    num_padded: torch.Tensor
    num_blocks: int  # an upper bound, fixed by the shapes


def align(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int, block_m: int) -> Alignment:
    routes = topk_ids.numel()
    num_blocks = routes // block_m + min(routes, num_local) + 1
    dev = topk_ids.device
    out = Alignment(
        torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev),
        torch.empty(num_blocks, dtype=torch.int32, device=dev),
        torch.empty(num_blocks, dtype=torch.int32, device=dev),
        torch.empty(1, dtype=torch.int32, device=dev),
        num_blocks,
    )
    e_pad = triton.next_power_of_2(num_local)
    chunk = align_chunk(routes)
    chunks = triton.cdiv(routes, chunk)
    counts = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
    cursor = torch.empty(chunks, e_pad, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    emap = ids if expert_map is None else expert_map
    has_map = expert_map is not None
    _launch(kernels.align_count_kernel, (chunks,), ids, emap, counts, routes,
            HAS_MAP=has_map, E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    _launch(
        kernels.align_scatter_kernel, (chunks,),
        ids, emap, counts, cursor, out.sorted_routes, out.block_expert, out.block_rows, out.num_padded, routes,
        HAS_MAP=has_map, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, ROWS=ALIGN_TABLE_ROWS, num_warps=8,
    )
    return out


def align_chunk(routes: int) -> int:
    """Routes per sort program: about ALIGN_PROGRAMS programs, within ALIGN_CHUNKS. A count
    program's histogram costs it time in proportion to its routes times the experts (Triton's
    warp-level histogram: each lane tests every route against its share of the bins), so one
    program of 4096 routes held the whole of a small call (Kimi-K3 M=128: 2048 routes, 896
    experts); each scatter program reads the whole count table (programs x experts), so not
    thousands of programs either."""
    return min(ALIGN_CHUNKS[1], max(ALIGN_CHUNKS[0], triton.next_power_of_2(triton.cdiv(routes, ALIGN_PROGRAMS))))


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's allocator hook: device scratch for the tensor descriptors a kernel makes (on
    Hopper, one TMA descriptor per program); from torch's caching allocator, so it is
    captured in CUDA graphs like every other buffer."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def weight_descriptors(weight: torch.Tensor) -> bool:
    """Whether a kernel can read `weight` (`[E, N, K]`) through one 2-D tensor descriptor over
    `[E * N, K]`: contiguous, with 16-byte aligned base and rows (a TMA's rules on Hopper),
    on a Triton that has them."""
    return (hasattr(tl, "make_tensor_descriptor") and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and weight.stride(1) * weight.element_size() % 16 == 0 and weight.shape[0] * weight.shape[1] < 2**31)


def _descriptors(step: Step, weight: torch.Tensor) -> bool:
    """Whether this launch reads its weight tiles through descriptors: its plan says so and the
    weight allows. Then installs the scratch allocator the kernel's descriptors need."""
    if not (step.descriptors and weight_descriptors(weight)):
        return False
    install_descriptor_scratch()
    return True


def install_descriptor_scratch() -> None:
    """Device scratch for the tensor descriptors kernels make (_descriptor_scratch)."""
    triton.set_allocator(_descriptor_scratch)


def _scale_args(scale: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(tensor, expert stride, row stride) of a canonical scale; the weight stands in when none."""
    if scale is None:
        return weight, 0, 0
    scale = scale.contiguous()
    return scale, scale.stride(0), scale.stride(1) if scale.dim() > 1 else 0


@dataclass(frozen=True)
class TinyOut:
    """Tiny mode's gate/up output: the fp32 activation `[routes, I]` that down_tiny reads, and
    room for the fp32 partial sums `[split_k, routes, 2I]` of a K split (kernels._tiny_store)."""

    act: torch.Tensor
    partials: torch.Tensor

    @classmethod
    def empty(cls, routes: int, inter: int, split_k: int, device: torch.device) -> TinyOut:
        """Room for any launch of up to `split_k` K splits."""
        return cls(torch.empty(routes, inter, dtype=torch.float32, device=device),
                   torch.empty(split_k, routes, 2 * inter, dtype=torch.float32, device=device))

    def split(self, programs: int, split_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the partial sums, the arrival counts) of a launch of `programs` N tiles split
        `split_k` ways (_arrival_counts)."""
        if split_k > self.partials.shape[0]:
            raise ValueError(f"tiny gate/up scratch holds {self.partials.shape[0]} K splits, not {split_k}")
        return self.partials[:split_k], _arrival_counts(programs, split_k, self.act.device)


_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def _arrival_counts(programs: int, split_k: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counts for a tiny launch of `programs` tiles, each split `split_k`
    ways (kernels._last_to_arrive: the gate/up's K, the down's routes). Its programs leave them
    zero (the last of each tile resets its count), so one buffer per device serves every launch
    after it with no memset (zeroing 400 counts took 2-4 us a launch in an H200 CUDA graph; the
    down reuses the counts its gate/up left zero). A buffer once handed out
    stays allocated, as a captured graph keeps its address. While a graph is being captured a
    buffer too small is not replaced: the graph gets a zeroed one of its own. Launches that run
    at once on two streams of a device would share the counts: tiny mode serves a few routes,
    which no such overlap splits."""
    buffers = _ARRIVALS.setdefault(device, [])
    if buffers and (split_k == 1 or buffers[-1].numel() >= programs):
        return buffers[-1][:programs]  # unsplit launches read none: any buffer stands in
    counts = torch.zeros(max(programs, 1024), dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        buffers.append(counts)
    return counts[:programs]


def plan_for(layer: Layer, config: LaunchConfig, tiny: bool) -> Plan:
    """The plan of `layer` under `config` on the target Triton compiles for now."""
    return make_plan(layer, config, tiny, current_target())


def call_plan(layer: Layer, device: torch.device, num_tokens: int) -> Plan:
    """The plan of a call of `num_tokens` tokens: the launch table's entry for the target
    Triton compiles for now (target mode: the one it stands in for)."""
    target = current_target()
    config = launch_config(layer.shape, device, num_tokens, target)
    return make_plan(layer, config, is_tiny(num_tokens, layer.shape.top_k), target)


def _gate_up_gluon(x: torch.Tensor, x_scale: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   topk_weights: torch.Tensor, alignment: Alignment, layer: Layer, plan: Plan,
                   out: torch.Tensor) -> None:
    cfg = plan.gate_up.config
    scale, stride_se, stride_sn = _scale_args(w13_scale, w13)
    grid = (alignment.num_blocks * (layer.shape.inter // cfg.block_n),)
    rows = (alignment.sorted_routes, alignment.block_expert, alignment.block_rows, alignment.num_padded)
    if plan.gate_up.kernel == GLUON_MX:
        _launch(
            gluon_kernels.gate_up_mx_words_kernel, grid,
            x, w13, scale, out, topk_weights, *rows, alignment.num_blocks, layer.shape.inter, layer.shape.hidden,
            layer.shape.top_k, x.stride(0), w13.stride(0), stride_se, stride_sn, out.stride(0), layer.beta,
            layer.linear_beta,
            WEIGHT_ON_INPUT=layer.weight_on_input, ACTIVATION=ACTIVATIONS[layer.activation],
            BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            STAGES=cfg.num_stages, **gluon_kernels.mx_layouts(cfg.block_n, plan.block_m, cfg.block_k), num_warps=4,
        )
        return
    _launch(
        gluon_kernels.gate_up_block_fp8_kernel, grid,
        x, x_scale, w13, scale, out, topk_weights, *rows, layer.shape.inter, layer.shape.hidden, layer.shape.top_k,
        x.stride(0), x_scale.stride(0), w13.stride(0), w13.stride(1), stride_se, stride_sn, out.stride(0),
        layer.beta, layer.linear_beta,
        WEIGHT_ON_INPUT=layer.weight_on_input, ACTIVATION=ACTIVATIONS[layer.activation], BLOCK_N=cfg.block_n,
        BLOCK_K=QUANT_GROUP, STAGES=cfg.num_stages, num_warps=4,
    )


def gate_up(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, alignment: Alignment | None,
    layer: Layer, plan: Plan, out: torch.Tensor | TinyOut,
) -> None:
    """act(x @ w13^T) into `out` by padded sorted position; in tiny mode (no alignment, `out`
    a TinyOut), into `out.act` by route, in fp32. The plan's gate/up step says which kernel."""
    step = plan.gate_up
    cfg = step.config
    inter = layer.shape.inter
    ids = topk_ids.reshape(-1)
    tiny = plan.tiny
    if step.kernel == GEMV:
        _gate_up_gemv(x, w13, w13_scale, topk_weights, ids, expert_map, layer, cfg, out, plan.pdl)
        return
    if step.kernel == GLUON_MX_TINY:
        _gate_up_gluon_tiny(x, w13, w13_scale, topk_weights, ids, expert_map, layer, plan, out)
        return
    num_blocks = ids.numel() if tiny else alignment.num_blocks
    sorted_args = (ids, ids, ids, ids) if tiny else (
        alignment.sorted_routes, alignment.block_expert, alignment.block_rows, alignment.num_padded)
    scale, stride_se, stride_sn = _scale_args(w13_scale, w13)
    fp8, fp8_max = _fp8_args(w13)
    a_fp8 = step.quantise_first
    a_fmt = A_FORMATS[x.dtype]
    if a_fp8:
        x, x_scale = quantize_groups(x, w13.dtype, per_token=layer.per_token)
    elif layer.mx_units:
        x, x_scale = fp16_rows(x)
    else:
        x_scale = x
    if step.kernel in (GLUON_MX, GLUON_BLOCK_FP8):
        _gate_up_gluon(x, x_scale, w13, w13_scale, topk_weights, alignment, layer, plan, out)
        return
    split_k = cfg.split_k if tiny else 1
    grid = (num_blocks * triton.cdiv(inter, cfg.block_n), split_k)
    if tiny:
        (dest, counts), act = out.split(grid[0], split_k), out.act
    else:
        dest, counts, act = out, out, out
    tile_m, tile_m2 = row_tiles(plan.block_m)
    _launch(
        kernels.gate_up_kernel, grid,
        x, x_scale, w13, scale, dest, act, counts, topk_weights, ids, ids if expert_map is None else expert_map,
        *sorted_args,
        ids.numel(), num_blocks, w13.shape[0], inter, layer.shape.hidden, layer.shape.top_k,
        x.stride(0), x_scale.stride(0), w13.stride(0), w13.stride(1), stride_se, stride_sn, dest.stride(-2),
        dest.stride(0), layer.beta, layer.linear_beta,
        TINY=tiny, HAS_MAP=expert_map is not None, WEIGHT_ON_INPUT=layer.weight_on_input,
        INTERLEAVED=layer.shape.interleaved,
        W_DESC=_descriptors(step, w13), PDL=plan.pdl,
        ACTIVATION=ACTIVATIONS[layer.activation], W_QUANT=layer.w_quant, FP8=fp8, FP8_MAX=fp8_max,
        A_FP8=a_fp8, A_FMT=a_fmt, PACK=layer.gate_up_pack, MX_WORDS=layer.mx_words, MX_DEQUANT=step.mx_dequant,
        ONE_SCALE=_one_block_scale(layer, cfg.block_n, inter), W_LEFT=step.weight_left,
        BLOCK_M=plan.block_m, TILE_M=tile_m, TILE_M2=tile_m2,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT_K=split_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, target=plan.target, kpack=step.kpack,
    )


def _gate_up_gluon_tiny(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, topk_weights: torch.Tensor,
                        ids: torch.Tensor, expert_map: torch.Tensor | None, layer: Layer, plan: Plan,
                        out: TinyOut) -> None:
    """Tiny gate/up of mx_words in gluon_kernels.gate_up_mx_words_tiny_kernel: a program per
    (route slot, N tile) and K split, as kernels.gate_up_kernel's tiny grid."""
    cfg = plan.gate_up.config
    scale, stride_se, stride_sn = _scale_args(w13_scale, w13)
    grid = (ids.numel() * (layer.shape.inter // cfg.block_n), cfg.split_k)
    partials, counts = out.split(grid[0], cfg.split_k)
    _launch(
        gluon_kernels.gate_up_mx_words_tiny_kernel, grid,
        x, w13, scale, partials, out.act, counts, topk_weights, ids, ids if expert_map is None else expert_map,
        ids.numel(), layer.shape.inter, layer.shape.hidden, layer.shape.top_k, x.stride(0), w13.stride(0), stride_se,
        stride_sn, partials.stride(0), layer.beta, layer.linear_beta,
        HAS_MAP=expert_map is not None, WEIGHT_ON_INPUT=layer.weight_on_input, ACTIVATION=ACTIVATIONS[layer.activation],
        PDL=plan.pdl, BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        STAGES=cfg.num_stages, **gluon_kernels.mx_layouts(cfg.block_n, plan.block_m, cfg.block_k), num_warps=4,
    )


def _gate_up_gemv(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, topk_weights: torch.Tensor,
    ids: torch.Tensor, expert_map: torch.Tensor | None, layer: Layer, cfg: KernelConfig, out: TinyOut, pdl: bool,
) -> None:
    """Tiny gate/up as a matrix-vector product per route (kernels.gate_up_gemv_kernel)."""
    if layer.shape.fp8 and cfg.block_k not in FP8_GEMV_STEPS:
        raise ValueError(f"the fp8 gemv gate/up steps one or two {QUANT_GROUP}-wide groups, not {cfg.block_k}")
    scale, stride_se, stride_sn = _scale_args(w13_scale, w13)
    fp8, fp8_max = _fp8_args(w13)
    grid = (ids.numel() * triton.cdiv(layer.shape.inter, cfg.block_n), cfg.split_k)
    partials, counts = out.split(grid[0], cfg.split_k)
    _launch(
        kernels.gate_up_gemv_kernel, grid,
        x, w13, scale, partials, out.act, counts, topk_weights, ids, ids if expert_map is None else expert_map,
        layer.shape.inter, layer.shape.hidden, layer.shape.top_k,
        x.stride(0), w13.stride(0), w13.stride(1), stride_se, stride_sn, partials.stride(0), layer.beta,
        layer.linear_beta,
        HAS_MAP=expert_map is not None, WEIGHT_ON_INPUT=layer.weight_on_input, ACTIVATION=ACTIVATIONS[layer.activation],
        W_QUANT=layer.w_quant, FP8=fp8, FP8_MAX=fp8_max, A_TOKEN=layer.per_token, MX_WORDS=layer.mx_words,
        MX_UNITS=layer.mx_units, PDL=pdl, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def down(
    a: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor | None, topk_weights: torch.Tensor,
    alignment: Alignment, layer: Layer, plan: Plan, out: torch.Tensor,
) -> None:
    """General mode: one output row per route (`out` is `[routes, H]`, or `[M, H]` when top_k is 1),
    by the plan's down step: down_kernel a program per output tile, or streamed over N tiles
    (mx_words on Hopper: gluon_kernels' where the entry says so), or the resident down."""
    step = plan.down
    cfg = step.config
    scale, stride_se, stride_sn = _scale_args(w2_scale, w2)
    a_fp8 = step.quantise_first
    a_fmt = A_FORMATS[a.dtype]
    a, a_scale = quantize_groups(a, w2.dtype, alignment.num_padded, layer.per_token) if a_fp8 else (a, a)
    tile_m, tiles_m = _down_row_tiles(plan, alignment)
    rows = (alignment.sorted_routes, alignment.block_expert, alignment.block_rows, alignment.num_padded)
    if step.kernel == RESIDENT:
        k_low, k_high = (QUANT_GROUP, 0) if a_fp8 else resident_k(layer.shape.inter)
        _launch(
            kernels.down_resident_kernel, (tiles_m * cfg.n_split,),
            a, a_scale, w2, scale, out, topk_weights, *rows,
            w2.shape[0], layer.shape.hidden, layer.shape.inter,
            a.stride(0), a_scale.stride(0), w2.stride(0), w2.stride(1), stride_se, stride_sn, out.stride(0),
            WEIGHT_ON_INPUT=layer.weight_on_input, W_DESC=_descriptors(step, w2),
            FP8_STEPS=triton.cdiv(layer.shape.inter, QUANT_GROUP) if a_fp8 else 0,
            ONE_SCALE=_one_block_scale(layer, cfg.block_n, 0), W_LEFT=step.weight_left,
            N_SPLIT=cfg.n_split, BLOCK_M=plan.block_m, TILE_M=tile_m, BLOCK_N=cfg.block_n, K_LO=k_low, K_HI=k_high,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, target=plan.target, kpack=step.kpack,
        )
        return
    if step.kernel == GLUON_MX:
        _launch(
            gluon_kernels.down_mx_words_kernel, (tiles_m * cfg.n_split,),
            a, w2, scale, out, topk_weights, *rows, layer.shape.hidden, layer.shape.inter,
            a.stride(0), w2.stride(0), stride_se, stride_sn, out.stride(0),
            WEIGHT_ON_INPUT=layer.weight_on_input, BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, N_SPLIT=cfg.n_split, STAGES=cfg.num_stages,
            **gluon_kernels.mx_layouts(cfg.block_n // 2, plan.block_m, cfg.block_k), num_warps=4,
        )
        return
    fp8, fp8_max = _fp8_args(w2)
    grid = (tiles_m * (cfg.n_split or triton.cdiv(layer.shape.hidden, cfg.block_n)),)
    _launch(
        kernels.down_kernel, grid,
        a, a_scale, w2, scale, out, topk_weights, *rows,
        tiles_m, w2.shape[0], layer.shape.hidden, layer.shape.inter,
        a.stride(0), a_scale.stride(0), w2.stride(0), w2.stride(1), stride_se, stride_sn, out.stride(0),
        WEIGHT_ON_INPUT=layer.weight_on_input, W_QUANT=layer.w_quant,
        FP8=fp8, FP8_MAX=fp8_max, A_FP8=a_fp8, A_FMT=a_fmt, PACK=layer.down_pack,
        MX_WORDS=layer.mx_words, MX_DEQUANT=step.mx_dequant, W_DESC=_descriptors(step, w2),
        ONE_SCALE=_one_block_scale(layer, cfg.block_n, 0), W_LEFT=step.weight_left,
        N_SPLIT=cfg.n_split, BLOCK_M=plan.block_m, TILE_M=tile_m, TILE_M2=step.tile_m2, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        target=plan.target, kpack=step.kpack,
    )


def _one_block_scale(layer: Layer, block_n: int, first_row: int) -> bool:
    """Whether every N tile of fp8 block weights whose rows start at `first_row` (up: after
    the I gate rows) lies in one 128-row scale block: then a K step has one weight scale."""
    return layer.granularity == "block" and kernels.SCALE_BLOCK.value % block_n == 0 and first_row % block_n == 0


def _down_row_tiles(plan: Plan, alignment: Alignment) -> tuple[int, int]:
    """(a down program's first row tile, programs along M): a block is one tile, or three
    (down_tile), or two whose program takes them both (the step's tile_m2)."""
    tile_m, _ = down_tiles(plan.block_m, bool(plan.down.tile_m2))
    return tile_m, alignment.num_blocks * (plan.block_m // tile_m)


def down_tiny(
    act: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor | None, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, layer: Layer, plan: Plan,
    out: torch.Tensor,
) -> None:
    """Tiny mode: down projection of tiny gate/up's fp32 activation `[routes, I]` and the top-k
    sum straight into `out` `[M, H]`; the entry's split_k programs share each token's routes.
    kernels.down_tiny_kernel, or by the plan gluon_kernels' one-token mx_words down."""
    cfg = plan.down.config
    scale, stride_se, stride_sn = _scale_args(w2_scale, w2)
    fp8, fp8_max = _fp8_args(w2)
    ids = topk_ids.reshape(-1)
    routes, split = tiny_route_split(layer.shape.top_k, cfg.split_k)
    grid = (out.shape[0], triton.cdiv(layer.shape.hidden, cfg.block_n), split)
    partials = torch.empty(split, *out.shape, dtype=torch.float32, device=out.device) if split > 1 else out
    pdl = plan.pdl
    if plan.down.kernel == GLUON_MX_TINY:  # its N tiles divide H: the grid above
        _launch(
            gluon_kernels.down_mx_words_tiny_kernel, grid,
            act, w2, scale, out, partials, _arrival_counts(grid[0] * grid[1], split, out.device), topk_weights, ids,
            ids if expert_map is None else expert_map, layer.shape.hidden, layer.shape.inter, layer.shape.top_k,
            w2.stride(0), stride_se, stride_sn, out.stride(0), out.numel(),
            HAS_MAP=expert_map is not None, WEIGHT_ON_INPUT=layer.weight_on_input, PDL=pdl, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, ROUTES=routes, ROUTE_SPLIT=split, K_STEPS=layer.shape.inter // cfg.block_k,
            STAGES=cfg.num_stages, COLS=TINY_DOWN_COLUMNS,
            **gluon_kernels.mx_layouts(cfg.block_n // 2, TINY_DOWN_COLUMNS, cfg.block_k),
            num_warps=4, **({"launch_pdl": True} if pdl else {}),
        )
        return
    _launch(
        kernels.down_tiny_kernel, grid,
        act, w2, scale, out, partials, _arrival_counts(grid[0] * grid[1], split, out.device), topk_weights, ids,
        ids if expert_map is None else expert_map,
        layer.shape.hidden, layer.shape.inter, layer.shape.top_k,
        w2.stride(0), w2.stride(1), stride_se, stride_sn, out.stride(0), out.numel(),
        HAS_MAP=expert_map is not None, WEIGHT_ON_INPUT=layer.weight_on_input,
        W_QUANT=layer.w_quant, FP8=fp8, FP8_MAX=fp8_max, A_TOKEN=layer.per_token, MX_WORDS=layer.mx_words,
        MX_UNITS=layer.down_units, PDL=pdl,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_PAD=routes, ROUTE_SPLIT=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
    )


def sum_routes(routes: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
               out: torch.Tensor) -> None:
    num_tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    ids = topk_ids.reshape(-1)
    _launch(
        kernels.sum_routes_kernel, (num_tokens, triton.cdiv(hidden, REDUCE_BLOCK_H)),
        routes, out, ids, ids if expert_map is None else expert_map, hidden, top_k,
        HAS_MAP=expert_map is not None, K_PAD=triton.next_power_of_2(top_k), BLOCK_H=REDUCE_BLOCK_H,
        num_warps=4,
    )


def quantize_groups(src: torch.Tensor, fp8_dtype: torch.dtype, limit: torch.Tensor | None = None,
                    per_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 `[rows, cols]`, fp32 scales `[rows, groups]`) of `src`, a dynamic scale per row and
    QUANT_GROUP columns (kernels._quantize_rows), or per_token: the row's scale over all its
    columns, repeated in each group (so the GEMMs read both alike; one launch, a program per
    row); rows from `limit` (a device count) on are left unset."""
    rows, cols = src.shape
    groups = triton.cdiv(cols, QUANT_GROUP)
    q = torch.empty(rows, cols, dtype=fp8_dtype, device=src.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=src.device)
    fp8, fp8_max = _fp8_args(q)
    args = (src, q, scale, scale if limit is None else limit, rows, cols, src.stride(0), q.stride(0), scale.stride(0))
    if per_token:
        block_c = max(triton.next_power_of_2(cols), QUANT_GROUP)
        _launch(kernels.quantize_tokens_kernel, (rows,), *args, FP8=fp8, FP8_MAX=fp8_max, LIMITED=limit is not None,
                BLOCK_C=block_c, GROUP=QUANT_GROUP, POWER_OF_TWO=False, num_warps=_row_warps(block_c))
    else:
        _launch(kernels.quantize_groups_kernel, (triton.cdiv(rows, QUANT_ROWS), groups), *args,
                FP8=fp8, FP8_MAX=fp8_max, LIMITED=limit is not None, ROWS=QUANT_ROWS, GROUP=QUANT_GROUP, num_warps=4)
    return q, scale


def fp16_rows(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 `[rows, cols]`, fp32 `[rows, 1]`) of bf16 or fp16 `src`: each row divided by the
    power of two that puts its largest value in (2^14, 2^15] (kernels.quantize_tokens_kernel),
    so a row past fp16's 65504 fits and bf16's values stay exact down to 2^-29 of the row's
    largest; the mx_units gate/up's activations, its epilogue multiplying the rows back."""
    rows, cols = src.shape
    q = torch.empty(rows, cols, dtype=torch.float16, device=src.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=src.device)
    block_c = triton.next_power_of_2(cols)
    _launch(kernels.quantize_tokens_kernel, (rows,), src, q, scale, scale, rows, cols, src.stride(0), q.stride(0),
            scale.stride(0), FP8=tl.float16, FP8_MAX=FP16_ROW_MAX, LIMITED=False, BLOCK_C=block_c, GROUP=block_c,
            POWER_OF_TWO=True, num_warps=_row_warps(block_c))
    return q, scale


def _row_warps(block_c: int) -> int:
    """Warps of a program that loads a whole row of `block_c` columns."""
    return min(16, max(4, block_c // 512))


def _fp8_args(weight: torch.Tensor) -> tuple[object, float]:
    """The kernel's fp8 type and largest value: the weights' physical flavour (fnuz on gfx942)."""
    if weight.dtype not in FP8_TL:
        return tl.float8e4nv, 448.0  # unused: no fp8 in this specialisation
    return FP8_TL[weight.dtype], float(torch.finfo(weight.dtype).max)


def fused_experts(
    layer: Layer, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The whole layer: sort, gate/up + activation, down + routing weight, top-k sum, as the
    plan of the launch table's entry (or `config`) on the current target says."""
    num_tokens, top_k = topk_ids.shape
    plan = plan_for(layer, config, is_tiny(num_tokens, top_k)) if config else call_plan(layer, x.device, num_tokens)
    x = x.contiguous()
    hidden, inter = layer.shape.hidden, layer.shape.inter
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if plan.tiny:
        tiny = TinyOut.empty(num_tokens * top_k, inter, plan.gate_up.config.split_k, x.device)
        gate_up(x, w13, w13_scale, topk_weights, topk_ids, expert_map, None, layer, plan, tiny)
        down_tiny(tiny.act, w2, w2_scale, topk_weights, topk_ids, expert_map, layer, plan, out)
        return out
    alignment = align(topk_ids, expert_map, layer.shape.experts, plan.block_m)
    act = torch.empty(alignment.num_blocks * plan.block_m, inter, dtype=layer.act_dtype(x.dtype), device=x.device)
    gate_up(x, w13, w13_scale, topk_weights, topk_ids, expert_map, alignment, layer, plan, act)
    down_and_sum(act, w2, w2_scale, topk_weights, topk_ids, expert_map, alignment, layer, plan, out)
    return out


def down_and_sum(
    act: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor | None, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, alignment: Alignment, layer: Layer,
    plan: Plan, out: torch.Tensor,
) -> None:
    """General mode after gate/up: the down projection and the top-k sum into `out` `[M, H]`."""
    num_tokens, top_k = topk_ids.shape
    if top_k == 1:
        if expert_map is not None:
            out.zero_()  # tokens routed off this rank get no row written
        down(act, w2, w2_scale, topk_weights, alignment, layer, plan, out)
    else:
        routes = torch.empty(num_tokens * top_k, out.shape[1], dtype=out.dtype, device=out.device)
        down(act, w2, w2_scale, topk_weights, alignment, layer, plan, routes)
        sum_routes(routes, topk_ids, expert_map, out)
