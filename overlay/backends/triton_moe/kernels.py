"""The Triton kernels of the fused-experts backend. Plain `tl`, no inline PTX, so ROCm's Triton
compiles the same source; targets differ in the launch configuration (configs.py) and in the
plan (plan.py), which turns on NVIDIA's features (nvidia.py: weight-left fp8 dots, tensor
descriptors, programmatic dependent launch) only on Hopper, in constexpr branches that ROCm and
older GPUs never compile.

Weights stay in the canonical `[E, N, K]` (K contiguous), which both wgmma (Hopper, and
required for fp8) and MFMA read as is; gate and up are two B tiles of one program, so the
activation is applied in registers and only `[routes, I]` reaches memory. mxfp4 weights
stay packed (`[E, N, K/2]` uint8, scales `[E, N, K/32]` e8m0): each weight tile goes to
`tl.dot_scaled`, which on GPUs without fp4 matrix units (Hopper, MI300) dequantises it in
registers to the activations' 16-bit type inside the main loop; the matrix-vector products
(down_tiny_kernel, and gate_up_gemv_kernel when tuned so) decode e2m1 themselves
(_mx_products) and scale each 32-wide group's sum once. On NVIDIA with bf16 activations mxfp4
comes recoded instead (MX_WORDS: layout.mx_words, int32 words of 8 values whose bits a shift
and a mask put in place, 16 rows' K steps stored together), decoded by _mx_decode for every
kernel.

Rows of a program ("an M block") are routes (token t, choice j) -> route id `t * top_k + j`:
- general mode: `align_count_kernel` and `align_scatter_kernel` sort the routes by local expert into blocks of
  BLOCK_M rows; BLOCK_M is a power of two or three times one (48, 96, 192: an expert's 146 routes fit one block
  of 192 where 256 would pad them by 75%), and a program computes its rows as dots of power-of-two row tiles
  (gate/up: 2/3 and 1/3 of the block against one weight tile; down: a program per third);
- tiny mode (at most BLOCK_M routes, e.g. one decode token): no sort; the program of route
  slot s takes every route that goes to the same expert as s, and only the first such slot
  runs, so each expert's weights are read once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ... import layout
from .configs import FP8_STEP
from .nvidia import await_previous, fp8_dot, let_next_start, weight_desc

SILU: tl.constexpr = tl.constexpr(0)
SITU: tl.constexpr = tl.constexpr(1)
# Weight quantisation, as the kernels see it.
W_NONE: tl.constexpr = tl.constexpr(0)
W_TENSOR: tl.constexpr = tl.constexpr(1)
W_CHANNEL: tl.constexpr = tl.constexpr(2)
W_BLOCK: tl.constexpr = tl.constexpr(3)
W_MXFP4: tl.constexpr = tl.constexpr(4)  # w4a16: e2m1 pairs packed along K, an e8m0 scale per 32 (not w8a8)
SCALE_BLOCK: tl.constexpr = tl.constexpr(FP8_STEP)  # fp8 block scales and activation groups are 128 wide
MX_GROUP: tl.constexpr = tl.constexpr(32)  # mxfp4: K values per e8m0 scale
MX_WORD_ROWS: tl.constexpr = tl.constexpr(layout.MX_WORD_ROWS)  # mx_words: rows stored together
MX_WORD_CHUNK: tl.constexpr = tl.constexpr(layout.MX_WORD_K // 8)  # mx_words: words of a row per chunk
MX_UNIT_K: tl.constexpr = tl.constexpr(layout.MX_UNIT_K)  # mx_units: K of a chunk, four quarter dots
MX_UNIT_PACK: tl.constexpr = tl.constexpr(4)  # mx_units: PACK of int16 units, four e2m1 values each
MX_UNIT_ROWS: tl.constexpr = tl.constexpr(MX_UNIT_K // 4)  # mx_units: units of a row per 64-K chunk
MX_UNIT_QUARTER: tl.constexpr = tl.constexpr(MX_UNIT_K // 4)  # mx_units: K of a chunk's quarter, one dot
MX_UNIT_LEAST: tl.constexpr = tl.constexpr(layout.MX_UNIT_SCALES[0])  # mx_units: the e8m0 its fp16 decode holds
MX_UNIT_MOST: tl.constexpr = tl.constexpr(layout.MX_UNIT_SCALES[1])
MX_UNIT_SCALE_BIAS: tl.constexpr = tl.constexpr(layout.E8M0_BIAS - 14 - 15)  # e8m0 s -> fp16 2^(s - 113) bits


# Arguments that change with the number of tokens are not specialised on, so one compiled
# kernel serves every batch size.
@triton.jit(do_not_specialize=["num_routes"])
def align_count_kernel(
    ids_ptr, map_ptr, counts_ptr, num_routes, HAS_MAP: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """First half of a counting sort of the routes by local expert, one program per CHUNK
    routes: row `pid` of `counts [chunks, E_PAD]` is that chunk's count of each expert.
    (Programs in parallel: one program histogramming every route took ~0.5 ms at 131k routes.)"""
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    local = _local_expert(ids_ptr, map_ptr, offs, offs < num_routes, HAS_MAP)
    tl.store(counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), tl.histogram(local, E_PAD, mask=local >= 0))


@triton.jit(do_not_specialize=["num_routes"])
def align_scatter_kernel(
    ids_ptr, map_ptr, counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr,
    num_routes,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
):
    """Second half, one program per CHUNK routes. Each program reads the whole count table
    (chunks x E_PAD, small) for the experts' totals, pads each to BLOCK_M and places its
    routes after those of the chunks before it, through an atomic cursor of its own.
    Program 0 also writes each block's expert and valid rows, and the padded total. Order
    within a chunk and expert depends on the atomics; each output row is computed on its
    own, so results do not."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    for first in range(0, tl.num_programs(0), ROWS):
        chunk = first + tl.arange(0, ROWS)
        counts = tl.load(counts_ptr + chunk[:, None] * E_PAD + experts[None, :],
                         mask=(chunk < tl.num_programs(0))[:, None], other=0)
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((chunk < pid)[:, None], counts, 0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, 0) - padded
    if pid == 0:
        _write_blocks(block_expert_ptr, block_rows_ptr, num_padded_ptr, experts, total, padded, starts, BLOCK_M)
    cursor = cursor_ptr + pid * E_PAD
    tl.store(cursor + experts, starts + before)
    tl.debug_barrier()  # the cursor row is written before this program's atomics advance it
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    local = _local_expert(ids_ptr, map_ptr, offs, offs < num_routes, HAS_MAP)
    valid = local >= 0
    slot = tl.atomic_add(cursor + local, 1, mask=valid, sem="relaxed")
    tl.store(sorted_ptr + slot, offs, mask=valid)


@triton.jit
def _write_blocks(block_expert_ptr, block_rows_ptr, num_padded_ptr, experts, counts, padded, starts,
                  BLOCK_M: tl.constexpr):
    """Each M block's expert and number of valid rows, and the padded total."""
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    blocks = padded // BLOCK_M
    first_block = starts // BLOCK_M
    for j in range(0, tl.max(blocks, 0)):
        here = j < blocks
        tl.store(block_expert_ptr + first_block + j, experts, mask=here)
        rows = tl.minimum(tl.maximum(counts - j * BLOCK_M, 0), BLOCK_M)
        tl.store(block_rows_ptr + first_block + j, rows, mask=here)


@triton.jit
def _local_expert(ids_ptr, map_ptr, offs, mask, HAS_MAP: tl.constexpr):
    """Local expert slot of each route, -1 where masked off or not on this rank."""
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=ids >= 0, other=-1)
    return ids


@triton.jit
def _sorted_rows(pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr, BLOCK_M: tl.constexpr,
                 first, TILE_M: tl.constexpr):
    """General mode: (expert, route ids, row mask, buffer rows) of rows first .. first + TILE_M
    of M block `pid_m`; expert -1 for blocks past the padded total and tiles with no route.
    Buffer rows (the `[.., I]` intermediate) are the padded sorted positions."""
    offs = pid_m * BLOCK_M + first + tl.arange(0, TILE_M)
    busy = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    count = tl.load(block_rows_ptr + pid_m, mask=busy, other=0) - first
    expert = tl.where(busy & (count > 0), tl.load(block_expert_ptr + pid_m, mask=busy, other=-1), -1)
    rows = tl.arange(0, TILE_M) < count
    routes = tl.load(sorted_ptr + offs, mask=rows, other=0)
    return expert, routes, rows, offs


@triton.jit
def _row_tile(pid, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr, BLOCK_M: tl.constexpr,
              TILE_M: tl.constexpr):
    """_sorted_rows of row tile `pid` when every block is BLOCK_M // TILE_M tiles (the down
    kernels: a program per third of a block of three row tiles)."""
    per_block = BLOCK_M // TILE_M
    return _sorted_rows(pid // per_block, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr, BLOCK_M,
                        pid % per_block * TILE_M, TILE_M)


