"""A layer's launch as one plan, made once per (target, layer, launch config, tiny or not):
which kernel runs each GEMM, with which tiles, and which of the target's features it uses.
The launchers (launch.py) follow the plan and ask nothing again; `moe-overlay tune --explain`
and the benchmark print it.

What a target can do is target.py's; this module only combines it with the layer and the
launch-table entry. NVIDIA-only kernels (gluon_kernels.py) and features (programmatic
dependent launch, tensor descriptors, weight-left wgmma dots) are chosen only where the target
is Hopper and the entry asks for them; every other target runs the portable `tl` kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton.language as tl

from . import kernels
from .configs import (
    GLUON_BLOCK_M,
    GLUON_MX_BLOCK_KS,
    GLUON_MX_BLOCK_MS,
    TINY_DOWN_COLUMNS,
    KernelConfig,
    LaunchConfig,
    LayerShape,
    down_tiles,
    row_tiles,
    tiny_route_split,
    weights_tag,
    with_dot_warps,
)
from .target import Target

try:
    from . import gluon_kernels
except (ImportError, AttributeError):  # a Triton without Gluon's Hopper calls: the `tl` kernels run everything
    gluon_kernels = None

QUANT_GROUP: int = kernels.SCALE_BLOCK.value  # w8a8 activations: a dynamic scale per row and group, the fp8 K step
FP8_TL = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e4m3fnuz: tl.float8e4b8}
W_QUANT = {None: kernels.W_NONE, "tensor": kernels.W_TENSOR, "channel": kernels.W_CHANNEL, "block": kernels.W_BLOCK}

# The kernels a step can run (Step.kernel).
GATE_UP = "gate_up"  # kernels.gate_up_kernel: sorted blocks, or tiny mode's route slots
GEMV = "gemv"  # kernels.gate_up_gemv_kernel: tiny mode, a matrix-vector product per route
GLUON_BLOCK_FP8 = "gluon block-fp8"  # gluon_kernels.gate_up_block_fp8_kernel
GLUON_MX = "gluon mx_words"  # gluon_kernels.gate_up_mx_words_kernel / down_mx_words_kernel
GLUON_MX_TINY = "gluon mx_words tiny"  # gluon_kernels.gate_up_mx_words_tiny_kernel / down_mx_words_tiny_kernel
DOWN_TINY = "tiny"  # kernels.down_tiny_kernel
TILED = "tiled"  # kernels.down_kernel, a program per output tile
STREAMED = "streamed"  # kernels.down_kernel, n_split programs a row tile walking the N tiles
RESIDENT = "resident"  # kernels.down_resident_kernel


@dataclass(frozen=True)
class Layer:
    """What the kernels need to know of a layer beyond its tensors."""

    shape: LayerShape
    activation: str = "silu"
    beta: float = 1.0  # SiTU's two betas
    linear_beta: float = 1.0
    weight_on_input: bool = False
    granularity: str | None = None  # fp8 weight scales: tensor, channel or block
    per_token: bool = False  # w8a8 activations: a dynamic scale per token (row), not per 1x128 group
    mx_words: bool = False  # mxfp4 recoded into int32 words (layout.mx_words), not packed bytes
    mx_units: bool = False  # mxfp4 gate/up weights as int16 units (layout.mx_units), not packed bytes
    down_units: bool = False  # mxfp4 down weights as int16 units, its input fp16 (launch.fused_experts)

    @classmethod
    def of(cls, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, activation: str,
           params: list[float], weight_on_input: bool, granularity: str | None, per_token: bool = False) -> Layer:
        weights = weights_tag(w13.dtype, granularity if w13.dtype in FP8_TL else None)
        shape = LayerShape(w13.shape[0], x.shape[1], w13.shape[1] // 2, top_k, weights)
        beta, linear_beta = params if activation == "situ" else (1.0, 1.0)
        return cls(shape, activation, beta, linear_beta, weight_on_input, granularity, per_token,
                   w13.dtype == torch.int32, w13.dtype == torch.int16, w2.dtype == torch.int16)

    @property
    def w_quant(self) -> object:
        """The kernels' W_QUANT: fp8 by scale granularity, or mxfp4."""
        return kernels.W_MXFP4 if self.shape.weights == "mxfp4" else W_QUANT[self.granularity]

    def pack(self, units: bool) -> int:
        """Weight values per stored element along K (mxfp4: two e2m1 per byte, eight per word,
        four per unit) of the gate/up's weights (`units`: mx_units) or the down's (down_units)."""
        if self.shape.weights != "mxfp4":
            return 1
        return kernels.MX_UNIT_PACK.value if units else 8 if self.mx_words else 2

    @property
    def gate_up_pack(self) -> int:
        return self.pack(self.mx_units)

    @property
    def down_pack(self) -> int:
        return self.pack(self.down_units)

    def act_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Sorted mode's gate/up output, the down's input, for activations of `dtype`: fp16 for
        down_units' fp16 dots (SiTU bounds it), else `dtype`."""
        return torch.float16 if self.down_units else dtype


