"""The block-fp8 gate/up for NVIDIA Hopper (sm_90) in Gluon, Triton's lower-level dialect.

Block-fp8 weights (128x128 scale blocks, activations quantised per 1x128 group) need each K
step's product scaled on its own: acc += (a @ w) * a_scale * w_scale. Triton's `tl` loop
waits for each step's wgmma at once and then rescales, so the tensor cores idle during every
rescale (kernels._mma_step; docs/performance.md). Here each step's wgmma starts on fresh
registers and the previous step's product is rescaled while it runs (`warpgroup_mma_wait(1)`).
No product in flight crosses a loop back-edge: LLVM copies loop-carried values with moves, and
ptxas then serialises every wgmma (C7514). So the K loop walks PASS steps a pass, unrolled,
each pass waiting for its last dot. Same sums in the same order as the `tl` kernel: the
output is the same, bit for bit, on an H200.

Only this case: sorted mode (kernels.align_*), blocks of 64 rows, one warpgroup (4 warps),
gate and up rows interleaved by the pointers into one tile (column 2n gate row n, 2n+1 up
row n; the weights stay canonical). launch.uses_gluon decides; everything else, ROCm
included, runs kernels.gate_up_kernel. Triton 3.6 and 3.9 name two calls differently: both
are looked up once here.
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
from .kernels import SCALE_BLOCK, _activate, settle_cache_keys

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
BLOCK_M: gl.constexpr = gl.constexpr(GLUON_BLOCK_M)  # one warpgroup's wgmma rows
PASS: gl.constexpr = gl.constexpr(2)  # K steps a pass: hidden must be a multiple of PASS * BLOCK_K


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
    if pid_m * BLOCK_M >= gl.load(num_padded_ptr):
        return
    count = gl.load(block_rows_ptr + pid_m)
    if count <= 0:
        return
    expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
    # rows, as the copies (blk) and as the products (mma) lay them out
    r_blk = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    rows = r_blk < count
    tokens = (gl.load(sorted_ptr + pid_m * BLOCK_M + r_blk, mask=rows, other=0) // top_k).to(gl.int64)
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


settle_cache_keys(globals())
