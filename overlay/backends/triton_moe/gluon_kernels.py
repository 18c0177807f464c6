"""Gate/up kernels for NVIDIA Hopper (sm_90) in Gluon, Triton's lower-level dialect, where
layouts and waits are written out. Only sorted mode (kernels.align_*) and one warpgroup (4
warps); the plan (plan.py) decides, and everything else, ROCm included, runs
kernels.gate_up_kernel, which computes the same sums in the same order: the outputs are equal,
bit for bit, on an H200.

Block fp8 (gate_up_block_fp8_kernel). 128x128-block weights need each K step's product scaled
on its own: acc += (a @ w) * a_scale * w_scale. Triton's `tl` loop waits for each step's wgmma
at once and then rescales, so the tensor cores idle during every rescale (kernels._mma_step;
docs/performance.md). Here each step's wgmma starts on fresh registers and the previous step's
product is rescaled while it runs (`warpgroup_mma_wait(1)`). No product in flight crosses a
loop back-edge: LLVM copies loop-carried values with moves, and ptxas then serialises every
wgmma (C7514). So the K loop walks PASS steps a pass, unrolled, each pass waiting for its last
dot. Blocks of 64 rows, gate and up rows interleaved by the pointers into one tile (column 2n
gate row n, 2n+1 up row n; the weights stay canonical).

mx_words (gate_up_mx_words_kernel, down_mx_words_kernel). The `tl` kernels' e8m0 scales reach
the decode through shared memory (Triton lays their 1-byte load out apart from the words and
converts), and they wait for each wgmma before decoding the next tile. Here the words load
into the layout wgmma takes them in decoded (mx_words_layout), the scales straight into that
layout a step ahead, and of a K step's two weight tiles (gate and up; a down N tile's two
halves) the second decodes while the first's wgmma runs.

Triton 3.6 and 3.9 name two calls differently: both are looked up once here.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .configs import GLUON_BLOCK_M
from .kernels import (
    MX_GROUP,
    MX_WORD_CHUNK,
    MX_WORD_ROWS,
    SCALE_BLOCK,
    _activate,
    _grid_position,
    _last_to_arrive,
    _local_expert,
    _mx_pairs,
    _mx_scale_bits,
    _mx_scale_offsets,
    _sum_splits,
    _tiny_store,
    settle_cache_keys,
)
from .nvidia import await_previous, let_next_start

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
BLOCK_M: gl.constexpr = gl.constexpr(GLUON_BLOCK_M)  # one warpgroup's wgmma rows
PASS: gl.constexpr = gl.constexpr(2)  # K steps a pass: hidden must be a multiple of PASS * BLOCK_K


@gluon.jit
def _block_rows(pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr, top_k, BLOCK_M: gl.constexpr,
                layout: gl.constexpr):
    """Sorted block `pid_m` (kernels.align_*): its rows' count (0 for a block past the padded
    total: the program has nothing to do), its expert, and which of its BLOCK_M rows hold a
    route and their tokens, laid out as `layout`."""
    count = gl.load(block_rows_ptr + pid_m)
    if pid_m * BLOCK_M >= gl.load(num_padded_ptr):
        count = 0
    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    offs = gl.arange(0, BLOCK_M, layout=layout)
    rows = offs < count
    tokens = (gl.load(sorted_ptr + pid_m * BLOCK_M + offs, mask=rows, other=0) // top_k).to(gl.int64)
    return count, expert, rows, tokens


@gluon.jit
def _load_step(x_ptr, w_ptr, a_smem, w_smem, slot, tokens, rows, w_rows, k, stride_xm, stride_wn,
               BLOCK_K: gl.constexpr, blk: gl.constexpr):
    """Asynchronous copies of K step `k`'s activation rows and weight tile into ring slot
    `slot`, as one commit group."""
    offs_k = k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, blk))
    _async_load(a_smem.index(slot), x_ptr + tokens[:, None] * stride_xm + offs_k[None, :], mask=rows[:, None])
    _async_load(w_smem.index(slot), w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :])
    async_copy.commit_group()


@gluon.jit
def _landed(STAGES: gl.constexpr):
    """The next step's tiles are in shared memory (every thread's copies) and visible to wgmma."""
    async_copy.wait_group(STAGES - 2)
    _barrier()
    fence_async_shared()


@gluon.jit
def _refill(x_ptr, w_ptr, a_smem, w_smem, tokens, rows, w_rows, done, k_steps, stride_xm, stride_wn,
            BLOCK_K: gl.constexpr, STAGES: gl.constexpr, blk: gl.constexpr):
    """Step `done`'s dot has finished (one warpgroup: its wait covers every warp): its slot
    takes step done + STAGES, or an empty group keeps one group a step."""
    load_k = done + STAGES
    if load_k < k_steps:
        _load_step(x_ptr, w_ptr, a_smem, w_smem, load_k % STAGES, tokens, rows, w_rows, load_k, stride_xm,
                   stride_wn, BLOCK_K, blk)
    else:
        async_copy.commit_group()


@gluon.jit
def _step_scales(xs_ptr, scale_base, tokens, rows, gate_block, up_block, k, stride_xsm, stride_sn):
    """K step `k`'s scales: each row's activation scale, the gate's and the up's weight block
    scale (multiplied out where a product is rescaled: _rescale)."""
    a_scale = gl.load(xs_ptr + tokens * stride_xsm + k, mask=rows, other=0.0)
    return a_scale, gl.load(scale_base + gate_block * stride_sn + k), gl.load(scale_base + up_block * stride_sn + k)


@gluon.jit
def _rescale(acc, product, scales, is_up):
    """acc + product * (row scale x column's block scale): one multiply-add an element."""
    a_scale, gate_scale, up_scale = scales
    return acc + product * (a_scale[:, None] * gl.where(is_up, up_scale, gate_scale)[None, :])


@gluon.jit
def gate_up_block_fp8_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, topk_weights_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr,
    num_padded_ptr, inter, hidden, top_k,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_om, beta, linear_beta,
    WEIGHT_ON_INPUT: gl.constexpr, ACTIVATION: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """out[row, n] = act(x[t] @ gate[e]^T, x[t] @ up[e]^T) for a 64-row block and BLOCK_N
    columns of I, as kernels.gate_up_kernel in sorted mode: `x` fp8 `[M, H]` with its group
    scales `xs`, `w` fp8 `[E, 2I, H]` (gate rows, then up rows) with block scales `ws`. A
    program per (block, N tile), N tiles side by side."""
    NW: gl.constexpr = 2 * BLOCK_N
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, NW, 32])
    smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    num_n = inter // BLOCK_N
    pid_m = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    # rows, as the copies (blk) and as the products (mma) lay them out
    count, expert, rows, tokens = _block_rows(pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr,
                                              top_k, BLOCK_M, gl.SliceLayout(1, blk))
    if count <= 0:
        return
    r_mma = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    rows_m = r_mma < count
    routes_m = gl.load(sorted_ptr + pid_m * BLOCK_M + r_mma, mask=rows_m, other=0)
    tokens_m = routes_m // top_k
    cols = gl.arange(0, NW, layout=gl.SliceLayout(1, blk))
    w_rows = expert * (stride_we // stride_wn) + pid_n * BLOCK_N + cols // 2 + (cols % 2) * inter
    is_up = gl.arange(0, NW, layout=gl.SliceLayout(0, mma)) % 2 == 1
    scale_base = ws_ptr + expert * stride_se
    gate_block = (pid_n * BLOCK_N) // SCALE_BLOCK
    up_block = (inter + pid_n * BLOCK_N) // SCALE_BLOCK

    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], smem)
    w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, NW, BLOCK_K], smem)
    k_steps = hidden // BLOCK_K
    for s in gl.static_range(STAGES):  # steps 0 .. STAGES - 1, those that exist
        _refill(x_ptr, w_ptr, a_smem, w_smem, tokens, rows, w_rows, s - STAGES, k_steps, stride_xm, stride_wn,
                BLOCK_K, STAGES, blk)
    zero = gl.zeros([BLOCK_M, NW], gl.float32, layout=mma)
    acc = gl.zeros([BLOCK_M, NW], gl.float32, layout=mma)
    for k in range(0, k_steps, PASS):
        _landed(STAGES)
        slot = k % STAGES
        cur = warpgroup_mma(a_smem.index(slot), w_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        scales = _step_scales(xs_ptr, scale_base, tokens_m, rows_m, gate_block, up_block, k, stride_xsm, stride_sn)
        for j in gl.static_range(1, PASS):
            _landed(STAGES)
            nslot = (k + j) % STAGES
            nxt = warpgroup_mma(a_smem.index(nslot), w_smem.index(nslot).permute((1, 0)), zero, use_acc=False,
                                is_async=True)
            cur = warpgroup_mma_wait(num_outstanding=1, deps=(cur,))
            acc = _rescale(acc, cur, scales, is_up)
            scales = _step_scales(xs_ptr, scale_base, tokens_m, rows_m, gate_block, up_block, k + j, stride_xsm,
                                  stride_sn)
            _refill(x_ptr, w_ptr, a_smem, w_smem, tokens, rows, w_rows, k + j - 1, k_steps, stride_xm, stride_wn,
                    BLOCK_K, STAGES, blk)
            cur = nxt
        cur = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
        acc = _rescale(acc, cur, scales, is_up)
        _refill(x_ptr, w_ptr, a_smem, w_smem, tokens, rows, w_rows, k + PASS - 1, k_steps, stride_xm, stride_wn,
                BLOCK_K, STAGES, blk)
    if WEIGHT_ON_INPUT:  # (w * x) @ W == w * (x @ W)
        acc *= gl.load(topk_weights_ptr + routes_m, mask=rows_m, other=0.0)[:, None]
    gate, up = gl.split(gl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
    out = gl.convert_layout(_activate(gate, up, beta, linear_beta, ACTIVATION).to(out_ptr.dtype.element_ty),
                           out_layout)
    r_out = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
    c_out = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
    ptrs = out_ptr + (pid_m * BLOCK_M + r_out)[:, None] * stride_om + c_out[None, :]
    gl.store(ptrs, out, mask=(r_out < count)[:, None])


MX_WGMMA_ROWS = 64  # weight rows of one warpgroup's wgmma: the mx_words kernel's N tiles are whole ones
WORDS_PER_CHUNK: gl.constexpr = gl.constexpr(MX_WORD_ROWS.value * MX_WORD_CHUNK.value)  # a 16-row group's 64-K chunk
GROUP_WORDS: gl.constexpr = gl.constexpr(4)  # a row's words of one 32-K scale group
CHUNK_GROUPS: gl.constexpr = gl.constexpr(MX_WORD_CHUNK.value // GROUP_WORDS.value)  # scale groups of a 64-K chunk
SCALE_K_BYTES: gl.constexpr = gl.constexpr(16)  # layout.mx_scale_words: a 16-row group's scales, bytes a 32-K group


A_BLK: gl.constexpr = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # mx kernels' activation copies
OUT_LAYOUT: gl.constexpr = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))  # and their stores


def mx_layouts(rows: int, block_m: int, block_k: int) -> dict[str, object]:
    """The mx_words kernels' layouts for weight tiles of `rows` (gate, up or a down half),
    blocks of `block_m` and K steps of `block_k` (one warpgroup): the words' copies (W_BLK),
    their decode's (W_LAYOUT, mx_words_layout), their scales' words (S_LAYOUT,
    mx_scale_layout) and the wgmma's accumulator (MMA)."""
    groups = block_k // MX_GROUP.value
    return {"W_LAYOUT": mx_words_layout(rows, groups), "S_LAYOUT": mx_scale_layout(rows, groups),
            "W_BLK": gl.BlockedLayout([1, 1, GROUP_WORDS.value], [32 // groups, groups, 1], [4, 1, 1], [2, 1, 0]),
            "MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_m, 16])}


def mx_words_layout(rows: int, groups: int) -> gl.DistributedLinearLayout:
    """`[rows, groups, 4]` mx_words of one K step where wgmma wants them decoded (4 warps, a
    warpgroup): a lane's word (row, c, t) decodes to exactly its bf16 A-operand registers
    (rows r and r + 8, K = 32c + 16h + 8q + 2t + p). Lane % 4 is t, lane / 4 the row within
    8; registers the row + 8, the group and the 64-row wgmma tiles; warps the 16-row slices."""
    regs = [[8, 0, 0]] + [[0, 1 << i, 0] for i in range(groups.bit_length() - 1)]
    regs += [[MX_WGMMA_ROWS << i, 0, 0] for i in range((rows // MX_WGMMA_ROWS).bit_length() - 1)]
    lanes = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warps = [[16, 0, 0], [32, 0, 0]]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [rows, groups, GROUP_WORDS.value])


def mx_scale_layout(rows: int, groups: int) -> gl.DistributedLinearLayout:
    """`[rows / 2, groups / 2]` words of layout.mx_scale_words (word (p, j): rows 16(p / 8) + p %
    8 and + 8, groups 2j and 2j + 1) where each lane of mx_words_layout finds its rows' scales:
    lane / 4 the row within 8 (the four lanes of a row load the same word), registers the 64-K
    chunks and the 64-row wgmma tiles, warps the 16-row slices."""
    regs = [[0, 1 << i] for i in range((groups // 2).bit_length() - 1)]
    regs += [[MX_WGMMA_ROWS // 2 << i, 0] for i in range((rows // MX_WGMMA_ROWS).bit_length() - 1)]
    lanes = [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]]
    warps = [[8, 0], [16, 0]]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [rows // 2, groups // 2])


@gluon.jit
def _bf16x2_mul(pair, scale2):
    """bf16x2 `pair` times bf16x2 `scale2`, both as int32: one instruction for two weights."""
    return gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [pair, scale2], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _bf16_halves(pair):
    """An int32 bf16x2 pair -> `[..., 2]` bf16, low half first."""
    return gl.join(pair.to(gl.int16), (pair >> 16).to(gl.int16)).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _bf16x2_scale(words, byte: gl.constexpr):
    """Byte `byte` of each scale word, an e8m0 scale, as _mx_decode's bf16x2 multiplier (int32,
    both halves _mx_scale_bits' 2^(s - 1))."""
    bits = _mx_scale_bits((words >> (8 * byte)) & 0xFF)
    return bits | (bits << 16)


@gluon.jit
def _mx_scales(ptrs, W_LAYOUT: gl.constexpr):
    """The e8m0 scales of a K step of weight rows as the bf16x2 multipliers _mx_decode takes,
    `[rows, C]` laid out as W_LAYOUT's rows and groups: one word a lane and 64-K chunk at `ptrs`
    (`[rows / 2, C / 2]`, mx_scale_layout; layout.mx_scale_words: byte 2h + g row + 8h, group
    2j + g), converted as it loads and carried to the next step converted."""
    words = gl.load(ptrs.to(gl.pointer_type(gl.int32)))
    pairs: gl.constexpr = words.shape[0]
    chunks: gl.constexpr = words.shape[1]
    scales = gl.join(gl.join(_bf16x2_scale(words, 0), _bf16x2_scale(words, 1)),
                     gl.join(_bf16x2_scale(words, 2), _bf16x2_scale(words, 3)))  # [p, j, g, h]
    scales = gl.permute(gl.reshape(scales, [pairs // 8, 8, chunks, 2, 2]), (0, 4, 1, 2, 3))  # [p / 8, h, p % 8, j, g]
    return gl.convert_layout(gl.reshape(scales, [2 * pairs, 2 * chunks]), gl.SliceLayout(2, W_LAYOUT),
                             assert_trivial=True)


@gluon.jit
def _mx_decode(words, scale2, a_layout: gl.constexpr):
    """`[rows, C, 4]` words (mx_words_layout) and their `[rows, C]` scales (_mx_scales) -> the
    bf16 `[rows, 32C]` weight tile, K in order, as wgmma's register operand `a_layout`; the
    conversion is asserted to move no data."""
    scale2 = gl.expand_dims(scale2, 2)
    p0, p1, p2, p3 = _mx_pairs(words)
    full = gl.join(gl.join(_bf16_halves(_bf16x2_mul(p0, scale2)), _bf16_halves(_bf16x2_mul(p1, scale2))),
                   gl.join(_bf16_halves(_bf16x2_mul(p2, scale2)), _bf16_halves(_bf16x2_mul(p3, scale2))))
    # [rows, C, T, P, Q, H] -> [rows, C, H, Q, T, P]: K = 32c + 16h + 8q + 2t + p
    full = gl.reshape(gl.permute(full, (0, 1, 5, 4, 2, 3)), [words.shape[0], words.shape[1] * MX_GROUP])
    return gl.convert_layout(full, a_layout, assert_trivial=True)


@gluon.jit
def _mx_copy_step(a_src, w_src, up_offs, a_smem, g_smem, u_smem, slot, rows, live):
    """Asynchronous copies of one K step into ring slot `slot`, as one commit group (an empty
    one when not `live`): the activation rows at `a_src` (zeros where not `rows`) and the
    words at `w_src` and `w_src + up_offs` (gate and up, or a down tile's two halves)."""
    if live:
        _async_load(a_smem.index(slot), a_src, mask=rows[:, None])
    _mx_copy_words(w_src, up_offs, g_smem, u_smem, slot, live)


@gluon.jit
def _mx_copy_words(w_src, up_offs, g_smem, u_smem, slot, live):
    """The words at `w_src` and `w_src + up_offs` copied into ring slot `slot` asynchronously,
    closing the step's commit group (an empty one when not `live`)."""
    if live:
        _async_load(g_smem.index(slot), w_src)
        _async_load(u_smem.index(slot), w_src + up_offs)
    async_copy.commit_group()


@gluon.jit
def _mx_tile_ptrs(w_ptr, ws_ptr, expert, first_row, words_per_row, stride_we, stride_se, stride_sn,
                  ROWS: gl.constexpr, C: gl.constexpr, W_BLK: gl.constexpr, s_layout: gl.constexpr):
    """Pointers to K step 0's words of an expert's weight rows first_row .. + ROWS (a multiple
    of 16), `[ROWS, C, 4]` laid out as W_BLK (mx_words keeps `[N/16, K/64, 16, 8]` words an
    expert: layout.mx_words), and to their e8m0 scales' words, `[ROWS / 2, C / 2]` laid out as
    `s_layout` (mx_scale_layout; the pointers are to bytes: a K step moves them C *
    SCALE_K_BYTES)."""
    wr = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, W_BLK)))
    wc = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(2, W_BLK)))
    wt = gl.arange(0, GROUP_WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, W_BLK)))
    row_offs = (wr // MX_WORD_ROWS) * (MX_WORD_ROWS * words_per_row) + (wr % MX_WORD_ROWS) * MX_WORD_CHUNK
    group_offs = (wc // CHUNK_GROUPS) * WORDS_PER_CHUNK + (wc % CHUNK_GROUPS) * GROUP_WORDS
    words = w_ptr + expert * stride_we + row_offs[:, None, None] + group_offs[None, :, None] + wt[None, None, :]
    pairs = gl.arange(0, ROWS // 2, layout=gl.SliceLayout(1, s_layout))
    sr = first_row + pairs // (MX_WORD_ROWS // 2) * MX_WORD_ROWS + pairs % (MX_WORD_ROWS // 2)  # the word's rows i
    sc = 2 * gl.arange(0, C // 2, layout=gl.SliceLayout(0, s_layout))
    return words, ws_ptr + expert * stride_se + _mx_scale_offsets(sr[:, None], sc[None, :], stride_sn)


@gluon.jit
def _mx_ring(STAGES: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr, BLOCK_K: gl.constexpr):
    """The mx_words kernels' ring in shared memory: STAGES slots of BLOCK_M activation rows and
    of two `[ROWS, C, 4]` word tiles (gate and up, or a down tile's two halves)."""
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16))
    g_smem, u_smem = _mx_word_ring(STAGES, ROWS, BLOCK_K)
    return a_smem, g_smem, u_smem


@gluon.jit
def _mx_word_ring(STAGES: gl.constexpr, ROWS: gl.constexpr, BLOCK_K: gl.constexpr):
    """_mx_ring's two word tiles a slot, `[ROWS, C, 4]` each."""
    C: gl.constexpr = BLOCK_K // MX_GROUP
    words_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    g_smem = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, C, GROUP_WORDS], words_smem)
    u_smem = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, C, GROUP_WORDS], words_smem)
    return g_smem, u_smem


@gluon.jit
def _mx_two_dots(acts, g_smem, u_smem, slot, g_scales, u_scales, acc_g, acc_u, W_LAYOUT: gl.constexpr,
                 a_op: gl.constexpr):
    """One K step of ring slot `slot`: the first word tile decoded and its wgmma started, the
    second decoded while it runs, both against `acts` (`[K, N]` in shared memory); one wait."""
    first = warpgroup_mma(_mx_decode(g_smem.index(slot).load(W_LAYOUT), g_scales, a_op), acts, acc_g, is_async=True)
    second = warpgroup_mma(_mx_decode(u_smem.index(slot).load(W_LAYOUT), u_scales, a_op), acts, acc_u,
                           is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(first, second))


@gluon.jit
def _mx_gate_up_ptrs(x_ptr, w_ptr, ws_ptr, expert, pid_n, tokens, inter, hidden, stride_xm, stride_we, stride_se,
                     stride_sn, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, W_BLK: gl.constexpr,
                     S_LAYOUT: gl.constexpr):
    """K step 0's words and scales of an expert's gate rows pid_n * BLOCK_N .. + BLOCK_N
    (_mx_tile_ptrs), the offsets of the up rows' (words, scales), and the activation rows of
    `tokens` (laid out as A_BLK's rows)."""
    words_per_row = hidden // 8
    w_words, s_ptrs = _mx_tile_ptrs(w_ptr, ws_ptr, expert, pid_n * BLOCK_N, words_per_row, stride_we, stride_se,
                                    stride_sn, BLOCK_N, BLOCK_K // MX_GROUP, W_BLK, S_LAYOUT)
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, A_BLK))
    a_rows = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    return w_words, s_ptrs, inter * words_per_row, inter * stride_sn, a_rows


@gluon.jit
def _mx_gate_up_sums(a_rows, rows, w_words, s_ptrs, up_offs, s_up, k_first, k_steps, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, W_LAYOUT: gl.constexpr,
                     MMA: gl.constexpr):
    """The gate's and the up's fp32 sums, `[BLOCK_N, BLOCK_M]` laid out as MMA, over K steps
    k_first .. k_first + k_steps (one at least) of the activation rows at `a_rows` (zeros
    where not `rows`) against the words at `w_words` and `w_words + up_offs`, their scales at
    `s_ptrs` and `s_ptrs + s_up` (pointers of K step 0). A ring of STAGES slots, STAGES - 1
    steps in flight; the scales load straight into W_LAYOUT a step ahead; the up tile decodes
    while the gate's wgmma runs (_mx_two_dots)."""
    C: gl.constexpr = BLOCK_K // MX_GROUP
    STEP_WORDS: gl.constexpr = BLOCK_K // (CHUNK_GROUPS * MX_GROUP) * WORDS_PER_CHUNK
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    a_rows += k_first * BLOCK_K
    w_words += k_first * STEP_WORDS
    s_ptrs += k_first * C * SCALE_K_BYTES
    a_smem, g_smem, u_smem = _mx_ring(STAGES, BLOCK_M, BLOCK_N, BLOCK_K)
    for s in gl.static_range(STAGES - 1):
        _mx_copy_step(a_rows + s * BLOCK_K, w_words + s * STEP_WORDS, up_offs, a_smem, g_smem, u_smem, s, rows,
                      s < k_steps)
    acc_g = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
    acc_u = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
    g_scales = _mx_scales(s_ptrs, W_LAYOUT)
    u_scales = _mx_scales(s_ptrs + s_up, W_LAYOUT)
    for k in range(k_steps):
        ahead = gl.minimum(k + 1, k_steps - 1) * C * SCALE_K_BYTES
        g_next = _mx_scales(s_ptrs + ahead, W_LAYOUT)
        u_next = _mx_scales(s_ptrs + s_up + ahead, W_LAYOUT)
        _landed(STAGES)
        # the slot step k - 1 used: every warp is past it (the barrier) and its wgmmas are done
        load_k = k + STAGES - 1
        _mx_copy_step(a_rows + load_k * BLOCK_K, w_words + load_k * STEP_WORDS, up_offs, a_smem, g_smem, u_smem,
                      load_k % STAGES, rows, load_k < k_steps)
        acc_g, acc_u = _mx_two_dots(a_smem.index(k % STAGES).permute((1, 0)), g_smem, u_smem, k % STAGES, g_scales,
                                    u_scales, acc_g, acc_u, W_LAYOUT, a_op)
        g_scales = g_next
        u_scales = u_next
    return acc_g, acc_u


@gluon.jit(do_not_specialize=["num_blocks_m"])
def gate_up_mx_words_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, topk_weights_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr,
    num_blocks_m, inter, hidden, top_k, stride_xm, stride_we, stride_se, stride_sn, stride_om, beta, linear_beta,
    WEIGHT_ON_INPUT: gl.constexpr, ACTIVATION: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, W_LAYOUT: gl.constexpr,
    S_LAYOUT: gl.constexpr, W_BLK: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr,
):
    """kernels.gate_up_kernel in sorted mode for mx_words with 16-bit activations: BLOCK_N gate
    and up weight rows a program, decoded each K step into wgmma's register operand (the weight
    tile on the left, the block's BLOCK_M activation rows from shared memory on the right).
    The e8m0 scales load straight into the words' register layout (W_LAYOUT, mx_words_layout),
    a step ahead; the up tile decodes while the gate's wgmma runs. Programs walk (block, N
    tile) as kernels.gate_up_kernel does (GROUP_M blocks side by side)."""
    pid_m, pid_n = _grid_position(gl.program_id(0), num_blocks_m, inter, BLOCK_N, GROUP_M)
    count, expert, rows, tokens = _block_rows(pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr,
                                              top_k, BLOCK_M, gl.SliceLayout(1, A_BLK))
    if count <= 0:
        return
    w_words, s_ptrs, up_offs, s_up, a_rows = _mx_gate_up_ptrs(x_ptr, w_ptr, ws_ptr, expert, pid_n, tokens, inter,
                                                              hidden, stride_xm, stride_we, stride_se, stride_sn,
                                                              BLOCK_N, BLOCK_K, W_BLK, S_LAYOUT)
    acc_g, acc_u = _mx_gate_up_sums(a_rows, rows, w_words, s_ptrs, up_offs, s_up, 0, hidden // BLOCK_K, BLOCK_M,
                                    BLOCK_N, BLOCK_K, STAGES, W_LAYOUT, MMA)
    gate = gl.convert_layout(gl.permute(acc_g, (1, 0)), OUT_LAYOUT)
    up = gl.convert_layout(gl.permute(acc_u, (1, 0)), OUT_LAYOUT)
    r_out = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OUT_LAYOUT))
    if WEIGHT_ON_INPUT:  # (w * x) @ W == w * (x @ W)
        routes = gl.load(sorted_ptr + pid_m * BLOCK_M + r_out, mask=r_out < count, other=0)
        weight = gl.load(topk_weights_ptr + routes, mask=r_out < count, other=0.0)[:, None]
        gate *= weight
        up *= weight
    out = _activate(gate, up, beta, linear_beta, ACTIVATION).to(out_ptr.dtype.element_ty)
    c_out = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT_LAYOUT))
    ptrs = out_ptr + (pid_m * BLOCK_M + r_out)[:, None] * stride_om + c_out[None, :]
    gl.store(ptrs, out, mask=(r_out < count)[:, None])