@dataclass(frozen=True)
class Step:
    """One GEMM's launch: its kernel and tiles, and the features it uses."""

    kernel: str
    config: KernelConfig
    quantise_first: bool = False  # w8a8: activations quantised per row and group by a launch before it
    weight_left: bool = False  # fp8 dots with the weight tile as the left operand (wgmma's M)
    descriptors: bool = False  # weight tiles through tensor descriptors, where the weight tensor allows
    kpack: int = 1  # the dots' kpack (target.Target.kpack), a compile option where Triton compiles for AMD
    mx_dequant: bool = False  # mxfp4 packed bytes decoded to bf16 once a program (KernelConfig.mx_dequant)
    tile_m2: int = 0  # the down kernel: a program's second row tile, a whole block a program (KernelConfig.whole_block)

    def describe(self) -> str:
        c = self.config
        tiles = f"N {c.block_n} K {c.block_k}, {c.num_warps} warps, {c.num_stages} stages"
        extra = [f"K split {c.split_k}" if c.split_k > 1 and self.kernel in (GATE_UP, GEMV, GLUON_MX_TINY) else "",
                 f"{c.split_k} programs a token" if c.split_k > 1 and self.kernel == DOWN_TINY else "",
                 f"{c.n_split} programs a row tile" if c.n_split else "",
                 f"group {c.group_m}" if c.group_m > 1 else "",
                 "activations quantised first" * self.quantise_first, "weight-left dots" * self.weight_left,
                 "tensor descriptors" * self.descriptors, "weights decoded to bf16 a program" * self.mx_dequant,
                 "a whole block a program" * bool(self.tile_m2),
                 f"kpack {self.kpack}" if self.kpack > 1 else ""]
        return f"{self.kernel} ({', '.join([tiles, *filter(None, extra)])})"


@dataclass(frozen=True)
class Plan:
    target: Target
    block_m: int
    tiny: bool
    gate_up: Step
    down: Step
    pdl: bool = False  # tiny mode: the down started while its gate/up runs (programmatic dependent launch)

    def describe(self) -> str:
        mode = "tiny mode (no sort)" if self.tiny else f"sorted blocks of {self.block_m}"
        return (f"{self.target.arch}, {mode}: gate/up {self.gate_up.describe()}; down {self.down.describe()}"
                + ("; PDL" if self.pdl else ""))


def make_plan(layer: Layer, config: LaunchConfig, tiny: bool, target: Target) -> Plan:
    """The plan of `layer` under `config` on `target` (remembered: asked on every call)."""
    return _plan(layer, config, tiny, target)


@lru_cache(maxsize=4096)
def _plan(layer: Layer, config: LaunchConfig, tiny: bool, target: Target) -> Plan:
    gate_up = _gate_up_step(layer, config, tiny, target)
    down = _down_step(layer, config, tiny, target)
    return Plan(target, config.block_m, tiny, gate_up, down, pdl=tiny and config.down.pdl and target.hopper)


def quantise_first(layer: Layer, block_k: int) -> bool:
    """Whether a sorted-mode w8a8 kernel gets its activations quantised by quantize_groups
    beforehand: once per row and group, where its main loop would quantise each K step
    again for every N tile (half of fp8 gate/up's time at M=8192 on an H200). Only when its K
    step is the group (fp8 launches always step one group); tiny mode quantises in the loop
    (one row per route, a few N tiles), except per-token activations (a row's scale needs all
    of it first)."""
    return layer.shape.fp8 and block_k == QUANT_GROUP


def _weight_left(layer: Layer, cfg: KernelConfig, rows: int, target: Target) -> bool:
    """w8a8 dots of `rows`-row activation tiles take the weight tile as their left operand
    (nvidia.fp8_dot): the entry asks (the tuner times both), the tile has under the 64 rows
    of a warpgroup's wgmma (Triton would convert both fp8 tiles to fp16 for mma.sync dots), on
    Hopper: not on AMD, whose fp8 matrix instructions take 16 rows."""
    return cfg.weight_left and layer.shape.fp8 and rows < 64 and target.hopper


def _mx_dequant(layer: Layer, cfg: KernelConfig) -> bool:
    """mxfp4 packed bytes decoded to bf16 by the program before a plain dot: where the entry asks."""
    return cfg.mx_dequant and layer.shape.weights == "mxfp4" and not layer.mx_words


def _kpack(cfg: KernelConfig, target: Target) -> int:
    """The `tl` dot kernels' kpack: the entry's, else the target's; 1 where the target has none."""
    return (cfg.kpack or target.kpack) if target.kpack > 1 else 1


def _gluon(cfg: KernelConfig, target: Target) -> bool:
    """The entry asks for Gluon with the kernels' one warpgroup (4 warps), on Hopper with a
    Triton that has Gluon's Hopper calls."""
    return cfg.gluon and gluon_kernels is not None and cfg.num_warps == 4 and target.hopper


