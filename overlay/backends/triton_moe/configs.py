"""Launch configurations: per (device name, layer shape, M bucket), tuned entries from files
merged over a built-in default.

Files are JSON: `{"devices": {DEVICE: {SHAPE_KEY: {BUCKET: LAUNCH_CONFIG}}}}`, DEVICE a GPU's
name (NVIDIA H200) or an AMD target's architecture (gfx942: MI300X and MI325X; gfx950: MI355X;
target.Target.table_keys). The shipped
ones live in configs/ beside this module; `MOE_OVERLAY_TRITON_CONFIGS` names more
(os.pathsep-separated), merged after them. Merging works entry by entry: a later file adds
or replaces single (device, shape, bucket) entries and never removes the others.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch

from ...spec import MoESpec
from .target import Target

SHIPPED_DIR = Path(__file__).parent / "configs"
USER_FILES_ENV = "MOE_OVERLAY_TRITON_CONFIGS"
TINY_ROUTES = 16  # at most this many routes: no sort, one program per expert (kernels.py)
MIN_TILE_M = 16  # a dot's least M
MX_MIN_K = 64  # mxfp4 K steps: two 32-wide scale groups at least (a scaled dot of 32 bytes of packed K)
MX_DEQUANT_BLOCK_M = 64  # the tuner offers mxfp4's decode a program (mx_dequant) from blocks of this many rows,
# where tl.dot_scaled decodes in plain instructions (not gfx950's fp4 conversions: more VALU there, make amd-report)
GLUON_BLOCK_M = 64  # gluon_kernels' block-fp8 gate/up: one warpgroup's wgmma rows a block
GLUON_MX_BLOCK_MS = (16, 32, 64)  # gluon_kernels' mx_words gate/up: its blocks (the wgmma's N)
TINY_DOWN_COLUMNS = 8  # gluon_kernels' one-token mx_words down: its wgmma's N, a column a route of a program
GLUON_MX_BLOCK_KS = (64, 128)  # and its K steps: one or two 64-K word chunks
RESIDENT_MAX_I = 512  # down_resident_kernel: beyond, a program per output tile has enough K steps to pipeline
FP8_STEP = 128  # fp8 K steps: one 128-wide weight scale block and activation group each
FP8_GEMV_STEPS = (FP8_STEP, 2 * FP8_STEP)  # the fp8 gemv gate/up's K steps: one group or two
FP8_TINY_DOWN_STEPS = (FP8_STEP, 2 * FP8_STEP, 4 * FP8_STEP)  # tiny mode's fp8 down: K steps of 1, 2 or 4 groups

Table = dict[str, dict[str, dict[str, dict[str, Any]]]]


@dataclass(frozen=True)
class KernelConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 1
    split_k: int = 1  # tiny mode: gate/up programs per expert and N tile along K; down, per token and N tile
    n_split: int = 0  # general down only, > 0: programs per row tile, each walking its share of the N tiles
    # (bf16/fp16: down_resident_kernel; other formats: down_kernel streamed; block fp8 resident with `resident`)
    gemv: bool = False  # tiny gate/up only: gate_up_gemv_kernel, a matrix-vector product per route
    descriptors: bool = False  # weight tiles through tensor descriptors (TMA on Hopper); bf16/fp16 gate/up, any down
    pdl: bool = False  # tiny down only: started while its gate/up runs (programmatic dependent launch, NVIDIA sm_90+)
    weight_left: bool = False  # fp8 dots of under 64 rows: the weight tile the left operand (wgmma's M, NVIDIA sm_90+)
    gluon: bool = False  # gluon_kernels' (NVIDIA sm_90+): block-fp8 or mx_words gate/up (plan._gate_up_step),
    # mx_words streamed down (plan._down_step), mx_words tiny down (plan._down_step)
    resident: bool = False  # block-fp8 down with n_split, I <= RESIDENT_MAX_I: down_resident_kernel, not streamed
    kpack: int = 0  # the dots' kpack where the target has one (gfx942: target.py), 1 or 2; 0: the target's
    mx_dequant: bool = False  # mxfp4 packed bytes, sorted gate/up and tiled or streamed down: the program decodes
    # each weight tile to bf16 once for a plain dot (kernels._mx_dequant), not in tl.dot_scaled's per-warp decode
    whole_block: bool = False  # tiled or streamed down, blocks of three row tiles: a program takes a whole block,
    # its two row tiles (row_tiles) sharing each weight tile (mxfp4: its decode), not a program per third

    def __post_init__(self) -> None:
        if self.kpack not in (0, 1, 2):
            raise ValueError(f"kpack must be 1 or 2 (0: the target's); got {self.kpack!r}")


@dataclass(frozen=True)
class LaunchConfig:
    """BLOCK_M is shared: the sort pads each expert to it and both GEMMs walk its blocks. It
    is a power of two or three times one (row_tiles)."""

    block_m: int
    gate_up: KernelConfig
    down: KernelConfig

    def __post_init__(self) -> None:
        row_tiles(self.block_m)  # raises for a block the kernels cannot split into row tiles

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LaunchConfig:
        return cls(int(data["block_m"]), KernelConfig(**data["gate_up"]), KernelConfig(**data["down"]))


def row_tiles(block_m: int) -> tuple[int, int]:
    """The gate/up kernel's two row tiles for a block (dots need power-of-two rows): the block
    itself, or for three times a power of two its first 2/3 and last 1/3, which share each
    weight tile (the second is 0 when there is none)."""
    if block_m >= MIN_TILE_M and block_m & (block_m - 1) == 0:
        return block_m, 0
    third = block_m // 3
    if third * 3 != block_m or third < MIN_TILE_M or third & (third - 1):
        raise ValueError(f"block_m must be a power of two or three times one, at least {MIN_TILE_M}; got {block_m}")
    return 2 * third, third


def down_tile(block_m: int) -> int:
    """The down kernels' rows per program: the block, or a third of it (a program each)."""
    return row_tiles(block_m)[1] or block_m


