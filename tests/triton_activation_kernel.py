"""A test kernel around the Triton backend's fused activation (a Triton kernel sees only its
module's globals, so it cannot be defined inside the test function)."""

import triton
import triton.language as tl

from moe_overlay.backends.triton_moe.kernels import _activate


@triton.jit
def activate_kernel(gate_ptr, up_ptr, out_ptr, n, beta, linear_beta, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.load(gate_ptr + offs, mask=ok)
    up = tl.load(up_ptr + offs, mask=ok)
    tl.store(out_ptr + offs, _activate(gate, up, beta, linear_beta, ACTIVATION), mask=ok)