@gluon.jit(do_not_specialize=["num_routes"])
def gate_up_mx_words_tiny_kernel(
    x_ptr, w_ptr, ws_ptr, partial_ptr, act_ptr, counts_ptr, topk_weights_ptr, ids_ptr, map_ptr, num_routes, inter,
    hidden, top_k, stride_xm, stride_we, stride_se, stride_sn, stride_ps, beta, linear_beta,
    HAS_MAP: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr, ACTIVATION: gl.constexpr, PDL: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr,
    STAGES: gl.constexpr, W_LAYOUT: gl.constexpr, S_LAYOUT: gl.constexpr, W_BLK: gl.constexpr, MMA: gl.constexpr,
    num_warps: gl.constexpr,
):
    """kernels.gate_up_kernel in tiny mode for mx_words with 16-bit activations: no sort; the
    program of route slot s (program_id(0): slot, then N tile) takes every route of slot s's
    expert as a row, and only the first such slot runs (kernels._tiny_rows). Its K steps are
    the program_id(1)-th of SPLIT_K equal parts, run as gate_up_mx_words_kernel runs a block
    (_mx_gate_up_sums); the sums reach the fp32 activation `act [routes, I]` through
    kernels._tiny_store (the last split to arrive adds the partials up). PDL: the down may
    launch once every program here has started (nvidia.let_next_start)."""
    let_next_start(PDL)
    num_n = inter // BLOCK_N
    slot = gl.program_id(0) // num_n
    pid_n = gl.program_id(0) % num_n
    expert, rows, routes = _tiny_slot_rows(slot, ids_ptr, map_ptr, num_routes, HAS_MAP, BLOCK_M,
                                           gl.SliceLayout(1, A_BLK))
    if expert < 0:
        return
    w_words, s_ptrs, up_offs, s_up, a_rows = _mx_gate_up_ptrs(x_ptr, w_ptr, ws_ptr, expert, pid_n, routes // top_k,
                                                              inter, hidden, stride_xm, stride_we, stride_se,
                                                              stride_sn, BLOCK_N, BLOCK_K, W_BLK, S_LAYOUT)
    k_steps = hidden // BLOCK_K // SPLIT_K
    acc_g, acc_u = _mx_gate_up_sums(a_rows, rows, w_words, s_ptrs, up_offs, s_up, gl.program_id(1) * k_steps, k_steps,
                                    BLOCK_M, BLOCK_N, BLOCK_K, STAGES, W_LAYOUT, MMA)
    gate = gl.convert_layout(gl.permute(acc_g, (1, 0)), OUT_LAYOUT)
    up = gl.convert_layout(gl.permute(acc_u, (1, 0)), OUT_LAYOUT)
    _, rows_o, routes_o = _tiny_slot_rows(slot, ids_ptr, map_ptr, num_routes, HAS_MAP, BLOCK_M,
                                          gl.SliceLayout(1, OUT_LAYOUT))
    if WEIGHT_ON_INPUT:  # (w * x) @ W == w * (x @ W)
        weight = gl.load(topk_weights_ptr + routes_o, mask=rows_o, other=0.0)[:, None]
        gate *= weight
        up *= weight
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT_LAYOUT))
    _tiny_store(gate, up, routes_o, rows_o[:, None] & (offs_n < inter)[None, :], offs_n, partial_ptr, act_ptr,
                counts_ptr, inter, stride_ps, beta, linear_beta, ACTIVATION, SPLIT_K)