def with_dot_warps(cfg: KernelConfig, block_m: int, shape: LayerShape, target: Target, gate_up: bool) -> KernelConfig:
    """`cfg`, a dot GEMM's in blocks of `block_m`, with the warps its dots run on
    (Target.dot_warps): as many as the MFMA tiles of the smaller row tile (down_tile: both
    GEMMs' where a block has two) by its columns (the gate/up's interleaved gate and up rows
    count twice) allow."""
    columns = cfg.block_n * (2 if gate_up and shape.interleaved else 1)
    return replace(cfg, num_warps=target.dot_warps(cfg.num_warps, down_tile(block_m), columns))


def down_tiles(block_m: int, whole_block: bool) -> tuple[int, int]:
    """A down program's row tiles: down_tile's one, or (whole_block) the gate/up's two."""
    return row_tiles(block_m) if whole_block else (down_tile(block_m), 0)


def stage_bytes(rows: int, cfg: KernelConfig, b_tiles: int, weight_bytes: float = 2.0, act_bytes: int = 2) -> int:
    """Shared memory of one pipeline stage of a dot kernel: `rows` activation rows at
    `act_bytes` a value (1: fp8 quantised before the kernel) and `b_tiles` weight tiles of
    BLOCK_K at `weight_bytes` a value (LayerShape.weight_bytes)."""
    return int((act_bytes * rows + weight_bytes * b_tiles * cfg.block_n) * cfg.block_k)