@triton.jit
def _tiny_rows(slot, ids_ptr, map_ptr, num_routes, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tiny mode: the routes that go to route `slot`'s expert; expert -1 unless `slot` is
    the first of them. Buffer rows are the route ids."""
    offs = tl.arange(0, BLOCK_M)
    local = _local_expert(ids_ptr, map_ptr, offs, offs < num_routes, HAS_MAP)
    expert = tl.load(ids_ptr + slot)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert)
    rows = (local == expert) & (local >= 0)
    first = tl.min(tl.where(rows, offs, BLOCK_M), 0)
    return tl.where(first == slot, expert, -1), offs, rows, offs


@triton.jit
def _grid_position(pid, num_blocks_m, n, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (M block, N tile), GROUP_M blocks side by side so that blocks of one
    expert share each weight tile through the L2."""
    num_pid_n = tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _quantize_rows(a, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Dynamic fp8 quantisation of each row of `a` (one 128-wide activation group)."""
    a = a.to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(a), axis=1), FP8_MAX)
    return _quantize_with(a, scale, FP8, FP8_MAX), scale


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr):
    """A dynamic fp8 scale: absmax / fp8 max, floored (an all-zero group divides by it)."""
    return tl.maximum(amax / FP8_MAX, 1e-12)


@triton.jit
def _quantize_with(a, scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp8 of each row of `a` divided by its scale (`[rows]`), saturated."""
    return tl.clamp(a.to(tl.float32) / scale[:, None], -FP8_MAX, FP8_MAX).to(FP8)


@triton.jit
def _activation_step(a, a_scale_ptrs, rows, W_QUANT: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                     A_FP8: tl.constexpr, TILE_M: tl.constexpr):
    """A K step's activation tile for _mma_step and its row scales: as loaded (A_FP8: quantised
    by quantize_groups_kernel, scales read; bf16/fp16 weights: no scales) or quantised here."""
    a_scale = tl.zeros([TILE_M], dtype=tl.float32)
    if A_FP8:
        a_scale = tl.load(a_scale_ptrs, mask=rows, other=0.0)
    elif W_QUANT != W_NONE and W_QUANT != W_MXFP4:
        a, a_scale = _quantize_rows(a, FP8, FP8_MAX)
    return a, a_scale


@triton.jit
def quantize_groups_kernel(
    src_ptr, q_ptr, scale_ptr, limit_ptr, num_rows, cols, stride_src, stride_q, stride_s,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, LIMITED: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
):
    """q[r, c] and scale[r, g]: _quantize_rows of each row's g-th group of GROUP columns, as the
    w8a8 main loops would quantise each K step (columns past `cols` count as 0). Rows from
    `*limit_ptr` on (LIMITED: the aligned buffer's padded row count) are left alone."""
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    limit = _row_limit(num_rows, limit_ptr, LIMITED)
    if tl.program_id(0) * ROWS >= limit:
        return
    row_ok = offs_r < limit
    ok = row_ok[:, None] & (offs_c < cols)[None, :]
    rows = offs_r.to(tl.int64)[:, None]
    src = tl.load(src_ptr + rows * stride_src + offs_c[None, :], mask=ok, other=0.0)
    q, scale = _quantize_rows(src, FP8, FP8_MAX)
    tl.store(q_ptr + rows * stride_q + offs_c[None, :], q, mask=ok)
    tl.store(scale_ptr + offs_r.to(tl.int64) * stride_s + tl.program_id(1), scale, mask=row_ok)


@triton.jit
def quantize_tokens_kernel(
    src_ptr, q_ptr, scale_ptr, limit_ptr, num_rows, cols, stride_src, stride_q, stride_s,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, LIMITED: tl.constexpr, BLOCK_C: tl.constexpr, GROUP: tl.constexpr,
    POWER_OF_TWO: tl.constexpr,
):
    """Per-token activations, a program per row: the whole row (BLOCK_C >= cols) in one load,
    its scale (absmax / fp8 max, or POWER_OF_TWO: the next power of two up, so that q is the
    row exactly where FP8 holds its bits, as fp16 holds bf16's) and q = row / scale, the scale
    repeated in each group of GROUP columns (so the GEMMs read it like
    quantize_groups_kernel's). Rows from `*limit_ptr` on (LIMITED) are left alone."""
    row = tl.program_id(0)
    if row >= _row_limit(num_rows, limit_ptr, LIMITED):
        return
    offs_c = tl.arange(0, BLOCK_C)
    ok = offs_c < cols
    src = tl.load(src_ptr + row.to(tl.int64) * stride_src + offs_c, mask=ok, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(src)), FP8_MAX)
    if POWER_OF_TWO:
        scale = tl.exp2(tl.ceil(tl.log2(scale)))
    q = tl.clamp(src / scale, -FP8_MAX, FP8_MAX).to(FP8)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + offs_c, q, mask=ok)
    offs_g = tl.arange(0, BLOCK_C // GROUP)
    tl.store(scale_ptr + row.to(tl.int64) * stride_s + offs_g, tl.full([BLOCK_C // GROUP], scale, tl.float32),
             mask=offs_g < tl.cdiv(cols, GROUP))


@triton.jit
def _row_limit(num_rows, limit_ptr, LIMITED: tl.constexpr):
    """Rows to quantise: all, or (LIMITED) no more than the device count at `limit_ptr`."""
    limit = num_rows
    if LIMITED:
        limit = tl.minimum(limit, tl.load(limit_ptr))
    return limit


@triton.jit
def _mma_step(acc, a, a_scale, b, b_scale, W_QUANT: tl.constexpr, A_FMT: tl.constexpr, ONE_SCALE: tl.constexpr,
              MX_WORDS: tl.constexpr, W_LEFT: tl.constexpr, MX_DEQUANT: tl.constexpr):
    """acc += a @ b, rescaled for w8a8 (`a` already quantised when fp8); mxfp4: `b` is packed
    `[BLOCK_K / 2, N]` with e8m0 `b_scale` `[N, BLOCK_K / 32]`, multiplied by 16-bit `a`
    (A_FMT, bf16 or fp16) in a scaled dot, or (MX_DEQUANT) decoded first by _mx_dequant into
    a 16-bit tile for a plain dot; or (MX_WORDS) the bf16 `[N, BLOCK_K]` tile _mx_decode made
    of the words, multiplied weight first, so that it is wgmma's register operand (what Triton
    does for tl.dot_scaled). `b_scale` is _step_scales'."""
    if W_QUANT == W_NONE:
        acc = tl.dot(a, b, acc)
    elif W_QUANT == W_MXFP4 and MX_WORDS:
        acc = tl.trans(tl.dot(b, tl.trans(a), tl.trans(acc)))
    elif W_QUANT == W_MXFP4 and MX_DEQUANT:
        acc = tl.dot(a, _mx_dequant(b, b_scale).to(a.dtype), acc)
    elif W_QUANT == W_MXFP4:  # one return: Triton 3.6 compiles what follows a constexpr branch's return
        acc = tl.dot_scaled(a, None, A_FMT, b, b_scale, "e2m1", acc, fast_math=True)
    elif W_QUANT == W_BLOCK and ONE_SCALE:  # a scale per row this K step: one multiply-add per element
        acc += fp8_dot(a, b, W_LEFT) * (a_scale * b_scale)[:, None]
    elif W_QUANT == W_BLOCK:
        acc += fp8_dot(a, b, W_LEFT) * a_scale[:, None] * b_scale[None, :]
    else:
        acc += fp8_dot(a, b, W_LEFT) * a_scale[:, None]
    return acc


@triton.jit
def _mx_scale_offsets(rows, groups, stride_sn):
    """Offsets of the e8m0 scales of weight rows `rows` (`[R, 1]`) and scale groups `groups`
    (`[1, G]`) in an expert's mx_words scales (layout.mx_scale_words; `stride_sn` is K/32):
    16-row groups of K/32 64-K chunks, each 32 bytes, word i rows i and i + 8."""
    half = MX_WORD_ROWS // 2
    return ((rows // MX_WORD_ROWS) * (MX_WORD_ROWS * stride_sn) + (groups // 2) * (MX_WORD_ROWS * 2)
            + (rows % half) * 4 + (rows // half % 2) * 2 + groups % 2)


@triton.jit
def _step_scales(scale_base, rows, rows_ok, k, cols, stride_sn, W_QUANT: tl.constexpr, BLOCK_K: tl.constexpr,
                 ONE_SCALE: tl.constexpr, MX_WORDS: tl.constexpr):
    """The weight scales K step `k` needs for weight rows `rows` (of `cols` columns): fp8
    block, one per row, or one for all (ONE_SCALE: the rows lie in one 128-row scale block,
    so _mma_step rescales with one multiply-add an element, not two multiplies and an add);
    mxfp4, one e8m0 per row and 32 columns, `[rows, BLOCK_K / 32]` (groups past the row's end
    read as 2^0: their weights read as zeros), canonical or in mx_words' order (MX_WORDS);
    others none (0)."""
    scales = 0.0
    if W_QUANT == W_MXFP4:
        groups = k * (BLOCK_K // MX_GROUP) + tl.arange(0, BLOCK_K // MX_GROUP)
        ok = rows_ok[:, None] & (groups < cols // MX_GROUP)[None, :]
        if MX_WORDS:
            offsets = _mx_scale_offsets(rows[:, None], groups[None, :], stride_sn)
        else:
            offsets = rows[:, None] * stride_sn + groups[None, :]
        scales = tl.load(scale_base + offsets, mask=ok, other=127)
    elif W_QUANT == W_BLOCK and ONE_SCALE:
        scales = tl.load(scale_base + (tl.min(rows, 0) // SCALE_BLOCK) * stride_sn + k)
    elif W_QUANT == W_BLOCK:
        scales = tl.load(scale_base + (rows // SCALE_BLOCK) * stride_sn + k)
    return scales


E2M1_SMALL_EXP: tl.constexpr = tl.constexpr(14)  # _mx_products' values are the codes' times 2^-14


@triton.jit
def _mx_units_gemv_step(w_rows, w_ok, x_row, scale_base, offs_w, k, hidden, stride_sn, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """The gemv's K step `k` of mx_units rows (`w_rows`: `[2 BLOCK_N, 1]` row starts): `[2 BLOCK_N,
    BLOCK_K / 64]` sums a 64-K chunk, scaled (_mx_units_products, _mx_units_group_sums)."""
    offs_u = tl.arange(0, BLOCK_K // MX_UNIT_PACK)
    u_ok = offs_u < (hidden - k * BLOCK_K) // MX_UNIT_PACK  # whole chunks: H is
    units = tl.load(w_rows + k * (BLOCK_K // MX_UNIT_PACK) + offs_u[None, :], mask=w_ok[:, None] & u_ok[None, :],
                    other=0)
    first, second = _mx_units_products(units, x_row + _mx_units_k(k, BLOCK_K)[None, :], u_ok[None, :])
    s_first, s_second = _mx_units_scales_fp32(scale_base + offs_w[:, None] * stride_sn, w_ok[:, None], k, hidden,
                                              BLOCK_K)
    return _mx_units_group_sums(first, second, s_first, s_second, 2 * BLOCK_N, BLOCK_K)


@triton.jit
def _mx_units_k(k, BLOCK_K: tl.constexpr):
    """K of each unit's quarter 0 in K step `k` of mx_units (unit u of the step holds K =
    64 (u // 16) + 16 i + u % 16 in its quarter i): the activations gathered in the units' order."""
    offs_u = tl.arange(0, BLOCK_K // MX_UNIT_PACK)
    return k * BLOCK_K + (offs_u // MX_UNIT_ROWS) * MX_UNIT_K + offs_u % MX_UNIT_ROWS


@triton.jit
def _mx_units_products(units, x_units, ok):
    """fp32 products of `units` (int16, `[..., units]`) with the activations at `x_units` (their
    quarter 0's, _mx_units_k; broadcast against the units), summed over quarters 0-1 and 2-3
    (a chunk's two scale groups), in units of 2^-14 and before the scales: no reshape until
    _mx_units_group_sums."""
    first = _mx_unit_bits(units, 0).to(tl.float32) * tl.load(x_units, mask=ok, other=0.0).to(tl.float32)
    first += _mx_unit_bits(units, 1).to(tl.float32) * tl.load(x_units + MX_UNIT_QUARTER, mask=ok,
                                                              other=0.0).to(tl.float32)
    second = _mx_unit_bits(units, 2).to(tl.float32) * tl.load(x_units + 2 * MX_UNIT_QUARTER, mask=ok,
                                                              other=0.0).to(tl.float32)
    second += _mx_unit_bits(units, 3).to(tl.float32) * tl.load(x_units + 3 * MX_UNIT_QUARTER, mask=ok,
                                                               other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _mx_units_scales_fp32(row_scales, ok, k, cols, BLOCK_K: tl.constexpr):
    """The e8m0 scales (int32) of each chunk's first and second group in K step `k`, for rows
    whose scales start at `row_scales` (`[..., 1]`; `cols` their K)."""
    group = k * (BLOCK_K // MX_GROUP) + 2 * tl.arange(0, BLOCK_K // MX_UNIT_K)
    g_ok = ok & (group < cols // MX_GROUP)
    first = tl.load(row_scales + group, mask=g_ok, other=0).to(tl.int32)
    second = tl.load(row_scales + group + 1, mask=g_ok, other=0).to(tl.int32)
    return first, second


@triton.jit
def _mx_units_group_sums(first, second, s_first, s_second, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """`[ROWS, BLOCK_K / 64]`: _mx_units_products' sums of each chunk's two groups, scaled
    (`s_first`, `s_second`: e8m0 of `[ROWS, BLOCK_K / 64]`, as _mx_group_sums scales)."""
    chunks: tl.constexpr = BLOCK_K // MX_UNIT_K
    sums_first = tl.sum(tl.reshape(first, [ROWS, chunks, MX_UNIT_ROWS]), axis=2)
    sums_second = tl.sum(tl.reshape(second, [ROWS, chunks, MX_UNIT_ROWS]), axis=2)
    return (sums_first * _e8m0_to_f32(tl.reshape(s_first, [ROWS, chunks]) + E2M1_SMALL_EXP)
            + sums_second * _e8m0_to_f32(tl.reshape(s_second, [ROWS, chunks]) + E2M1_SMALL_EXP))


@triton.jit
def _mx_products(packed, a_even, a_odd):
    """Packed e2m1 pairs (uint8; even K in the low nibble, odd K in the high one) times the
    activations of the even and odd columns, summed per pair, in units of 2^-E2M1_SMALL_EXP
    and before the e8m0 scales (_mx_group_sums applies them). Both codes of a byte are decoded
    at once into the two halves of one 32-bit word, each where fp16 keeps sign, exponent and
    mantissa (exponent 0, the codes 0 and 0.5, lands on fp16's subnormals, which convert to
    fp32 exactly): the byte copied 12 bits up puts the high code at bit 16, then two shifts
    and two masks place both; each half converts to fp32 as is."""
    low, high = _mx_small_halves(packed)
    return low * a_even + high * a_odd


@triton.jit
def _mx_small_halves(packed):
    """Packed e2m1 pairs (uint8) -> the low and the high codes as fp32 values times
    2^-E2M1_SMALL_EXP (_mx_products tells how)."""
    spread = packed.to(tl.int32) * 0x1001
    bits = ((spread << 9) & 0x0E000E00) | ((spread << 12) & -0x7FFF8000)  # 0x80008000
    low = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _mx_dequant(packed, scales):
    """A packed `[K / 2, N]` e2m1 tile and its e8m0 `scales` `[N, K / 32]` -> bf16 `[K, N]`,
    decoded once by the whole program (tl.dot_scaled's decode runs in the dot operand's layout:
    warps that split a block's rows each decode the whole tile again). Both codes of a byte as
    _mx_small_halves' fp32 values, times their scale and 2^E2M1_SMALL_EXP (exact: a power of
    two), cut to bf16 by dropping the low 16 bits (exact: e2m1 times a power of two has two
    significant bits). As in _mx_group_sums, scales up to 2^113 (e8m0 240): the fp32
    multiplier is 2^(s - 127 + E2M1_SMALL_EXP)."""
    low, high = _mx_small_halves(packed)
    half_k: tl.constexpr = packed.shape[0]
    n: tl.constexpr = packed.shape[1]
    groups: tl.constexpr = scales.shape[1]
    values = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), [2 * half_k, n])  # K = 2j + (0 low, 1 high)
    scale = tl.trans(_e8m0_to_f32(scales.to(tl.int32) + E2M1_SMALL_EXP))
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [groups, MX_GROUP, n]), [2 * half_k, n])
    return ((values * scale).to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _mx_group_sums(products, scales, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """`[ROWS, BLOCK_K / 2]` pair products -> `[ROWS, BLOCK_K / 32]` sums of each 32-wide scale
    group times its e8m0 scale (`scales`, uint8): one multiply a group, not a value."""
    sums = tl.sum(tl.reshape(products, [ROWS, BLOCK_K // MX_GROUP, MX_GROUP // 2]), axis=2)
    return sums * _e8m0_to_f32(scales.to(tl.int32) + E2M1_SMALL_EXP)


@triton.jit
def _e8m0_to_f32(scale):
    """e8m0 (uint8 exponent, bias 127) -> fp32 2^(s - 127), by placing it in the exponent field."""
    return (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_word_offsets(rows, k, cols, BLOCK_K: tl.constexpr):
    """(offsets in words, K mask) of K step `k`'s mx_words of weight rows `rows` (`cols` K
    values a row), `[rows, BLOCK_K / 32, 4]`: word (c, t) holds the step's values at K =
    32c + 16h + 8q + 2t + p; a group of MX_WORD_ROWS rows keeps its 64-K chunks together."""
    kw = k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 32)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    r = rows[:, None, None]
    group = (r // MX_WORD_ROWS) * (MX_WORD_ROWS * (cols // 8))
    chunk = (kw // MX_WORD_CHUNK) * (MX_WORD_ROWS * MX_WORD_CHUNK)
    offsets = group + chunk + (r % MX_WORD_ROWS) * MX_WORD_CHUNK + kw % MX_WORD_CHUNK
    # cols // 8 as whole chunks, so that Triton sees the mask constant over a chunk's words
    # (cols // 8 alone leaves it proven over 2: 8-byte copies, not 16)
    return offsets, kw < (cols // (MX_WORD_CHUNK * 8)) * MX_WORD_CHUNK


@triton.jit
def _mx_decode(words, scales):
    """bf16 `[rows, BLOCK_K]` weights, K in order, of _mx_word_offsets' words times their e8m0
    `scales` (`[rows, BLOCK_K / 32]` uint8, at most 2^1: layout.MX_WORD_MAX_SCALE). A word's
    four bf16 pairs are its bits turned and masked into place (layout.MX_WORD_ROTATE): e2m1's
    exponent in bf16's lowest exponent bits is the value times 2^-126 (code 0.5 a subnormal),
    which one multiply by 2^(s - 1), the scale times 2^126, makes exact. Each pair is scaled
    as a pair, one bf16x2 multiply for two weights (_bf16_pair)."""
    scale = _mx_scale_bits(scales).to(tl.int16).to(tl.bfloat16, bitcast=True)[:, :, None, None]
    w0, w1, w2, w3 = _mx_pairs(words)
    p0 = _bf16_pair(w0, scale, False)
    p1 = _bf16_pair(w1, scale, False)
    p2 = _bf16_pair(w2, scale, False)
    p3 = _bf16_pair(w3, scale, True)
    # pair j = q + 2h, half p: [rows, C, T, P, Q, H] -> [rows, C, H, Q, T, P], K = 32c + 16h + 8q + 2t + p
    full = tl.permute(tl.join(tl.join(p0, p1), tl.join(p2, p3)), (0, 1, 5, 4, 2, 3))
    return tl.reshape(full, [words.shape[0], words.shape[1] * MX_GROUP])


@triton.jit
def _mx_pairs(words):
    """A word's four bf16 pairs, unscaled (each the values times 2^-126), as int32: pair j =
    q + 2h holds K = 8q + 16h + 2t + p of the word's group (_mx_decode). The word turned left
    by each of layout.MX_WORD_ROTATE's amounts and masked: pair 0 a mask, pair 1 a shift and
    a mask, pair 2 a rotation and a mask, pair 3 a shift, a rotation and two masks."""
    both: tl.constexpr = 0x81C081C0  # sign, the exponent's lowest two bits and the mantissa's top, both halves
    exp_high: tl.constexpr = 0x01000100  # pair 3's exponent bit 1, of its second rotation
    bits = words.to(tl.uint32, bitcast=True)
    pair1 = (bits << 4) & both
    pair2 = ((bits << 10) | (bits >> 22)) & both
    pair3 = ((bits << 6) & (both - exp_high)) | (((bits << 14) | (bits >> 18)) & exp_high)
    pair0 = bits & both
    return (pair0.to(tl.int32, bitcast=True), pair1.to(tl.int32, bitcast=True), pair2.to(tl.int32, bitcast=True),
            pair3.to(tl.int32, bitcast=True))


@triton.jit
def _mx_scale_bits(scales):
    """e8m0 scales (uint8) -> the bits of the bf16 2^(s - 1) (int32, low half), the multiplier
    that makes _mx_pairs' values exact."""
    return (scales.to(tl.int32) + 126) << 7


@triton.jit
def _bf16_pair(word, scale, HIGH_FIRST: tl.constexpr):
    """The two bf16 of a 32-bit word times `scale`, `[..., 2]`, low half first. Scaled as a
    pair, so that LLVM makes one bf16x2 multiply of the word (scaling the halves apart left it
    pairing them up again by byte permutes; Kimi-K3 M=8192 down 1862 -> 1688 us on an H200).
    HIGH_FIRST builds the pair high half first and swaps it after the multiply, a register
    renaming: for a word of two turns (_mx_pairs' pair 3) LLVM orders the halves high first,
    and built low first it swaps them before the multiply and back after. Chosen by compiling
    for sm_90 (Triton 3.9): the `tl` down's K step at Kimi-K3 M=128 is 439 instructions with
    pair 3 alone built high first, 449 to 461 with other choices; the one-token down's 322
    against 331 to 343."""
    low = (word & 0xFFFF).to(tl.int16)
    high = (word >> 16).to(tl.int16)
    if HIGH_FIRST:
        high, low = tl.split(tl.join(high, low).to(tl.bfloat16, bitcast=True) * scale)
        pair = tl.join(low, high)
    else:
        pair = tl.join(low, high).to(tl.bfloat16, bitcast=True) * scale
    return pair


SITU_EXP_CAP: tl.constexpr = tl.constexpr(25.0)


@triton.jit
def _activate(gate, up, beta, linear_beta, ACTIVATION: tl.constexpr):
    """SiLU(g) * u, or Kimi-K3's SiTU: beta*tanh(g/beta)*sigmoid(g) * betaL*tanh(u/betaL); fp32.

    Written for the exp/reciprocal unit, which bounds this epilogue (SiTU as three tanh and
    sigmoid calls cost 6% of Kimi-K3's whole gate/up at M=8192): with E1 = exp(-2g/beta),
    E2 = exp(-g), E3 = exp(-2u/betaL), SiTU = beta*betaL*(1-E1)(1-E3) / ((1+E1)(1+E2)(1+E3)),
    three exponentials and one division. Exponents are capped at SITU_EXP_CAP so that the
    products stay finite: tanh is +-1 in fp32 long before, and sigmoid(g) below exp(-25) is
    taken as exp(-25) (an absolute error under 1.4e-11 times the up factor)."""
    if ACTIVATION == SITU:
        e1 = tl.exp(tl.minimum(gate * (-2.0 / beta), SITU_EXP_CAP))
        e2 = tl.exp(tl.minimum(-gate, SITU_EXP_CAP))
        e3 = tl.exp(tl.minimum(up * (-2.0 / linear_beta), SITU_EXP_CAP))
        return (beta * linear_beta) * (1.0 - e1) * (1.0 - e3) / ((1.0 + e1) * (1.0 + e2) * (1.0 + e3))
    return gate * up / (1.0 + tl.exp(-gate))


@triton.jit
def _gate_up_interleaved(a_ptrs, a2_ptrs, w_ptr, expert, rows, rows2, pid_n, k_first, k_last, num_experts, inter,
                         hidden, stride_we, stride_wn, W_DESC: tl.constexpr, TILE_M: tl.constexpr,
                         TILE_M2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Main loop over row-interleaved weights (row 2n: gate n, row 2n+1: up n): one dot of
    2*BLOCK_N columns instead of two of BLOCK_N (fuller tensor-core instructions, A read
    from shared memory once); with TILE_M2 > 0 a second row tile shares each weight tile, so
    a block's weight tiles are loaded once for all its rows. Accumulators stay interleaved
    (see _split_gate_up). W_DESC: weight tiles through a tensor descriptor over the
    contiguous `[E * 2I, H]` (see weight_desc)."""
    offs_w = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ok = offs_w < 2 * inter
    if W_DESC:
        desc = weight_desc(w_ptr, num_experts * 2 * inter, hidden, stride_wn, 2 * BLOCK_N, BLOCK_K)
        w_row = expert * 2 * inter + pid_n * 2 * BLOCK_N  # rows past the expert's 2I only feed masked columns
    else:
        w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_w[None, :] * stride_wn
                  + (k_first * BLOCK_K + offs_k)[:, None])
    acc = tl.zeros([TILE_M, 2 * BLOCK_N], dtype=tl.float32)
    acc2 = acc  # stands in when there is no second tile
    if TILE_M2 > 0:
        acc2 = tl.zeros([TILE_M2, 2 * BLOCK_N], dtype=tl.float32)
    for k in range(k_first, k_last):
        k_ok = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=rows[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            w = desc.load([w_row, k * BLOCK_K]).T
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & w_ok[None, :], other=0.0)
            w_ptrs += BLOCK_K
        acc = tl.dot(a, w, acc)
        if TILE_M2 > 0:
            a2 = tl.load(a2_ptrs, mask=rows2[:, None] & k_ok[None, :], other=0.0)
            acc2 = tl.dot(a2, w, acc2)
            a2_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    return acc, acc2


@triton.jit
def _split_gate_up(acc, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(gate, up) of an interleaved accumulator, in registers."""
    return tl.split(tl.reshape(acc, [TILE_M, BLOCK_N, 2]))


@triton.jit
def _gate_up_pair(a_ptrs, a2_ptrs, a_scale_ptrs, a2_scale_ptrs, w_ptr, scale_base, rows, rows2, offs_n, n_ok,
                  k_first, k_last, inter, hidden, stride_wn, stride_sn, W_QUANT: tl.constexpr, FP8: tl.constexpr,
                  FP8_MAX: tl.constexpr, A_FP8: tl.constexpr, A_FMT: tl.constexpr, PACK: tl.constexpr,
                  MX_WORDS: tl.constexpr, MX_DEQUANT: tl.constexpr, ONE_SCALE: tl.constexpr, W_LEFT: tl.constexpr,
                  TILE_M: tl.constexpr, TILE_M2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Main loop over canonical weights (gate rows, then up rows; fp8 and mxfp4 keep this
    layout, their scale blocks span canonical rows): two dots per K step, w8a8-rescaled, or
    scaled dots of packed mxfp4 tiles (PACK 2 values per weight element along K), or of
    mx_words (MX_WORDS: `w_ptr` is the expert's first word, not its k_first-th step's),
    decoded once a step, or fp16 quarter dots of mx_units (PACK 4: _mx_units_step). With
    TILE_M2 > 0 a second row tile shares each weight tile (and its decode), as in
    _gate_up_interleaved. Returns (gate, up, gate2, up2); the last two are the first two when
    there is no second tile."""
    offs_k = tl.arange(0, BLOCK_K)
    if PACK == MX_UNIT_PACK:
        offs_kw = tl.arange(0, MX_UNIT_ROWS)  # a chunk's units (_mx_units_step)
    else:
        offs_kw = tl.arange(0, BLOCK_K // PACK)
    gate_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_kw[:, None]
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
    gate2 = acc_gate  # stand-ins when there is no second tile
    up2 = acc_up
    if TILE_M2 > 0:
        gate2 = tl.zeros([TILE_M2, BLOCK_N], dtype=tl.float32)
        up2 = tl.zeros([TILE_M2, BLOCK_N], dtype=tl.float32)
    for k in range(k_first, k_last):
        if PACK == MX_UNIT_PACK:
            acc_gate, acc_up, gate2, up2 = _mx_units_step(
                acc_gate, acc_up, gate2, up2, a_ptrs, a2_ptrs, rows, rows2, gate_ptrs, scale_base + offs_n * stride_sn,
                n_ok, k, hidden, inter * stride_wn, inter * stride_sn, True, TILE_M2, BLOCK_K)
        else:
            k_ok = offs_k < hidden - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rows[:, None] & k_ok[None, :], other=0.0)
            if MX_WORDS:  # up rows start I rows on: a whole number of word groups
                words, words_ok = _mx_word_offsets(offs_n, k, hidden, BLOCK_K)
                words_ok = n_ok[:, None, None] & words_ok
                gate = tl.load(w_ptr + words, mask=words_ok, other=0)
                up = tl.load(w_ptr + inter * (hidden // 8) + words, mask=words_ok, other=0)
            else:
                w_ok = (offs_kw < (hidden - k * BLOCK_K) // PACK)[:, None] & n_ok[None, :]
                gate = tl.load(gate_ptrs, mask=w_ok, other=0.0)
                up = tl.load(up_ptrs, mask=w_ok, other=0.0)
            a, a_scale = _activation_step(a, a_scale_ptrs + k, rows, W_QUANT, FP8, FP8_MAX, A_FP8, TILE_M)
            gate_scale = _step_scales(scale_base, offs_n, n_ok, k, hidden, stride_sn, W_QUANT, BLOCK_K, ONE_SCALE,
                                      MX_WORDS)
            up_scale = _step_scales(scale_base, offs_n + inter, n_ok, k, hidden, stride_sn, W_QUANT, BLOCK_K,
                                    ONE_SCALE, MX_WORDS)
            if MX_WORDS:
                gate = _mx_decode(gate, gate_scale)
                up = _mx_decode(up, up_scale)
            acc_gate = _mma_step(acc_gate, a, a_scale, gate, gate_scale, W_QUANT, A_FMT, ONE_SCALE, MX_WORDS, W_LEFT,
                                 MX_DEQUANT)
            acc_up = _mma_step(acc_up, a, a_scale, up, up_scale, W_QUANT, A_FMT, ONE_SCALE, MX_WORDS, W_LEFT,
                               MX_DEQUANT)
            if TILE_M2 > 0:
                a2 = tl.load(a2_ptrs, mask=rows2[:, None] & k_ok[None, :], other=0.0)
                a2, a2_scale = _activation_step(a2, a2_scale_ptrs + k, rows2, W_QUANT, FP8, FP8_MAX, A_FP8, TILE_M2)
                gate2 = _mma_step(gate2, a2, a2_scale, gate, gate_scale, W_QUANT, A_FMT, ONE_SCALE, MX_WORDS, W_LEFT,
                                  MX_DEQUANT)
                up2 = _mma_step(up2, a2, a2_scale, up, up_scale, W_QUANT, A_FMT, ONE_SCALE, MX_WORDS, W_LEFT,
                                MX_DEQUANT)
        a_ptrs += BLOCK_K
        a2_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K // PACK
        up_ptrs += BLOCK_K // PACK
    return acc_gate, acc_up, gate2, up2


@triton.jit
def _mx_units_step(acc, acc_b, acc2, acc2_b, a_ptrs, a2_ptrs, rows, rows2, w_ptrs, scale_ptrs, n_ok, k, cols,
                   b_offset, b_scale_offset, TWO: tl.constexpr, TILE_M2: tl.constexpr, BLOCK_K: tl.constexpr):
    """A K step `k` of mx_units weights (layout.mx_units; `w_ptrs`: the step's `[MX_UNIT_ROWS, N]`
    units, `scale_ptrs`: `[N]` rows' first scales; `cols` their K, a whole number of 64-K
    chunks, the layout's rule), and with TWO a second weight `b_offset` units and
    `b_scale_offset` scales on (the gate/up's up rows): per chunk one int16 load a weight, then
    per quarter an fp16 dot of K 16, the activations' (`a_ptrs`: `[rows, MX_UNIT_QUARTER]`
    fp16) against the quarter _mx_unit_bits places times its scale (_mx_unit_scales: one load
    of each of a chunk's two groups), into `acc` (`acc_b`), and with TILE_M2 > 0 a second row
    tile's into `acc2` (`acc2_b`) from the same decode. No join or reshape follows the decode,
    so it runs in the dot operand's layout (on gfx942 the int16 tile is read from LDS in it)."""
    offs_q = tl.arange(0, MX_UNIT_QUARTER)  # a quarter's K, and a chunk's units (MX_UNIT_ROWS)
    for c in tl.static_range(BLOCK_K // MX_UNIT_K):
        k0 = k * BLOCK_K + c * MX_UNIT_K
        chunk_ok = offs_q < cols - k0  # all or none
        w_ok = chunk_ok[:, None] & n_ok[None, :]
        group = tl.where(k0 < cols, k0 // MX_GROUP, 0)  # a chunk past K reads group 0: its weights are zeros
        w = tl.load(w_ptrs + c * MX_UNIT_ROWS, mask=w_ok, other=0)
        w_s = _mx_unit_scales(scale_ptrs + group, n_ok)
        w_b = w
        w_b_s = w_s
        if TWO:
            w_b = tl.load(w_ptrs + b_offset + c * MX_UNIT_ROWS, mask=w_ok, other=0)
            w_b_s = _mx_unit_scales(scale_ptrs + b_scale_offset + group, n_ok)
        for i in tl.static_range(4):
            q = _mx_unit_bits(w, i) * w_s[i // 2][None, :]
            offset = c * MX_UNIT_K + i * MX_UNIT_QUARTER
            a = tl.load(a_ptrs + offset, mask=rows[:, None] & chunk_ok[None, :], other=0.0)
            acc = tl.dot(a, q, acc)
            if TWO:
                q_b = _mx_unit_bits(w_b, i) * w_b_s[i // 2][None, :]
                acc_b = tl.dot(a, q_b, acc_b)
            if TILE_M2 > 0:
                a2 = tl.load(a2_ptrs + offset, mask=rows2[:, None] & chunk_ok[None, :], other=0.0)
                acc2 = tl.dot(a2, q, acc2)
                if TWO:
                    acc2_b = tl.dot(a2, q_b, acc2_b)
    return acc, acc_b, acc2, acc2_b


@triton.jit
def _mx_unit_scales(ptrs, ok):
    """The e8m0 scales at `ptrs` (`[N]`, a chunk's first group) and the next (its second) as fp16
    multipliers of _mx_unit_bits' values: 2^(s - 113), exact for e8m0 104..128
    (layout.MX_UNIT_SCALES); scales are clamped into that range (the layout refused any other
    but an all-zero group's)."""
    first = tl.load(ptrs, mask=ok, other=layout.E8M0_BIAS).to(tl.int16)
    second = tl.load(ptrs + 1, mask=ok, other=layout.E8M0_BIAS).to(tl.int16)
    return _mx_unit_multiplier(first), _mx_unit_multiplier(second)


@triton.jit
def _mx_unit_multiplier(scale):
    held = tl.minimum(tl.maximum(scale, MX_UNIT_LEAST), MX_UNIT_MOST)  # (Triton 3.6 widens to int32 here)
    return ((held - MX_UNIT_SCALE_BIAS) << 10).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _mx_unit_bits(units, QUARTER: tl.constexpr):
    """fp16 `[MX_UNIT_ROWS, N]`: quarter QUARTER of a chunk's units (`[MX_UNIT_ROWS, N]` int16),
    its codes' magnitudes shifted to fp16's exponent and mantissa (bits 9..11) and signs to bit
    15: the values times 2^-14, exact (_mx_unit_scales' multipliers finish them)."""
    bits = ((units << (9 - 3 * QUARTER)) & 0x0E00) | ((units << (3 - QUARTER)) & -0x8000)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _k_split(hidden, BLOCK_K: tl.constexpr):
    """This program's K steps [first, last) when program_id(1) splits K (tiny mode)."""
    k_steps = tl.cdiv(hidden, BLOCK_K)
    per_split = tl.cdiv(k_steps, tl.num_programs(1))
    k_first = tl.program_id(1) * per_split
    return k_first, tl.minimum(k_first + per_split, k_steps)


@triton.jit(do_not_specialize=["num_routes", "num_blocks_m", "num_experts"])
def gate_up_kernel(
    x_ptr, x_scale_ptr, w_ptr, scale_ptr, out_ptr, act_ptr, counts_ptr, topk_weights_ptr,
    ids_ptr, map_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr,
    num_routes, num_blocks_m, num_experts, inter, hidden, top_k,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_os,
    beta, linear_beta,
    TINY: tl.constexpr, HAS_MAP: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, INTERLEAVED: tl.constexpr,
    W_DESC: tl.constexpr, PDL: tl.constexpr,
    ACTIVATION: tl.constexpr, W_QUANT: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, A_FP8: tl.constexpr,
    A_FMT: tl.constexpr, PACK: tl.constexpr, MX_WORDS: tl.constexpr, MX_DEQUANT: tl.constexpr, ONE_SCALE: tl.constexpr,
    W_LEFT: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, TILE_M2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """out[row, n] = act(x[t] @ gate[e]^T, x[t] @ up[e]^T) for a block of rows and BLOCK_N
    columns of I; `w` is `[E, 2I, H]`, gate rows then up rows (_gate_up_pair), or row-interleaved
    (INTERLEAVED: bf16/fp16, see _gate_up_interleaved); TILE_M2 > 0: a second row tile.
    Tiny mode splits K over program_id(1), SPLIT_K programs (a single expert's GEMV needs more
    programs than its N tiles give), and writes the fp32 activation for the down kernel
    (_tiny_store: `out` holds the partial sums of a split, `act` the result). PDL: the down
    kernel may launch once every program here has started (let_next_start)."""
    let_next_start(PDL)
    pid_m, pid_n = _grid_position(tl.program_id(0), num_blocks_m, inter, BLOCK_N, GROUP_M)
    if TINY:
        expert, routes, rows, buffer_rows = _tiny_rows(pid_m, ids_ptr, map_ptr, num_routes, HAS_MAP, TILE_M)
    else:
        expert, routes, rows, buffer_rows = _sorted_rows(
            pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr, BLOCK_M, 0, TILE_M)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    k_first, k_last = _k_split(hidden, BLOCK_K)
    if PACK == MX_UNIT_PACK:  # a quarter of a 64-K chunk a load (_mx_units_step)
        offs_k = k_first * BLOCK_K + tl.arange(0, MX_UNIT_QUARTER)
    else:
        offs_k = k_first * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (routes // top_k)[:, None] * stride_xm + offs_k[None, :]
    scale_base = scale_ptr + expert.to(tl.int64) * stride_se
    routes2, rows2, buffer_rows2, a2_ptrs = routes, rows, buffer_rows, a_ptrs  # stand-ins: no second tile
    if TILE_M2 > 0:
        _, routes2, rows2, buffer_rows2 = _sorted_rows(
            pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr, BLOCK_M, TILE_M, TILE_M2)
        a2_ptrs = x_ptr + (routes2 // top_k)[:, None] * stride_xm + offs_k[None, :]
    if INTERLEAVED:
        acc, acc2 = _gate_up_interleaved(a_ptrs, a2_ptrs, w_ptr, expert, rows, rows2, pid_n, k_first, k_last,
                                         num_experts, inter, hidden, stride_we, stride_wn, W_DESC, TILE_M, TILE_M2,
                                         BLOCK_N, BLOCK_K)
        acc_gate, acc_up = _split_gate_up(acc, TILE_M, BLOCK_N)
        if TILE_M2 > 0:
            gate2, up2 = _split_gate_up(acc2, TILE_M2, BLOCK_N)
    else:
        a_scale_ptrs = x_scale_ptr + (routes // top_k).to(tl.int64) * stride_xsm
        a2_scale_ptrs = x_scale_ptr + (routes2 // top_k).to(tl.int64) * stride_xsm
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        if not MX_WORDS:
            w_expert += k_first * (BLOCK_K // PACK)
        acc_gate, acc_up, gate2, up2 = _gate_up_pair(
            a_ptrs, a2_ptrs, a_scale_ptrs, a2_scale_ptrs, w_expert, scale_base, rows, rows2, offs_n, n_ok, k_first,
            k_last, inter, hidden, stride_wn, stride_sn, W_QUANT, FP8, FP8_MAX, A_FP8, A_FMT, PACK, MX_WORDS,
            MX_DEQUANT, ONE_SCALE, W_LEFT, TILE_M, TILE_M2, BLOCK_N, BLOCK_K)
        if PACK == MX_UNIT_PACK:  # the rows' powers of two that made them fp16 (launch.fp16_rows), undone
            row_scale = tl.load(a_scale_ptrs, mask=rows, other=0.0)[:, None]
            acc_gate *= row_scale
            acc_up *= row_scale
            if TILE_M2 > 0:
                row_scale2 = tl.load(a2_scale_ptrs, mask=rows2, other=0.0)[:, None]
                gate2 *= row_scale2
                up2 *= row_scale2
    if TILE_M2 > 0:
        _gate_up_store(gate2, up2, routes2, rows2, buffer_rows2, offs_n, n_ok, scale_base, topk_weights_ptr,
                       out_ptr, act_ptr, counts_ptr, inter, stride_sn, stride_om, stride_os, beta, linear_beta,
                       TINY, WEIGHT_ON_INPUT, ACTIVATION, W_QUANT, SPLIT_K)
    _gate_up_store(acc_gate, acc_up, routes, rows, buffer_rows, offs_n, n_ok, scale_base, topk_weights_ptr,
                   out_ptr, act_ptr, counts_ptr, inter, stride_sn, stride_om, stride_os, beta, linear_beta,
                   TINY, WEIGHT_ON_INPUT, ACTIVATION, W_QUANT, SPLIT_K)


@triton.jit
def gate_up_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, act_ptr, counts_ptr, topk_weights_ptr, ids_ptr, map_ptr,
    inter, hidden, top_k,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_os, beta, linear_beta,
    HAS_MAP: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, ACTIVATION: tl.constexpr, W_QUANT: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, A_TOKEN: tl.constexpr, MX_WORDS: tl.constexpr, MX_UNITS: tl.constexpr,
    PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """Tiny mode, a program per (route, BLOCK_N columns of I, K split): its route's
    matrix-vector product in registers, no tensor cores and no shared memory. With one route
    per expert (one token: its top-k experts are distinct) a dot's 16 rows and its staging
    through shared memory cost time and carry nothing; routes that share an expert each read
    it. bf16/fp16: interleaved w13; mxfp4: canonical packed w13 (the tile's rows alternate
    gate n and up n, so both reduce alike), see _mx_products, or mx_words (MX_WORDS, decoded
    like bf16 rows), or mx_units (MX_UNITS: _mx_units_gemv_step); fp8: canonical rows, a K
    step one 128-wide group or two, the activation quantised as the dot kernel's path does
    (each group, or with A_TOKEN the whole row at once, as quantize_tokens_kernel would), each
    group's sums scaled as they are made (block scales too) and per-channel or per-tensor
    weight scales applied after the loop. Writes
    gate_up_kernel's tiny-mode fp32 activation (_tiny_store); PDL as there."""
    let_next_start(PDL)
    n_tiles = tl.cdiv(inter, BLOCK_N)
    route = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    expert = _local_expert(ids_ptr, map_ptr, route, route >= 0, HAS_MAP)
    if expert < 0:
        return
    k_first, k_last = _k_split(hidden, BLOCK_K)
    pair = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)  # gate n at 2n, up n at 2n + 1
    w_ok = pair // 2 < inter
    x_row = x_ptr + (route // top_k) * stride_xm
    offs_w = pair // 2 + (pair % 2) * inter  # mxfp4: canonical rows
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    scale_base = scale_ptr + expert.to(tl.int64) * stride_se
    if W_QUANT == W_MXFP4 and MX_UNITS:
        w_rows = w_expert + offs_w[:, None] * stride_wn
        groups = tl.zeros([2 * BLOCK_N, BLOCK_K // MX_UNIT_K], dtype=tl.float32)
        for k in range(k_first, k_last):
            groups += _mx_units_gemv_step(w_rows, w_ok, x_row, scale_base, offs_w, k, hidden, stride_sn, BLOCK_N,
                                          BLOCK_K)
        rows = tl.sum(groups, axis=1)
    elif W_QUANT == W_MXFP4 and not MX_WORDS:
        w_rows = w_expert + offs_w[:, None] * stride_wn
        groups = tl.zeros([2 * BLOCK_N, BLOCK_K // MX_GROUP], dtype=tl.float32)
        for k in range(k_first, k_last):
            offs_b = k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            b_ok = offs_b < hidden // 2
            packed = tl.load(w_rows + offs_b[None, :], mask=w_ok[:, None] & b_ok[None, :], other=0)
            a_even = tl.load(x_row + 2 * offs_b, mask=b_ok, other=0.0).to(tl.float32)[None, :]
            a_odd = tl.load(x_row + 2 * offs_b + 1, mask=b_ok, other=0.0).to(tl.float32)[None, :]
            scale = _step_scales(scale_base, offs_w, w_ok, k, hidden, stride_sn, W_QUANT, BLOCK_K, False, False)
            groups += _mx_group_sums(_mx_products(packed, a_even, a_odd), scale, 2 * BLOCK_N, BLOCK_K)
        rows = tl.sum(groups, axis=1)
    elif W_QUANT != W_NONE and W_QUANT != W_MXFP4:  # fp8: a K step of GROUPS 128-wide groups
        GROUPS: tl.constexpr = BLOCK_K // SCALE_BLOCK
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, GROUPS)
        w_ptrs = w_expert + offs_w[:, None] * stride_wn + (k_first * BLOCK_K + offs_k)[None, :]
        real_rows = tl.where(w_ok, offs_w, 0)  # columns past I read a real row's scales
        scale_rows = real_rows // SCALE_BLOCK * stride_sn
        if A_TOKEN:  # the whole row's scale, as quantize_tokens_kernel makes it
            amax = tl.zeros([1], dtype=tl.float32)
            for k in range(0, tl.cdiv(hidden, BLOCK_K)):
                a = tl.load(x_row + k * BLOCK_K + offs_k, mask=offs_k < hidden - k * BLOCK_K, other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)[None, :]), axis=1))
            token_scale = _scale_of(amax, FP8_MAX)
        rows = tl.zeros([2 * BLOCK_N], dtype=tl.float32)
        for k in range(k_first, k_last):
            k_ok = offs_k < hidden - k * BLOCK_K
            w = tl.load(w_ptrs, mask=w_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.reshape(tl.load(x_row + k * BLOCK_K + offs_k, mask=k_ok, other=0.0), [GROUPS, SCALE_BLOCK])
            if A_TOKEN:
                q, a_scale = _quantize_with(a, token_scale, FP8, FP8_MAX), token_scale
            else:
                q, a_scale = _quantize_rows(a, FP8, FP8_MAX)
            w = tl.reshape(w.to(tl.float32), [2 * BLOCK_N, GROUPS, SCALE_BLOCK])
            sums = tl.sum(w * q.to(tl.float32)[None, :, :], axis=2) * a_scale[None, :]  # [2 BLOCK_N, GROUPS]
            if W_QUANT == W_BLOCK:
                groups = k * GROUPS + offs_g
                sums *= tl.load(scale_base + scale_rows[:, None] + groups[None, :],
                                mask=(groups < tl.cdiv(hidden, SCALE_BLOCK))[None, :], other=0.0)
            rows += tl.sum(sums, axis=1)
            w_ptrs += BLOCK_K
        if W_QUANT == W_CHANNEL:
            rows *= tl.load(scale_base + real_rows * stride_sn)
        if W_QUANT == W_TENSOR:
            rows *= tl.load(scale_base)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        first_k = k_first * BLOCK_K + offs_k
        w_ptrs = w_expert + pair[:, None] * stride_wn + first_k[None, :]
        x_ptrs = x_row + first_k
        acc = tl.zeros([2 * BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced over K once, after the loop
        for k in range(k_first, k_last):
            k_ok = offs_k < hidden - k * BLOCK_K
            if MX_WORDS:
                words, words_ok = _mx_word_offsets(offs_w, k, hidden, BLOCK_K)
                words = tl.load(w_expert + words, mask=w_ok[:, None, None] & words_ok, other=0)
                w = _mx_decode(words, _step_scales(scale_base, offs_w, w_ok, k, hidden, stride_sn, W_QUANT, BLOCK_K,
                                                   False, True))
            else:
                w = tl.load(w_ptrs, mask=w_ok[:, None] & k_ok[None, :], other=0.0)
                w_ptrs += BLOCK_K
            a = tl.load(x_ptrs, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
            x_ptrs += BLOCK_K
        rows = tl.sum(acc, axis=1)
    gate, up = tl.split(tl.reshape(rows, [BLOCK_N, 2]))
    if WEIGHT_ON_INPUT:  # (w * x) @ W == w * (x @ W), as in _gate_up_store
        route_weight = tl.load(topk_weights_ptr + route)
        gate *= route_weight
        up *= route_weight
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _tiny_store(gate[None, :], up[None, :], route + tl.arange(0, 1), (offs_n < inter)[None, :], offs_n, out_ptr,
                act_ptr, counts_ptr, inter, stride_os, beta, linear_beta, ACTIVATION, SPLIT_K)


@triton.jit
def _tiny_store(gate, up, routes, mask, offs_n, partial_ptr, act_ptr, counts_ptr, inter, stride_os, beta,
                linear_beta, ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr):
    """Tiny mode's gate/up result from `[rows, BLOCK_N]` fp32 sums of routes `routes` (`mask`:
    valid route and column): act(gate, up), fp32, at `act[route, n]` (`[routes, I]`, what
    down_tiny_kernel reads). With K split over SPLIT_K programs (program_id(1)) each stores its
    sums at `partials[split, route, n]` and `[.., I + n]` and counts itself in on its N tile's
    counter (`counts[program_id(0)]`, zero at launch); the last to arrive adds the partials up
    in split order, whichever program that is, applies the activation and sets the count back
    to zero for the next launch. So the activation is made once, not again in each of the
    down's programs from every split's partials (which made the down's cost grow with the
    split: Kimi-K3 mxfp4 M=1, 16.8 us after an unsplit gate/up, 30.5 after one split 4 ways)."""
    act_ptrs = act_ptr + routes[:, None] * inter + offs_n[None, :]
    if SPLIT_K > 1:
        part_ptrs = partial_ptr + routes[:, None] * (2 * inter) + offs_n[None, :]
        tl.store(part_ptrs + tl.program_id(1) * stride_os, gate, mask=mask)
        tl.store(part_ptrs + tl.program_id(1) * stride_os + inter, up, mask=mask)
        if _last_to_arrive(counts_ptr, tl.program_id(0), SPLIT_K):
            gate = _sum_splits(part_ptrs, stride_os, mask, SPLIT_K)
            up = _sum_splits(part_ptrs + inter, stride_os, mask, SPLIT_K)
            tl.store(act_ptrs, _activate(gate, up, beta, linear_beta, ACTIVATION), mask=mask)
    else:
        tl.store(act_ptrs, _activate(gate, up, beta, linear_beta, ACTIVATION), mask=mask)


@triton.jit
def _last_to_arrive(counts_ptr, index, SPLITS: tl.constexpr):
    """Whether this program, its partial sums stored, is the last of SPLITS to count in on
    `counts[index]`; the last one sets the count back to zero for the next launch. The
    barrier has every thread's stores made before the count says so (the atomic releases
    them), and the atomic acquires the others' for the last program's reads."""
    tl.debug_barrier()
    last = tl.atomic_add(counts_ptr + index, 1, sem="acq_rel") == SPLITS - 1
    tl.store(counts_ptr + index, 0, mask=last)
    return last


@triton.jit
def _sum_splits(ptrs, stride, mask, SPLITS: tl.constexpr):
    """The fp32 partial sums at `ptrs + split * stride` added up in split order (the same sums
    whichever program adds them), read from the L2: other programs wrote them."""
    total = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, SPLITS):
        total += tl.load(ptrs + split * stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _gate_up_store(acc_gate, acc_up, routes, rows, buffer_rows, offs_n, n_ok, scale_base, topk_weights_ptr,
                   out_ptr, act_ptr, counts_ptr, inter, stride_sn, stride_om, stride_os, beta, linear_beta,
                   TINY: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, ACTIVATION: tl.constexpr,
                   W_QUANT: tl.constexpr, SPLIT_K: tl.constexpr):
    """A row tile's epilogue: weight scales, the router weight on the input, then the
    activation stored by buffer row, or (tiny mode) as _tiny_store has it."""
    if W_QUANT == W_TENSOR:
        acc_gate *= tl.load(scale_base)
        acc_up *= tl.load(scale_base)
    if W_QUANT == W_CHANNEL:
        acc_gate *= tl.load(scale_base + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
        acc_up *= tl.load(scale_base + (offs_n + inter) * stride_sn, mask=n_ok, other=0.0)[None, :]
    if WEIGHT_ON_INPUT:  # (w * x) @ W == w * (x @ W): scale the rows here, not the input
        route_weight = tl.load(topk_weights_ptr + routes, mask=rows, other=0.0)[:, None]
        acc_gate *= route_weight
        acc_up *= route_weight
    store_mask = rows[:, None] & n_ok[None, :]
    if TINY:
        _tiny_store(acc_gate, acc_up, buffer_rows, store_mask, offs_n, out_ptr, act_ptr, counts_ptr, inter, stride_os,
                    beta, linear_beta, ACTIVATION, SPLIT_K)
    else:
        out = _activate(acc_gate, acc_up, beta, linear_beta, ACTIVATION)
        out_ptrs = out_ptr + buffer_rows[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_blocks_m", "num_experts"])
def down_kernel(
    a_ptr, a_scale_ptr, w_ptr, scale_ptr, out_ptr, topk_weights_ptr,
    sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr,
    num_blocks_m, num_experts, hidden, inter,
    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    WEIGHT_ON_INPUT: tl.constexpr, W_QUANT: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    A_FP8: tl.constexpr, A_FMT: tl.constexpr, PACK: tl.constexpr, MX_WORDS: tl.constexpr, MX_DEQUANT: tl.constexpr,
    W_DESC: tl.constexpr, ONE_SCALE: tl.constexpr, W_LEFT: tl.constexpr, N_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_M: tl.constexpr, TILE_M2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """General mode: out[route, n] = w_route * (a[row] @ w2[e]^T), one row per route
    (the final output itself when top_k is 1). A program per TILE_M rows of a block
    (`num_blocks_m` counts those) and BLOCK_N columns; or, streamed (N_SPLIT > 0), per TILE_M
    rows and an N_SPLIT-th of the N tiles, walked in one loop over (N tile, K step) so that
    the next tile's loads are in flight while a tile is stored (with I of two or three K
    steps, a program per tile spends most of its time filling and draining its pipeline).
    TILE_M2 > 0: a program takes a whole block of three row tiles as the gate/up does, its
    first two thirds (TILE_M) and last third (TILE_M2) sharing each weight tile (mxfp4: its
    decode). W_DESC: weight tiles through a tensor descriptor (weight_desc)."""
    tiles = tl.cdiv(hidden, BLOCK_N)
    if N_SPLIT == 0:
        pid_m, first = _grid_position(tl.program_id(0), num_blocks_m, hidden, BLOCK_N, GROUP_M)
        count = 1
    else:
        pid_m = tl.program_id(0) // N_SPLIT
        per_program = tl.cdiv(tiles, N_SPLIT)
        first = tl.program_id(0) % N_SPLIT * per_program
        count = tl.minimum(per_program, tiles - first)
    expert, routes, rows, buffer_rows = _row_tile(pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr,
                                                  num_padded_ptr, BLOCK_M, TILE_M)  # a whole block: its first tile
    if expert < 0:
        return
    if PACK == MX_UNIT_PACK:  # a quarter of a 64-K chunk a load, a chunk's units (_mx_units_step)
        offs_k = tl.arange(0, MX_UNIT_QUARTER)
        offs_kw = tl.arange(0, MX_UNIT_ROWS)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        offs_kw = tl.arange(0, BLOCK_K // PACK)  # mxfp4: packed K
    a_ptrs = a_ptr + buffer_rows[:, None] * stride_am + offs_k[None, :]
    a_scale_ptrs = a_scale_ptr + buffer_rows.to(tl.int64) * stride_asm
    routes2, rows2, a2_ptrs, a2_scale_ptrs = routes, rows, a_ptrs, a_scale_ptrs  # stand-ins: no second tile
    if TILE_M2 > 0:
        _count2, routes2, rows2, buffer_rows2 = _sorted_rows(pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr,
                                                             num_padded_ptr, BLOCK_M, TILE_M, TILE_M2)
        a2_ptrs = a_ptr + buffer_rows2[:, None] * stride_am + offs_k[None, :]
        a2_scale_ptrs = a_scale_ptr + buffer_rows2.to(tl.int64) * stride_asm
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    desc = weight_desc(w_ptr, num_experts * hidden, inter, stride_wn, BLOCK_N, BLOCK_K) if W_DESC else w_ptr
    scale_base = scale_ptr + expert.to(tl.int64) * stride_se
    route_weight = _route_weight(topk_weights_ptr, routes, rows, WEIGHT_ON_INPUT)
    route_weight2 = _route_weight(topk_weights_ptr, routes2, rows2, WEIGHT_ON_INPUT)
    k_steps = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
    acc2 = acc  # stands in when there is no second tile
    if TILE_M2 > 0:
        acc2 = tl.zeros([TILE_M2, BLOCK_N], dtype=tl.float32)
    for step in range(0, count * k_steps):
        tile = first + step // k_steps
        k = step % k_steps
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        if PACK == MX_UNIT_PACK:
            w_units = w_expert + offs_n[None, :] * stride_wn + (k * (BLOCK_K // PACK) + offs_kw)[:, None]
            acc, _, acc2, _ = _mx_units_step(acc, acc, acc2, acc2, a_ptrs + k * BLOCK_K, a2_ptrs + k * BLOCK_K, rows,
                                             rows2, w_units, scale_base + offs_n * stride_sn, n_ok, k, inter, 0, 0,
                                             False, TILE_M2, BLOCK_K)
        else:
            k_ok = offs_k < inter - k * BLOCK_K
            a = tl.load(a_ptrs + k * BLOCK_K, mask=rows[:, None] & k_ok[None, :], other=0.0)
            if W_DESC:  # rows past the expert's H only feed masked columns
                w = desc.load([expert * hidden + tile * BLOCK_N, k * BLOCK_K]).T
            elif MX_WORDS:
                words, words_ok = _mx_word_offsets(offs_n, k, inter, BLOCK_K)
                w = tl.load(w_expert + words, mask=n_ok[:, None, None] & words_ok, other=0)
            else:
                w_ok = (offs_kw < (inter - k * BLOCK_K) // PACK)[:, None] & n_ok[None, :]
                w = tl.load(w_expert + offs_n[None, :] * stride_wn + (k * (BLOCK_K // PACK) + offs_kw)[:, None],
                            mask=w_ok, other=0.0)
            a, a_scale = _activation_step(a, a_scale_ptrs + k, rows, W_QUANT, FP8, FP8_MAX, A_FP8, TILE_M)
            w_scale = _step_scales(scale_base, offs_n, n_ok, k, inter, stride_sn, W_QUANT, BLOCK_K, ONE_SCALE, MX_WORDS)
            if MX_WORDS:
                w = _mx_decode(w, w_scale)
            acc = _mma_step(acc, a, a_scale, w, w_scale, W_QUANT, A_FMT, ONE_SCALE, MX_WORDS, W_LEFT, MX_DEQUANT)
            if TILE_M2 > 0:
                a2 = tl.load(a2_ptrs + k * BLOCK_K, mask=rows2[:, None] & k_ok[None, :], other=0.0)
                a2, a2_scale = _activation_step(a2, a2_scale_ptrs + k, rows2, W_QUANT, FP8, FP8_MAX, A_FP8, TILE_M2)
                acc2 = _mma_step(acc2, a2, a2_scale, w, w_scale, W_QUANT, A_FMT, ONE_SCALE, MX_WORDS, W_LEFT,
                                 MX_DEQUANT)
        if k == k_steps - 1:
            _down_store(acc, route_weight, routes, rows, offs_n, n_ok, scale_base, out_ptr, stride_sn, stride_om,
                        W_QUANT)
            acc = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
            if TILE_M2 > 0:
                _down_store(acc2, route_weight2, routes2, rows2, offs_n, n_ok, scale_base, out_ptr, stride_sn,
                            stride_om, W_QUANT)
                acc2 = tl.zeros([TILE_M2, BLOCK_N], dtype=tl.float32)


@triton.jit
def _route_weight(topk_weights_ptr, routes, rows, WEIGHT_ON_INPUT: tl.constexpr):
    """The routes' weights as a column (`[rows, 1]`), or 1 where the layer applied them to its input."""
    weight = 1.0
    if not WEIGHT_ON_INPUT:
        weight = tl.load(topk_weights_ptr + routes, mask=rows, other=0.0)[:, None]
    return weight


@triton.jit
def _down_store(acc, route_weight, routes, rows, offs_n, n_ok, scale_base, out_ptr, stride_sn, stride_om,
                W_QUANT: tl.constexpr):
    """down_kernel's finished tile: per-tensor or per-channel weight scales and the routes'
    weights applied, one output row per route."""
    acc = _scale_down_columns(acc, scale_base, offs_n, n_ok, stride_sn, W_QUANT) * route_weight
    out_rows = out_ptr + routes.to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_experts"])
def down_resident_kernel(
    a_ptr, a_scale_ptr, w_ptr, scale_ptr, out_ptr, topk_weights_ptr,
    sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr,
    num_experts, hidden, inter,
    stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    WEIGHT_ON_INPUT: tl.constexpr, W_DESC: tl.constexpr, FP8_STEPS: tl.constexpr, ONE_SCALE: tl.constexpr,
    W_LEFT: tl.constexpr, N_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_LO: tl.constexpr, K_HI: tl.constexpr,
):
    """down_kernel for a small I: the program's activation tile `[TILE_M, I]` is loaded once,
    then multiplied by its share of the N tiles in turn (N_SPLIT programs per row tile), so
    only weight tiles stream, in a loop long enough to pipeline (a program per tile has two
    to six K steps).
    - bf16/fp16 (FP8_STEPS 0): two K tiles, K_LO + K_HI >= I, powers of two (K_HI may be 0).
    - Block fp8 (FP8_STEPS > 0, at most 4): activations quantised by quantize_groups (a scale
      per row and 128 columns); FP8_STEPS K steps of 128, each dot rescaled by its row and
      block scales as _mma_step does (ONE_SCALE, W_LEFT: its options); K_LO is 128 (the
      descriptor's box), K_HI 0.
    W_DESC: weight tiles through tensor descriptors (weight_desc). Output as down_kernel's."""
    pid_m = tl.program_id(0) // N_SPLIT
    expert, routes, rows, buffer_rows = _row_tile(pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr,
                                                  num_padded_ptr, BLOCK_M, TILE_M)
    if expert < 0:
        return
    a_rows = a_ptr + buffer_rows.to(tl.int64)[:, None] * stride_am
    if FP8_STEPS > 0:
        scale_rows = a_scale_ptr + buffer_rows.to(tl.int64) * stride_asm
        a0, s0 = _resident_fp8_step_a(a_rows, scale_rows, rows, inter, 0)
        if FP8_STEPS > 1:
            a1, s1 = _resident_fp8_step_a(a_rows, scale_rows, rows, inter, 1)
        if FP8_STEPS > 2:
            a2, s2 = _resident_fp8_step_a(a_rows, scale_rows, rows, inter, 2)
        if FP8_STEPS > 3:
            a3, s3 = _resident_fp8_step_a(a_rows, scale_rows, rows, inter, 3)
    else:
        offs_lo = tl.arange(0, K_LO)
        a_lo = tl.load(a_rows + offs_lo[None, :], mask=rows[:, None] & (offs_lo < inter)[None, :], other=0.0)
        if K_HI > 0:
            offs_hi = K_LO + tl.arange(0, K_HI)
            a_hi = tl.load(a_rows + offs_hi[None, :], mask=rows[:, None] & (offs_hi < inter)[None, :], other=0.0)
    desc_lo = w_ptr
    desc_hi = w_ptr
    if W_DESC:
        desc_lo = weight_desc(w_ptr, num_experts * hidden, inter, stride_wn, BLOCK_N, K_LO)
        if K_HI > 0:
            desc_hi = weight_desc(w_ptr, num_experts * hidden, inter, stride_wn, BLOCK_N, K_HI)
    if not WEIGHT_ON_INPUT:
        route_weight = tl.load(topk_weights_ptr + routes, mask=rows, other=0.0)[:, None]
    out_rows = out_ptr + routes.to(tl.int64)[:, None] * stride_om
    tiles = tl.cdiv(hidden, BLOCK_N)
    per_program = tl.cdiv(tiles, N_SPLIT)
    first = (tl.program_id(0) % N_SPLIT) * per_program
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    scale_base = scale_ptr + expert.to(tl.int64) * stride_se
    for tile in range(first, tl.minimum(first + per_program, tiles)):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        w_row = expert * hidden + tile * BLOCK_N  # descriptors: rows past the expert's H only feed masked columns
        w_cols = w_expert + offs_n[None, :] * stride_wn
        if FP8_STEPS > 0:
            acc = tl.zeros([TILE_M, BLOCK_N], dtype=tl.float32)
            acc = _resident_fp8_step(acc, a0, s0, desc_lo, w_cols, w_row, offs_n, n_ok, scale_base, stride_sn, inter,
                                     0, W_DESC, ONE_SCALE, W_LEFT)
            if FP8_STEPS > 1:
                acc = _resident_fp8_step(acc, a1, s1, desc_lo, w_cols, w_row, offs_n, n_ok, scale_base, stride_sn,
                                         inter, 1, W_DESC, ONE_SCALE, W_LEFT)
            if FP8_STEPS > 2:
                acc = _resident_fp8_step(acc, a2, s2, desc_lo, w_cols, w_row, offs_n, n_ok, scale_base, stride_sn,
                                         inter, 2, W_DESC, ONE_SCALE, W_LEFT)
            if FP8_STEPS > 3:
                acc = _resident_fp8_step(acc, a3, s3, desc_lo, w_cols, w_row, offs_n, n_ok, scale_base, stride_sn,
                                         inter, 3, W_DESC, ONE_SCALE, W_LEFT)
        else:
            acc = tl.dot(a_lo, _resident_w(desc_lo, w_cols, w_row, n_ok, inter, 0, K_LO, W_DESC))
            if K_HI > 0:
                acc = tl.dot(a_hi, _resident_w(desc_hi, w_cols, w_row, n_ok, inter, K_LO, K_HI, W_DESC), acc)
        if not WEIGHT_ON_INPUT:
            acc *= route_weight
        tl.store(out_rows + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] & n_ok[None, :])


@triton.jit
def _resident_w(desc, w_cols, w_row, n_ok, inter, k0, BLOCK_K: tl.constexpr, W_DESC: tl.constexpr):
    """down_resident_kernel's weight tile `[BLOCK_K, BLOCK_N]`, columns k0.. of I: through the
    descriptor (its rows from `w_row` on) or by plain loads (`w_cols`, zeros past I)."""
    if W_DESC:
        w = desc.load([w_row, k0]).T
    else:
        offs = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_cols + offs[:, None], mask=(offs < inter)[:, None] & n_ok[None, :], other=0.0)
    return w


@triton.jit
def _resident_fp8_step_a(a_rows, scale_rows, rows, inter, k: tl.constexpr):
    """Block-fp8 down_resident_kernel's K step `k` of the activation tile (`[TILE_M, 128]`,
    quantised) and its row scales."""
    offs = k * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    a = tl.load(a_rows + offs[None, :], mask=rows[:, None] & (offs < inter)[None, :], other=0.0)
    return a, tl.load(scale_rows + k, mask=rows, other=0.0)


@triton.jit
def _resident_fp8_step(acc, a, a_scale, desc, w_cols, w_row, offs_n, n_ok, scale_base, stride_sn, inter,
                       k: tl.constexpr, W_DESC: tl.constexpr, ONE_SCALE: tl.constexpr, W_LEFT: tl.constexpr):
    """acc += K step `k` of a block-fp8 resident tile, rescaled (_step_scales, _mma_step)."""
    w = _resident_w(desc, w_cols, w_row, n_ok, inter, k * SCALE_BLOCK, SCALE_BLOCK, W_DESC)
    w_scale = _step_scales(scale_base, offs_n, n_ok, k, inter, stride_sn, W_BLOCK, SCALE_BLOCK, ONE_SCALE, False)
    return _mma_step(acc, a, a_scale, w, w_scale, W_BLOCK, "bf16", ONE_SCALE, False, W_LEFT, False)


@triton.jit
def _scale_down_columns(acc, scale_base, offs_n, n_ok, stride_sn, W_QUANT: tl.constexpr):
    """Per-tensor and per-channel weight scales, applied once after the K loop."""
    if W_QUANT == W_TENSOR:
        acc *= tl.load(scale_base)
    if W_QUANT == W_CHANNEL:
        acc *= tl.load(scale_base + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    return acc


@triton.jit
def down_tiny_kernel(
    act_ptr, w_ptr, scale_ptr, out_ptr, partial_ptr, counts_ptr, topk_weights_ptr, ids_ptr, map_ptr,
    hidden, inter, top_k,
    stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_ps,
    HAS_MAP: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, W_QUANT: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, A_TOKEN: tl.constexpr, MX_WORDS: tl.constexpr, MX_UNITS: tl.constexpr,
    PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PAD: tl.constexpr, ROUTE_SPLIT: tl.constexpr,
):
    """Tiny mode: out[t, n] = sum_j w_tj * (act(route t*k+j) @ w2[e_tj]^T). Matrix-vector
    products for all k routes of token t at once (their weight tiles load together) with
    the fp32 activations tiny gate/up wrote (`act [routes, I]`), and the top-k sum: no route
    buffer, no extra launch. w8a8 quantises the activation per 128-wide group (a K step of
    BLOCK_K holds one or more), or with A_TOKEN per route over all of I (a first pass over the
    partials finds each route's max).
    mxfp4 as packed bytes (_mx_products), mx_words (MX_WORDS, decoded like bf16 rows) or
    mx_units (MX_UNITS, as the gemv gate/up: _mx_units_products).
    ROUTE_SPLIT > 1: the token's routes shared by that many programs (program_id(2)), K_PAD
    each; each stores its fp32 sum at `partials[split, t, n]` and the last of them to arrive
    (_last_to_arrive) adds them up in order: more programs at once where one token's H /
    BLOCK_N programs leave multiprocessors idle. PDL (launched with launch_pdl after the tiny
    gate/up): programs start while the gate/up's last ones run, load their first weight tile
    and wait for the gate/up to finish before reading the activation (await_previous)."""
    # fp8: a step's activation groups (launch_config makes fp8 steps whole 128-wide groups)
    GROUP_K: tl.constexpr = SCALE_BLOCK if BLOCK_K >= SCALE_BLOCK else BLOCK_K
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.program_id(2) * K_PAD + tl.arange(0, K_PAD)
    n_ok = offs_n < hidden
    routes = token * top_k + offs_j
    local = _local_expert(ids_ptr, map_ptr, routes, offs_j < top_k, HAS_MAP)
    here = local >= 0
    experts = tl.maximum(local, 0).to(tl.int64)
    w_rows = w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None] * stride_wn  # [K_PAD, BLOCK_N, 1]
    w_ok = here[:, None, None] & n_ok[None, :, None]
    scale_base = scale_ptr + experts * stride_se  # [K_PAD]
    if A_TOKEN:
        await_previous(PDL)
        amax = tl.zeros([K_PAD], dtype=tl.float32)
        for k in range(0, tl.cdiv(inter, BLOCK_K)):
            a = _tiny_act(act_ptr, routes, here, k * BLOCK_K + tl.arange(0, BLOCK_K), inter)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
        token_scale = _scale_of(amax, FP8_MAX)
    acc = tl.zeros([K_PAD, BLOCK_N], dtype=tl.float32)
    if W_QUANT == W_MXFP4:
        scale_rows = scale_base[:, None, None] + offs_n[None, :, None] * stride_sn
        if MX_WORDS:  # the K_PAD x BLOCK_N rows as one list: _mx_word_offsets and _mx_decode take rows
            word_rows = tl.reshape(tl.broadcast_to(w_ptr + experts[:, None] * stride_we, [K_PAD, BLOCK_N]),
                                   [K_PAD * BLOCK_N])
            rows_n = tl.reshape(tl.broadcast_to(offs_n[None, :], [K_PAD, BLOCK_N]), [K_PAD * BLOCK_N])
            rows_ok = tl.reshape(w_ok, [K_PAD * BLOCK_N])
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        if W_QUANT == W_MXFP4 and MX_UNITS:
            offs_u = tl.arange(0, BLOCK_K // MX_UNIT_PACK)
            u_ok = (offs_u < (inter - k * BLOCK_K) // MX_UNIT_PACK)[None, None, :]  # whole chunks: I is
            units = tl.load(w_rows + k * (BLOCK_K // MX_UNIT_PACK) + offs_u[None, None, :], mask=w_ok & u_ok, other=0)
            s_first, s_second = _mx_units_scales_fp32(scale_rows, w_ok, k, inter, BLOCK_K)
            await_previous(PDL)
            x_units = act_ptr + routes[:, None, None] * inter + _mx_units_k(k, BLOCK_K)[None, None, :]
            first, second = _mx_units_products(units, x_units, here[:, None, None] & u_ok)
            sums = _mx_units_group_sums(first, second, s_first, s_second, K_PAD * BLOCK_N, BLOCK_K)
            acc += tl.reshape(tl.sum(sums, axis=1), [K_PAD, BLOCK_N])
        elif W_QUANT == W_MXFP4 and not MX_WORDS:  # BLOCK_K / 2 bytes: even k in the low nibbles, odd k in the high
            offs_b = k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            b_ok = w_ok & (offs_b < inter // 2)[None, None, :]
            packed = tl.load(w_rows + offs_b[None, None, :], mask=b_ok, other=0)
            offs_g = k * (BLOCK_K // MX_GROUP) + tl.arange(0, BLOCK_K // MX_GROUP)
            g_ok = w_ok & (offs_g < inter // MX_GROUP)[None, None, :]
            scale = tl.load(scale_rows + offs_g[None, None, :], mask=g_ok, other=127)
            await_previous(PDL)
            a_even = _tiny_act(act_ptr, routes, here, 2 * offs_b, inter)
            a_odd = _tiny_act(act_ptr, routes, here, 2 * offs_b + 1, inter)
            products = tl.reshape(_mx_products(packed, a_even[:, None, :], a_odd[:, None, :]),
                                  [K_PAD * BLOCK_N, BLOCK_K // 2])
            sums = _mx_group_sums(products, tl.reshape(scale, [K_PAD * BLOCK_N, BLOCK_K // MX_GROUP]),
                                  K_PAD * BLOCK_N, BLOCK_K)
            acc += tl.reshape(tl.sum(sums, axis=1), [K_PAD, BLOCK_N])
        else:
            offs_k = k * BLOCK_K + tl.arange(0, BLOCK_K)
            if MX_WORDS:
                words, words_ok = _mx_word_offsets(rows_n, k, inter, BLOCK_K)
                words = tl.load(word_rows[:, None, None] + words, mask=rows_ok[:, None, None] & words_ok, other=0)
                offs_g = k * (BLOCK_K // MX_GROUP) + tl.arange(0, BLOCK_K // MX_GROUP)
                g_ok = w_ok & (offs_g < inter // MX_GROUP)[None, None, :]
                scale_offs = _mx_scale_offsets(offs_n[None, :, None], offs_g[None, None, :], stride_sn)
                scale = tl.reshape(tl.load(scale_base[:, None, None] + scale_offs, mask=g_ok, other=127),
                                   [K_PAD * BLOCK_N, BLOCK_K // MX_GROUP])
                w = tl.reshape(_mx_decode(words, scale), [K_PAD, BLOCK_N, BLOCK_K])
            else:
                w = tl.load(w_rows + offs_k[None, None, :], mask=w_ok & (offs_k < inter)[None, None, :], other=0.0)
            await_previous(PDL)
            a = _tiny_act(act_ptr, routes, here, offs_k, inter)
            if A_TOKEN:  # what the w8a8 GEMM computes: quantise-dequantise the input
                a = _quantize_with(a, token_scale, FP8, FP8_MAX).to(tl.float32) * token_scale[:, None]
            elif W_QUANT != W_NONE and W_QUANT != W_MXFP4:  # each 128-wide group of the step on its own
                q, a_scale = _quantize_rows(tl.reshape(a, [K_PAD * GROUPS, GROUP_K]), FP8, FP8_MAX)
                a = tl.reshape(q.to(tl.float32) * a_scale[:, None], [K_PAD, BLOCK_K])
            w = w.to(tl.float32)
            if W_QUANT == W_BLOCK:  # each group's block scale on its 128 weights of a row
                offs_g = k * GROUPS + tl.arange(0, GROUPS)
                block_scale = (scale_base[:, None, None] + (offs_n // SCALE_BLOCK)[None, :, None] * stride_sn
                               + offs_g[None, None, :])
                g_ok = w_ok & (offs_g < tl.cdiv(inter, SCALE_BLOCK))[None, None, :]
                w_groups = tl.reshape(w, [K_PAD, BLOCK_N, GROUPS, GROUP_K])
                w = tl.reshape(w_groups * tl.load(block_scale, mask=g_ok, other=0.0)[:, :, :, None],
                               [K_PAD, BLOCK_N, BLOCK_K])
            acc += tl.sum(w * a[:, None, :], axis=2)
    if W_QUANT == W_TENSOR:
        acc *= tl.load(scale_base, mask=here, other=0.0)[:, None]
    if W_QUANT == W_CHANNEL:
        acc *= tl.load(scale_base[:, None] + offs_n[None, :] * stride_sn, mask=here[:, None] & n_ok[None, :],
                       other=0.0)
    if not WEIGHT_ON_INPUT:
        acc *= tl.load(topk_weights_ptr + routes, mask=here, other=0.0)[:, None]
    out = tl.sum(tl.where(here[:, None], acc, 0.0), axis=0)
    if ROUTE_SPLIT > 1:
        part_ptrs = partial_ptr + token * hidden + offs_n
        tl.store(part_ptrs + tl.program_id(2) * stride_ps, out, mask=n_ok)
        if _last_to_arrive(counts_ptr, token * tl.num_programs(1) + tl.program_id(1), ROUTE_SPLIT):
            out = _sum_splits(part_ptrs, stride_ps, n_ok, ROUTE_SPLIT)
            tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(out_ptr + token * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _tiny_act(act_ptr, routes, here, offs_k, inter):
    """down_tiny_kernel's input: columns `offs_k` of each route's activation (`[K_PAD, BLOCK_K]`
    fp32; 0 where masked)."""
    return tl.load(act_ptr + routes[:, None] * inter + offs_k[None, :], mask=here[:, None] & (offs_k < inter)[None, :],
                   other=0.0)


@triton.jit
def sum_routes_kernel(
    routes_ptr, out_ptr, ids_ptr, map_ptr, hidden, top_k,
    HAS_MAP: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum over t's routes on this rank of routes[t*k + j] (fp32 sum; fixed order)."""
    token = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, K_PAD)
    route_ids = token * top_k + offs_j
    local = _local_expert(ids_ptr, map_ptr, route_ids, offs_j < top_k, HAS_MAP)
    h_ok = offs_h < hidden
    values = tl.load(routes_ptr + route_ids.to(tl.int64)[:, None] * hidden + offs_h[None, :],
                     mask=(local >= 0)[:, None] & h_ok[None, :], other=0.0)
    total = tl.sum(values.to(tl.float32), axis=0)
    tl.store(out_ptr + token * hidden + offs_h, total.to(out_ptr.dtype.element_ty), mask=h_ok)


def settle_cache_keys(namespace: dict[str, object]) -> None:
    """Computes the hash of every JIT function in `namespace` (a kernel module's globals), in
    the order they are defined. Triton 3.6 adds a called function's constexpr globals to a
    kernel's hash only when the callee's own hash was computed before, so a kernel's disk-cache
    key hung on which kernels a process had launched first: the tuner's timing process, which
    reuses what its compile workers built, compiled every kernel again (on an H200 a one-token
    point's timing pass spent 166 of its 174 s there). One order in every process gives one
    hash. (Triton 3.9 hashes the same in any order.) Nothing in Triton's interpreter, which
    compiles nothing (and whose functions have no hash)."""
    if triton.knobs.runtime.interpret:
        return
    for value in list(namespace.values()):
        if isinstance(value, triton.runtime.jit.JITFunction):
            _ = value.cache_key  # computed once, then kept by the function


settle_cache_keys(globals())