def _gate_up_step(layer: Layer, config: LaunchConfig, tiny: bool, target: Target) -> Step:
    cfg = config.gate_up
    _refuse_units_steps(layer.mx_units, cfg)
    if tiny and cfg.gemv:
        return Step(GEMV, cfg)
    first = (not tiny or layer.per_token) and quantise_first(layer, cfg.block_k)
    if _gluon(cfg, target) and not cfg.gemv:
        if layer.mx_words and _gluon_mx_words_fits(config.block_m, cfg, layer.shape.inter, layer.shape.hidden, 1) \
                and (not tiny or layer.shape.hidden // cfg.block_k % cfg.split_k == 0):
            return Step(GLUON_MX_TINY if tiny else GLUON_MX, cfg)
        if not tiny and first and _gluon_block_fp8_fits(layer, config):
            return Step(GLUON_BLOCK_FP8, cfg, quantise_first=True)
    tile_m, tile_m2 = row_tiles(config.block_m)
    cfg = with_dot_warps(cfg, config.block_m, layer.shape, target, gate_up=True)
    return Step(GATE_UP, cfg, quantise_first=first, weight_left=_weight_left(layer, cfg, tile_m2 or tile_m, target),
                descriptors=cfg.descriptors and layer.shape.interleaved and target.hopper, kpack=_kpack(cfg, target),
                mx_dequant=_mx_dequant(layer, cfg) and not layer.mx_units)


def _down_step(layer: Layer, config: LaunchConfig, tiny: bool, target: Target) -> Step:
    cfg = config.down
    _refuse_units_steps(layer.down_units, cfg)
    if tiny:
        routes, _ = tiny_route_split(layer.shape.top_k, cfg.split_k)
        gluon = (layer.mx_words and _gluon(cfg, target) and routes <= TINY_DOWN_COLUMNS
                 and layer.shape.inter >= 2 * cfg.block_k
                 and _mx_tiles_fit(cfg, layer.shape.hidden, layer.shape.inter, 2))
        return Step(GLUON_MX_TINY if gluon else DOWN_TINY, cfg)
    kind = {"tiled": TILED, "streamed": STREAMED, "resident": RESIDENT}[layer.shape.down_kind(cfg)]
    if kind == STREAMED and layer.mx_words and _gluon(cfg, target) \
            and _gluon_mx_words_fits(config.block_m, cfg, layer.shape.hidden, layer.shape.inter, 2):
        return Step(GLUON_MX, cfg)
    if cfg.whole_block and kind == RESIDENT:
        raise ValueError(f"whole_block is for the tiled and streamed down, not the resident one: {cfg}")
    tile_m, tile_m2 = down_tiles(config.block_m, cfg.whole_block)
    cfg = with_dot_warps(cfg, config.block_m, layer.shape, target, gate_up=False)
    return Step(kind, cfg, quantise_first=quantise_first(layer, cfg.block_k),
                weight_left=_weight_left(layer, cfg, tile_m2 or tile_m, target),
                descriptors=cfg.descriptors and target.hopper and (kind == RESIDENT or layer.down_pack == 1),
                kpack=_kpack(cfg, target), mx_dequant=_mx_dequant(layer, cfg) and not layer.down_units,
                tile_m2=tile_m2)


def _refuse_units_steps(units: bool, cfg: KernelConfig) -> None:
    """ValueError where a GEMM of mx_units weights would step K by other than whole 64-K chunks."""
    if units and cfg.block_k % kernels.MX_UNIT_K.value:
        raise ValueError(f"mx_units weights step whole {kernels.MX_UNIT_K.value}-K chunks, not block_k "
                         f"{cfg.block_k}: {cfg}")


def _gluon_block_fp8_fits(layer: Layer, config: LaunchConfig) -> bool:
    """Block fp8 with 1x128 activation groups; blocks of the kernel's 64 rows, a ring slot for
    each of a pass's K steps at least, N tiles that start on their own width and lie in one
    128-row scale block (gate and up alike), H a whole number of the kernel's passes."""
    cfg = config.gate_up
    return (layer.granularity == "block" and not layer.per_token and config.block_m == GLUON_BLOCK_M
            and cfg.num_stages >= gluon_kernels.PASS.value
            and kernels.SCALE_BLOCK.value % cfg.block_n == 0 and layer.shape.inter % cfg.block_n == 0
            and layer.shape.hidden % (gluon_kernels.PASS.value * QUANT_GROUP) == 0)


def _gluon_mx_words_fits(block_m: int, cfg: KernelConfig, rows: int, cols: int, parts: int) -> bool:
    """mx_words, weights of `rows` x `cols` (K): blocks of 16 to 64 rows (the wgmma's N) and
    _mx_tiles_fit."""
    return block_m in GLUON_MX_BLOCK_MS and _mx_tiles_fit(cfg, rows, cols, parts)


def _mx_tiles_fit(cfg: KernelConfig, rows: int, cols: int, parts: int) -> bool:
    """N tiles of `parts` whole 64-row wgmmas each (the down's two halves) that divide the
    `rows`; K steps of one or two 64-K word chunks that divide K (`cols`); two ring slots at
    least."""
    return (cfg.block_n % (parts * gluon_kernels.MX_WGMMA_ROWS) == 0 and rows % cfg.block_n == 0
            and cfg.block_k in GLUON_MX_BLOCK_KS and cols % cfg.block_k == 0 and cfg.num_stages >= 2)