def resident_bytes(rows: int, cfg: KernelConfig, shape: LayerShape, target: Target) -> int:
    """down_resident_kernel's shared memory: the activation block and the weight tiles of the
    stages `target` keeps there (Target.shared_stages), each of all of I (bf16/fp16:
    resident_k's two tiles at two bytes a value, whatever the entry's block_k; block fp8: whole
    K steps at one); where the activation stays in registers (Target.resident_in_registers),
    the larger of the two."""
    k, value_bytes = (-(-shape.inter // FP8_STEP) * FP8_STEP, 1) if shape.fp8 else (sum(resident_k(shape.inter)), 2)
    activation = rows * k * value_bytes
    weights = target.shared_stages(cfg.num_stages) * cfg.block_n * k * value_bytes
    return max(activation, weights) if target.resident_in_registers else activation + weights


@cache
def device_shared_bytes(device: torch.device) -> int:
    """Shared memory one program may use on `device` (0 where there is no GPU: no limit)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) or 64 * 1024


def shared_bytes(config: LaunchConfig, shape: LayerShape, tiny: bool, target: Target) -> dict[str, int]:
    """Shared memory each GEMM of a launch (`tiny`: in tiny mode) keeps its pipelined tiles in on
    `target`, by "gate_up" and "down" (stage_bytes for the stages the target keeps there,
    resident_bytes); the gemv gate/up and tiny mode's down keep none."""
    used = {}
    sorted_fp8 = shape.fp8 and not tiny  # activations quantised first: 1 byte
    if not config.gate_up.gemv:
        used["gate_up"] = target.shared_stages(config.gate_up.num_stages) * stage_bytes(
            config.block_m, config.gate_up, 2, shape.weight_bytes, 1 if sorted_fp8 else 2)
    if not tiny:
        rows = sum(down_tiles(config.block_m, config.down.whole_block))
        used["down"] = (resident_bytes(rows, config.down, shape, target) if shape.down_kind(config.down) == "resident"
                        else target.shared_stages(config.down.num_stages) * stage_bytes(
                            rows, config.down, 1, shape.weight_bytes, 1 if sorted_fp8 else 2))
    return used


def fit_shared(config: LaunchConfig, shape: LayerShape, num_tokens: int, target: Target) -> LaunchConfig:
    """`config` with each GEMM's num_stages lowered (to 1 at least) until its tiles fit the
    target's shared memory (none set: as it is). The tuner offers only what fits; this is for
    the defaults and for entries from other devices: gfx942 has 64 KiB, against 227 KiB on an
    H200, and a kernel over its device's limit does not launch."""
    if not target.tile_bytes:
        return config
    tiny = is_tiny(num_tokens, shape.top_k)
    for gemm, used in shared_bytes(config, shape, tiny, target).items():
        while used > target.tile_bytes and getattr(config, gemm).num_stages > 1:
            cfg = getattr(config, gemm)
            config = replace(config, **{gemm: replace(cfg, num_stages=cfg.num_stages - 1)})
            used = shared_bytes(config, shape, tiny, target)[gemm]
    return config


def weights_tag(dtype: torch.dtype, fp8_granularity: str | None) -> str:
    """bf16, fp16, fp8-<granularity> for fp8 weights, or mxfp4 (packed into uint8, or recoded
    into int32 words, layout.mx_words, or int16 units, layout.mx_units)."""
    if fp8_granularity:
        return f"fp8-{fp8_granularity}"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "mxfp4", torch.int32: "mxfp4",
            torch.int16: "mxfp4"}.get(dtype, str(dtype))


@dataclass(frozen=True)
class LayerShape:
    """What the best launch depends on: this rank's sizes and the weights' format."""

    experts: int  # local experts
    hidden: int
    inter: int
    top_k: int
    weights: str  # bf16, fp16, fp8-tensor, fp8-channel, fp8-block or mxfp4
    layout: str = ""  # mxfp4 in a layout not the target's own (Target.mx_entries): entries of its own

    @classmethod
    def of(cls, spec: MoESpec) -> LayerShape:
        if spec.quant.weights == "mxfp4":
            weights = "mxfp4"
        else:
            weights = weights_tag(spec.dtype, spec.quant.granularity if spec.quant.weights == "fp8" else None)
        return cls(spec.num_local_experts, spec.hidden_size, spec.intermediate_size, spec.top_k, weights)

    @property
    def key(self) -> str:
        return f"E{self.experts}-H{self.hidden}-I{self.inter}-k{self.top_k}-{self.weights}" + (
            f"-{self.layout}" if self.layout else "")

    def entries_of(self, target: Target) -> LayerShape:
        """The shape whose launch entries `target` reads and its tuner writes: mxfp4's keyed by
        the layout where the target runs one not its own."""
        return replace(self, layout=target.mx_entries if self.weights == "mxfp4" else "")

    @property
    def fp8(self) -> bool:
        return self.weights.startswith("fp8")

    @property
    def weight_bytes(self) -> float:
        """Bytes a weight value takes as stored: 2 (bf16/fp16), 1 (fp8), or mxfp4's half
        byte and its e8m0 scale's share (one byte per 32 values)."""
        return 0.5 + 1 / 32 if self.weights == "mxfp4" else 1.0 if self.fp8 else 2.0

    @property
    def resident_fp8(self) -> bool:
        """Block fp8 with an I that down_resident_kernel's K steps hold (RESIDENT_MAX_I): its
        down may be resident where the entry says so."""
        return self.weights == "fp8-block" and self.inter <= RESIDENT_MAX_I

    @property
    def interleaved(self) -> bool:
        """w13 rows gate/up-interleaved (the backend's layout for bf16/fp16): one dot computes
        both. fp8 and mxfp4 stay canonical: their scale blocks span canonical rows."""
        return self.weights in ("bf16", "fp16")

    def down_kind(self, down: KernelConfig) -> str:
        """Which general-mode down a config runs on this layer: "tiled" (a program per output
        tile); with n_split, "resident" (bf16/fp16, or block fp8 where the config says so:
        down_resident_kernel) or "streamed" (down_kernel walking N tiles)."""
        if not down.n_split:
            return "tiled"
        return "resident" if self.interleaved or (down.resident and self.resident_fp8) else "streamed"


def resident_k(inter: int) -> tuple[int, int]:
    """down_resident_kernel's two K tiles covering all of I: the largest power of two in I,
    and the rest rounded up to one (at least 16, a dot's least K), or 0."""
    low = 1 << (inter.bit_length() - 1)
    rest = inter - low
    return low, max(16, 1 << (rest - 1).bit_length()) if rest else 0


def is_tiny(num_tokens: int, top_k: int) -> bool:
    return num_tokens * top_k <= TINY_ROUTES


def tiny_route_split(top_k: int, split_k: int) -> tuple[int, int]:
    """Tiny mode's down: (routes a program, programs a token) of a token's top_k routes, padded
    to a power of two, shared `split_k` ways (at most one route a program)."""
    k_pad = 1 << (top_k - 1).bit_length()
    split = min(split_k, k_pad)
    return k_pad // split, split


def default_config(shape: LayerShape, num_tokens: int) -> LaunchConfig:
    """A sane launch for any shape: block sizes from the routes each expert gets."""
    if is_tiny(num_tokens, shape.top_k):
        return LaunchConfig(TINY_ROUTES, KernelConfig(16, 256, 4, 4, split_k=2), KernelConfig(16, 64, 4, 2))
    per_expert = num_tokens * shape.top_k / shape.experts
    block_m = next((b for b in (16, 32, 64) if per_expert <= 2 * b), 128)
    if block_m <= 32:  # weight streaming: narrow tiles, many programs, deep pipelines
        return LaunchConfig(block_m, KernelConfig(64, 128, 4, 4), KernelConfig(64, 128, 4, 4))
    # fp8: a 128-wide scale group a step; bf16 and mxfp4 64 (mxfp4's 128 spilled on gfx942: make amd-report)
    block_k = 128 if shape.fp8 else 64
    return LaunchConfig(block_m, KernelConfig(128, block_k, 8, 3, 8), KernelConfig(128, block_k, 8, 3, 8))


def merge(base: Table, extra: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> Table:
    """`extra`'s (device, shape, bucket) entries over `base`'s; nothing in base is dropped."""
    out: Table = {d: {s: dict(b) for s, b in shapes.items()} for d, shapes in base.items()}
    for device, shapes in extra.items():
        for shape, buckets in shapes.items():
            out.setdefault(device, {}).setdefault(shape, {}).update(buckets)
    return out


def read_file(path: Path) -> Table:
    try:
        data = json.loads(Path(path).read_text())
        devices = data["devices"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"Triton MoE config file {path} is unreadable or not in the expected format: {exc}") from exc
    for device, shapes in devices.items():
        for shape, buckets in shapes.items():
            for bucket, entry in buckets.items():
                try:
                    int(bucket)
                    LaunchConfig.from_json(entry)
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}: entry {device} / {shape} / {bucket} is not valid: {exc}") from exc
    return devices


def user_files(env_value: str) -> list[Path]:
    return [Path(p) for p in env_value.split(os.pathsep) if p]


def load_table(files: Iterable[Path]) -> Table:
    table: Table = {}
    for path in files:
        table = merge(table, read_file(path))
    return table


@cache
def _table(user_env: str) -> Table:
    return load_table([*sorted(SHIPPED_DIR.glob("*.json")), *user_files(user_env)])


def current_table() -> Table:
    """Shipped files, then the user's; re-read only when the user's list changes."""
    return _table(os.environ.get(USER_FILES_ENV, ""))


@cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def nearest_bucket(buckets: Iterable[str], num_tokens: int) -> str:
    """The tuned M closest in ratio to `num_tokens` (ties to the smaller)."""
    return min(buckets, key=lambda b: (abs(math.log2(int(b)) - math.log2(max(num_tokens, 1))), int(b)))


def lookup(table: Table, devices: tuple[str, ...], shape: LayerShape, num_tokens: int) -> tuple[LaunchConfig, bool]:
    """(launch config, whether it was tuned for this shape): the entries of the first of
    `devices` (a GPU's name, a target's architecture) that has the shape."""
    tuned = next((d for d in devices if is_tuned(table, (d,), shape)), None)
    if tuned is None:
        return default_config(shape, num_tokens), False
    buckets = table[tuned][shape.key]
    return LaunchConfig.from_json(buckets[nearest_bucket(buckets, num_tokens)]), True


@lru_cache(maxsize=4096)
def _launch_config(user_env: str, devices: tuple[str, ...], target: Target, shape: LayerShape,
                   num_tokens: int) -> LaunchConfig:
    config, _ = lookup(_table(user_env), devices, shape.entries_of(target), num_tokens)
    tiny = is_tiny(num_tokens, shape.top_k)
    if tiny:
        config = replace(config, block_m=TINY_ROUTES)  # tiny programs hold every route as a row
    if not shape.interleaved:  # fp8: one K step per 128-wide scale
        # block and activation group (the gemv gate/up: one or two; tiny mode's down: one, two
        # or four, so that a one-token down loads more of a small I before it waits). mxfp4: K
        # steps of whole 32-wide scale groups, at least MX_MIN_K, and weight tiles by plain loads
        # (packed K, not what a descriptor's box holds)
        gemv_k = config.gate_up.block_k if config.gate_up.gemv and config.gate_up.block_k in FP8_GEMV_STEPS else 0
        tiny_down_k = config.down.block_k if tiny and config.down.block_k in FP8_TINY_DOWN_STEPS else 0
        gate_up_k, down_k = (gemv_k or FP8_STEP, tiny_down_k or FP8_STEP) if shape.fp8 else (
            max(config.gate_up.block_k, MX_MIN_K), max(config.down.block_k, MX_MIN_K))
        config = replace(config,
                         gate_up=replace(config.gate_up, block_k=gate_up_k,
                                         descriptors=config.gate_up.descriptors and shape.fp8),
                         down=replace(config.down, block_k=down_k,
                                      descriptors=config.down.descriptors and shape.fp8))
    if not shape.fp8:  # weight_left turns fp8 dots only
        config = replace(config, gate_up=replace(config.gate_up, weight_left=False),
                         down=replace(config.down, weight_left=False))
    if shape.weights not in ("fp8-block", "mxfp4"):  # the Gluon gate/ups are block-fp8's and mx_words'
        config = replace(config, gate_up=replace(config.gate_up, gluon=False))
    if config.down.resident and not shape.resident_fp8:
        config = replace(config, down=replace(config.down, resident=False))  # bf16/fp16's is implied by n_split
    return fit_shared(config, shape, num_tokens, target)


def launch_config(shape: LayerShape, device: torch.device, num_tokens: int, target: Target) -> LaunchConfig:
    """The launch for a call on `target`: the current table's entry with the rules every launch
    obeys, fitted to the shared memory a program has, remembered (it is asked on every call of
    the layer)."""
    return _launch_config(os.environ.get(USER_FILES_ENV, ""), table_devices(device, target),
                          replace(target, shared_bytes=shared_limit(device, target)), shape, num_tokens)


def table_devices(device: torch.device, target: Target) -> tuple[str, ...]:
    """The table's device keys a launch on `target` reads, first found first: the device's own
    name ("cpu" in Triton's interpreter), then the target's (an AMD architecture); in target
    mode the target's alone."""
    own = () if target.stands_in else (device_name(device),)
    return own + target.table_keys


def shared_limit(device: torch.device, target: Target) -> int:
    """Shared memory a program may use: the GPU's own where it runs as itself, the target's in
    target mode or where the kernels compile for a GPU that is not here (0: no limit)."""
    return target.shared_bytes if target.stands_in or device.type != "cuda" else device_shared_bytes(device)


def is_tuned(table: Table, devices: tuple[str, ...], shape: LayerShape) -> bool:
    return any(table.get(device, {}).get(shape.key) for device in devices)