@gluon.jit
def _tiny_slot_rows(slot, ids_ptr, map_ptr, num_routes, HAS_MAP: gl.constexpr, BLOCK_M: gl.constexpr,
                    layout: gl.constexpr):
    """kernels._tiny_rows laid out as `layout`: the expert of route slot `slot` (-1 unless
    `slot` is the first route that goes to it), which of the BLOCK_M routes go to it, and
    the routes' ids."""
    offs = gl.arange(0, BLOCK_M, layout=layout)
    local = _local_expert(ids_ptr, map_ptr, offs, offs < num_routes, HAS_MAP)
    expert = _local_expert(ids_ptr, map_ptr, slot, slot < num_routes, HAS_MAP)
    rows = (local == expert) & (local >= 0)
    first = gl.min(gl.where(rows, offs, BLOCK_M), 0)
    return gl.where(first == slot, expert, -1).to(gl.int64), rows, offs


@gluon.jit
def down_mx_words_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr, topk_weights_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr,
    hidden, inter, stride_am, stride_we, stride_se, stride_sn, stride_om,
    WEIGHT_ON_INPUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    N_SPLIT: gl.constexpr, STAGES: gl.constexpr, W_LAYOUT: gl.constexpr, S_LAYOUT: gl.constexpr,
    W_BLK: gl.constexpr, MMA: gl.constexpr, num_warps: gl.constexpr,
):
    """kernels.down_kernel streamed, for mx_words with 16-bit activations: a program per block
    and N_SPLIT-th of the N tiles, walking (N tile, K step) in one ring, so that the next
    tile's copies are in flight while a tile is stored. Each N tile of BLOCK_N rows of H is
    two halves of BLOCK_N / 2 rows, decoded and multiplied as gate_up_mx_words_kernel does its
    gate and up tiles (the second half decoded while the first's wgmma runs); out[route, n] =
    w_route * (a[row] @ w2[e]^T), or without the router weight where it went on the input."""
    C: gl.constexpr = BLOCK_K // MX_GROUP
    HALF: gl.constexpr = BLOCK_N // 2
    STEP_WORDS: gl.constexpr = BLOCK_K // (CHUNK_GROUPS * MX_GROUP) * WORDS_PER_CHUNK
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    pid_m = gl.program_id(0) // N_SPLIT
    # the block's routes (top_k 1: _block_rows' tokens are then the route ids)
    count, expert, rows, _ = _block_rows(pid_m, sorted_ptr, block_expert_ptr, block_rows_ptr, num_padded_ptr, 1,
                                         BLOCK_M, gl.SliceLayout(1, A_BLK))
    tiles = hidden // BLOCK_N
    per_program = gl.cdiv(tiles, N_SPLIT)
    first = gl.program_id(0) % N_SPLIT * per_program
    k_steps = inter // BLOCK_K
    steps = gl.minimum(per_program, tiles - first) * k_steps
    if gl.minimum(count, steps) <= 0:  # no routes, or no N tile left for this program
        return
    words_per_row = inter // 8
    w_words, s_ptrs = _mx_tile_ptrs(w_ptr, ws_ptr, expert, first * BLOCK_N, words_per_row, stride_we, stride_se,
                                    stride_sn, HALF, C, W_BLK, S_LAYOUT)
    half_offs = HALF * words_per_row
    tile_words = BLOCK_N * words_per_row
    s_half = HALF * stride_sn
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, A_BLK))
    buffer_rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, A_BLK))
    a_rows = a_ptr + buffer_rows.to(gl.int64)[:, None] * stride_am + offs_k[None, :]
    r_out = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OUT_LAYOUT))
    routes = gl.load(sorted_ptr + pid_m * BLOCK_M + r_out, mask=r_out < count, other=0)
    out_rows = out_ptr + routes.to(gl.int64)[:, None] * stride_om
    if not WEIGHT_ON_INPUT:
        route_weight = gl.load(topk_weights_ptr + routes, mask=r_out < count, other=0.0)[:, None]

    a_smem, lo_smem, hi_smem = _mx_ring(STAGES, BLOCK_M, HALF, BLOCK_K)
    for s in gl.static_range(STAGES - 1):
        _mx_copy_step(a_rows + s % k_steps * BLOCK_K, w_words + s // k_steps * tile_words + s % k_steps * STEP_WORDS,
                      half_offs, a_smem, lo_smem, hi_smem, s, rows, s < steps)
    lo_scales = _mx_scales(s_ptrs, W_LAYOUT)
    hi_scales = _mx_scales(s_ptrs + s_half, W_LAYOUT)
    acc_lo = gl.zeros([HALF, BLOCK_M], gl.float32, layout=MMA)
    acc_hi = gl.zeros([HALF, BLOCK_M], gl.float32, layout=MMA)
    for step in range(steps):
        ahead = gl.minimum(step + 1, steps - 1)
        s_ahead = ahead // k_steps * BLOCK_N * stride_sn + ahead % k_steps * C * SCALE_K_BYTES
        lo_next = _mx_scales(s_ptrs + s_ahead, W_LAYOUT)
        hi_next = _mx_scales(s_ptrs + s_half + s_ahead, W_LAYOUT)
        _landed(STAGES)
        # the slot step - 1 used: every warp is past it (the barrier) and its wgmmas are done
        load = step + STAGES - 1
        _mx_copy_step(a_rows + load % k_steps * BLOCK_K, w_words + load // k_steps * tile_words
                      + load % k_steps * STEP_WORDS, half_offs, a_smem, lo_smem, hi_smem, load % STAGES, rows,
                      load < steps)
        acc_lo, acc_hi = _mx_two_dots(a_smem.index(step % STAGES).permute((1, 0)), lo_smem, hi_smem, step % STAGES,
                                      lo_scales, hi_scales, acc_lo, acc_hi, W_LAYOUT, a_op)
        lo_scales = lo_next
        hi_scales = hi_next
        if step % k_steps == k_steps - 1:
            n = (first + step // k_steps) * BLOCK_N + gl.arange(0, HALF, layout=gl.SliceLayout(0, OUT_LAYOUT))
            lo = gl.convert_layout(gl.permute(acc_lo, (1, 0)), OUT_LAYOUT)
            hi = gl.convert_layout(gl.permute(acc_hi, (1, 0)), OUT_LAYOUT)
            if not WEIGHT_ON_INPUT:
                lo *= route_weight
                hi *= route_weight
            gl.store(out_rows + n[None, :], lo.to(out_ptr.dtype.element_ty), mask=(r_out < count)[:, None])
            gl.store(out_rows + HALF + n[None, :], hi.to(out_ptr.dtype.element_ty), mask=(r_out < count)[:, None])
            acc_lo = gl.zeros([HALF, BLOCK_M], gl.float32, layout=MMA)
            acc_hi = gl.zeros([HALF, BLOCK_M], gl.float32, layout=MMA)


@gluon.jit
def _route_expert(ids_ptr, map_ptr, route, valid, HAS_MAP: gl.constexpr):
    """A route's local expert, 0 where it has none here (or is past the token's routes): the
    kernel loads no activation for it then and gives it no router weight."""
    return gl.maximum(_local_expert(ids_ptr, map_ptr, route, valid, HAS_MAP), 0).to(gl.int64)


@gluon.jit
def _tiny_step_words(w_words, s_ptrs, ids_ptr, map_ptr, first_route, routes_left, step, stride_we, stride_se,
                     HAS_MAP: gl.constexpr, K_STEPS: gl.constexpr, STEP_WORDS: gl.constexpr, C: gl.constexpr):
    """down_mx_words_tiny_kernel's step `step` (route step // K_STEPS of the program's, K step
    step % K_STEPS): its words' and scales' pointers."""
    expert = _route_expert(ids_ptr, map_ptr, first_route + step // K_STEPS, step // K_STEPS < routes_left, HAS_MAP)
    k = step % K_STEPS
    return w_words + expert * stride_we + k * STEP_WORDS, s_ptrs + expert * stride_se + k * C * SCALE_K_BYTES


@gluon.jit
def down_mx_words_tiny_kernel(
    act_ptr, w_ptr, ws_ptr, out_ptr, partial_ptr, counts_ptr, topk_weights_ptr, ids_ptr, map_ptr,
    hidden, inter, top_k, stride_we, stride_se, stride_sn, stride_om, stride_ps,
    HAS_MAP: gl.constexpr, WEIGHT_ON_INPUT: gl.constexpr, PDL: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, ROUTES: gl.constexpr, ROUTE_SPLIT: gl.constexpr, K_STEPS: gl.constexpr,
    STAGES: gl.constexpr, COLS: gl.constexpr, W_LAYOUT: gl.constexpr, S_LAYOUT: gl.constexpr, W_BLK: gl.constexpr,
    MMA: gl.constexpr, num_warps: gl.constexpr,
):
    """kernels.down_tiny_kernel for mx_words: out[t, n] = sum_j w_tj * (act(route t*k+j) @ w2[e_tj]^T)
    for BLOCK_N rows of H (two halves, as down_mx_words_kernel's) and the program_id(2)-th share
    of token t's routes, ROUTES of them. The program walks (route, K step) in one ring of word
    copies, the first STAGES - 1 issued before the PDL wait (the gate/up still running); then
    each route's fp32 activation goes to shared memory as bf16 tiles, one a K step, with the
    route's row filled and the other rows zero, so that one accumulator of COLS columns (MMA's
    N) gathers each route's sums in its own column (a zero one for a route not here). Router
    weights and the sum over the routes after the loop; shares of a token's routes add up as
    down_tiny_kernel's do (kernels._last_to_arrive, in share order)."""
    C: gl.constexpr = BLOCK_K // MX_GROUP
    HALF: gl.constexpr = BLOCK_N // 2
    STEPS: gl.constexpr = ROUTES * K_STEPS
    STEP_WORDS: gl.constexpr = BLOCK_K // (CHUNK_GROUPS * MX_GROUP) * WORDS_PER_CHUNK
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    act_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 4], [1, 0])  # [COLS, BLOCK_K] tiles
    sum_layout: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, 4], [1, 0])  # [COLS, HALF] sums
    token = gl.program_id(0)
    pid_n = gl.program_id(1)
    first_route = token * top_k + gl.program_id(2) * ROUTES
    routes_left = top_k - gl.program_id(2) * ROUTES
    w_words, s_ptrs = _mx_tile_ptrs(w_ptr, ws_ptr, 0, pid_n * BLOCK_N, inter // 8, stride_we, stride_se, stride_sn,
                                    HALF, C, W_BLK, S_LAYOUT)
    half_offs = HALF * (inter // 8)
    s_half = HALF * stride_sn
    lo_smem, hi_smem = _mx_word_ring(STAGES, HALF, BLOCK_K)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STEPS, COLS, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([COLS, BLOCK_K], gl.bfloat16))
    for s in gl.static_range(STAGES - 1):
        src, _unused = _tiny_step_words(w_words, s_ptrs, ids_ptr, map_ptr, first_route, routes_left, s, stride_we,
                                        stride_se, HAS_MAP, K_STEPS, STEP_WORDS, C)
        _mx_copy_words(src, half_offs, lo_smem, hi_smem, s, s < STEPS)
    await_previous(PDL)
    rows = gl.arange(0, COLS, layout=gl.SliceLayout(1, act_layout))
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, act_layout))
    live = (rows < ROUTES) & (rows < routes_left)
    live &= _local_expert(ids_ptr, map_ptr, first_route + rows, live, HAS_MAP) >= 0  # not here: a zero row
    for r in gl.static_range(ROUTES):
        for k in gl.static_range(K_STEPS):
            here = ((rows == r) & live)[:, None]
            a = gl.load(act_ptr + (first_route + rows)[:, None] * inter + (k * BLOCK_K + cols)[None, :], mask=here,
                        other=0.0)
            a_smem.index(r * K_STEPS + k).store(a.to(gl.bfloat16))
    fence_async_shared()
    _barrier()
    _words, scales = _tiny_step_words(w_words, s_ptrs, ids_ptr, map_ptr, first_route, routes_left, 0, stride_we,
                                      stride_se, HAS_MAP, K_STEPS, STEP_WORDS, C)
    lo_scales = _mx_scales(scales, W_LAYOUT)
    hi_scales = _mx_scales(scales + s_half, W_LAYOUT)
    acc_lo = gl.zeros([HALF, COLS], gl.float32, layout=MMA)
    acc_hi = gl.zeros([HALF, COLS], gl.float32, layout=MMA)
    for step in range(STEPS):
        _words, scales = _tiny_step_words(w_words, s_ptrs, ids_ptr, map_ptr, first_route, routes_left,
                                          gl.minimum(step + 1, STEPS - 1), stride_we, stride_se, HAS_MAP, K_STEPS,
                                          STEP_WORDS, C)
        lo_next = _mx_scales(scales, W_LAYOUT)
        hi_next = _mx_scales(scales + s_half, W_LAYOUT)
        _landed(STAGES)
        load = step + STAGES - 1
        src, _scales = _tiny_step_words(w_words, s_ptrs, ids_ptr, map_ptr, first_route, routes_left, load, stride_we,
                                        stride_se, HAS_MAP, K_STEPS, STEP_WORDS, C)
        _mx_copy_words(src, half_offs, lo_smem, hi_smem, load % STAGES, load < STEPS)
        acc_lo, acc_hi = _mx_two_dots(a_smem.index(step).permute((1, 0)), lo_smem, hi_smem, step % STAGES, lo_scales,
                                      hi_scales, acc_lo, acc_hi, W_LAYOUT, a_op)
        lo_scales = lo_next
        hi_scales = hi_next
    r_out = gl.arange(0, COLS, layout=gl.SliceLayout(1, sum_layout))
    here = (r_out < ROUTES) & (r_out < routes_left)  # a route not here: its column is zero
    weight = gl.where(here, 1.0, 0.0)
    if not WEIGHT_ON_INPUT:
        weight = gl.load(topk_weights_ptr + first_route + r_out, mask=here, other=0.0)
    lo = gl.sum(gl.convert_layout(gl.permute(acc_lo, (1, 0)), sum_layout) * weight[:, None], axis=0)
    hi = gl.sum(gl.convert_layout(gl.permute(acc_hi, (1, 0)), sum_layout) * weight[:, None], axis=0)
    n = pid_n * BLOCK_N + gl.arange(0, HALF, layout=gl.SliceLayout(0, sum_layout))
    if ROUTE_SPLIT > 1:
        part = partial_ptr + token * hidden + n
        gl.store(part + gl.program_id(2) * stride_ps, lo)
        gl.store(part + gl.program_id(2) * stride_ps + HALF, hi)
        if not _last_to_arrive(counts_ptr, token * gl.num_programs(1) + pid_n, ROUTE_SPLIT):
            return
        lo = _sum_splits(part, stride_ps, n < hidden, ROUTE_SPLIT)
        hi = _sum_splits(part + HALF, stride_ps, n < hidden, ROUTE_SPLIT)
    gl.store(out_ptr + token * stride_om + n, lo.to(out_ptr.dtype.element_ty))
    gl.store(out_ptr + token * stride_om + HALF + n, hi.to(out_ptr.dtype.element_ty))


settle_cache_keys(globals())
