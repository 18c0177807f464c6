"""The NVIDIA-only features of the portable `tl` kernels (kernels.py), each behind a constexpr
that only the plan (plan.py) sets, and only where the target is Hopper (target.py): dots with
the fp8 weight tile as wgmma's left operand, weight tiles through tensor descriptors (TMA), and
programmatic dependent launch. Every other target compiles none of their NVIDIA branches. The
Gluon kernels (gluon_kernels.py) are the other NVIDIA-only module."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def fp8_dot(a, b, W_LEFT: tl.constexpr):
    """a @ b of fp8 tiles, or (W_LEFT) computed as (b^T @ a^T)^T: the weight tile then is the
    dot's left operand, its BLOCK_N rows wgmma's M, where `a` has fewer than the 64 rows a
    warpgroup's wgmma takes (otherwise Triton makes fp8 dots of 16 or 32 rows mma.sync
    dots of fp16, converting both tiles in registers every K step)."""
    if W_LEFT:
        prod = tl.trans(tl.dot(tl.trans(b), tl.trans(a)))
    else:
        prod = tl.dot(a, b)
    return prod


@triton.jit
def weight_desc(w_ptr, rows, cols, stride_wn, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A 2-D tensor descriptor over all experts' `rows` (E times an expert's) of a contiguous
    `[E, N, K]` weight: tiles by bulk copy where the GPU has one (Hopper's TMA), plain loads
    where Triton lowers it so; rows and columns out of range read as zeros."""
    return tl.make_tensor_descriptor(w_ptr, shape=[rows, cols], strides=[stride_wn, 1], block_shape=[BLOCK_R, BLOCK_C])


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """PDL: the launch after this one (made with launch_pdl) may start its programs once every
    program of this one has passed here; they read nothing of this launch before await_previous."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def await_previous(PDL: tl.constexpr):
    """PDL: wait until the launch before this one has finished and its writes are visible (at
    once after the first time). Reads of what it wrote come after this; loads of weights issued
    before it overlap the previous launch's last programs."""
    if PDL:
        gdc_wait()
