"""An emulator of AITER's fused-MoE entry points, for tests on machines without an AMD GPU.

Test support only: it is an `AiterOps` handed to an `AiterBackend` in tests, never a backend
users can select. It takes exactly what AITER's `fused_moe`, `topk_softmax` and
`biased_grouped_topk` take (keywords checked against the parsed signatures of the AITER
version it stands for) and consumes it as AITER does:

- weights are read through the inverse of AITER's own shuffle, and only when the tensor
  handed over carries `is_shuffled` (without it AITER runs its plain-layout kernel on the
  shuffled bytes: so does the emulator, giving the same garbage);
- fp8 weights must be the GPU's fp8 (AITER's `dtypes.fp8`: e4m3fnuz on gfx942), mxfp4
  weights and scales AITER's fp4x2 and e8m0 dtypes; mxfp4 scales are read through the
  inverse of AITER's scale shuffle and their padding dropped;
- activations are quantised dynamically with AITER's torch quantisers, then the two
  stages are AITER's own torch reference (`torch_moe_stage1`, `torch_moe_stage2`).

SiTU (`ActivationType.Situv2`, AITER main) is newer than the installed reference: its
stage-1 GEMM is still AITER's reference, the SiTU formula is main's `situv2`.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .reference import aiter_reference
from .sources import AiterContract

SCALE_TILE_GROUPS = 8  # AITER main pads e8m0 scale groups to a multiple of 8 (with 2^0)


INTEGERS = {1: (torch.uint8, 1 << 8), 2: (torch.int16, 1 << 15)}  # element size -> (dtype, digit base)
Shuffle = Callable[[torch.Tensor], torch.Tensor]


@functools.cache
def _inverse_permutation(shuffle: Shuffle, shape: tuple[int, ...], element_size: int) -> torch.Tensor:
    """q such that shuffle(x).flatten() == x.flatten()[q], learned by running `shuffle` on the
    digits of every position (in an integer dtype of the same element size)."""
    dtype, base = INTEGERS[element_size]
    n = math.prod(shape)
    rest, place, q = torch.arange(n), 1, torch.zeros(n, dtype=torch.int64)
    while place < n:
        q += shuffle((rest % base).to(dtype).view(shape)).flatten().long() * place
        rest, place = rest // base, place * base
    return q


def _read_through(shuffle: Shuffle, y: torch.Tensor, unit: tuple[int, ...]) -> torch.Tensor:
    """Undo `shuffle` (which permutes each block of shape `unit` alike) on `y`."""
    q = _inverse_permutation(shuffle, unit, y.element_size())
    flat = y.view(INTEGERS[y.element_size()][0]).reshape(-1, q.numel())
    out = torch.empty_like(flat)
    out[:, q] = flat
    return out.view(y.shape).view(y.dtype)


def situv2(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """AITER main's SiTUv2 (aiter/fused_moe.py::situv2)."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * linear_beta * torch.tanh(up / linear_beta)


@functools.cache
def _shuffles(arch: str) -> tuple[Shuffle, Shuffle, Shuffle]:
    """AITER's shuffles as the emulator reads through them, made once per arch: the learned
    inverses are cached per function object."""
    shuffle = aiter_reference(arch).shuffle
    return (functools.partial(shuffle.shuffle_weight, layout=(16, 16)),
            functools.partial(shuffle.shuffle_weight_a16w4, NLane=16, gate_up=False),
            functools.partial(shuffle.shuffle_scale_a16w4, experts_cnt=1, gate_up=False))


class AiterEmulator:
    """AITER `contract` (a version's signatures and enums) on GPU `arch`, emulated on CPU, in
    environment `env` (AITER reads switches from the process environment at each call)."""

    def __init__(self, arch: str, contract: AiterContract, env: Mapping[str, str] | None = None) -> None:
        self.arch = arch
        self.env = {} if env is None else env
        self.contract = contract
        self.key = f"aiter-emulator:{contract.version}:{arch}"
        self.features = contract.features()
        self.ref = aiter_reference(arch)
        self._enums = {name: enum.IntEnum(name, members) for name, members in contract.enums.items()}
        self._plain, self._a16w4, self._a16w4_scales = _shuffles(arch)
        self.calls: list[tuple[str, dict[str, Any]]] = []  # every call, as made

    # -- the AiterOps interface ---------------------------------------------------------------

    def call(self, function: str, **kwargs: Any) -> Any:
        unknown, missing = self.contract.keyword_problems(function, kwargs)
        if unknown or missing:
            raise TypeError(
                f"AITER {self.contract.version} {function}(): unknown keywords {unknown}, missing {missing}")
        self.calls.append((function, dict(kwargs)))
        return getattr(self, f"_{function}")(**kwargs)

    def enum(self, enum: str, member: str) -> Any:
        return getattr(self._enums[enum], member)  # AttributeError where this version lacks it

    def dtype(self, name: str) -> torch.dtype:
        return getattr(self.ref.dtypes, name)

    # -- fused_moe -------------------------------------------------------------------------------

    def _fused_moe(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weight: torch.Tensor,
                   topk_ids: torch.Tensor, expert_mask: torch.Tensor | None = None, activation: Any = None,
                   quant_type: Any = None, doweight_stage1: bool = False, w1_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None, a1_scale: torch.Tensor | None = None,
                   a2_scale: torch.Tensor | None = None, beta: float | None = None,
                   linear_beta: float | None = None) -> torch.Tensor:
        ref, dtypes = self.ref, self.ref.dtypes
        act = activation.name if activation is not None else "Silu"
        qt = quant_type.name if quant_type is not None else "No"
        dtype = hidden_states.dtype
        if dtype not in (dtypes.bf16, dtypes.fp16):
            raise AssertionError(f"Fused_moe unsupported out dtype: {dtype}")
        if topk_weight.dtype != torch.float32 or topk_ids.dtype != torch.int32:
            raise RuntimeError(
                f"moe_sorting takes fp32 weights and int32 ids, got {topk_weight.dtype}, {topk_ids.dtype}")
        if a1_scale is not None or a2_scale is not None:
            raise NotImplementedError("the emulator models dynamic activation scales only")
        _, model_dim, inter_dim = ref.stages.get_inter_dim(tuple(w1.shape), tuple(w2.shape))
        if w1.shape[1] != 2 * inter_dim:
            raise AssertionError(f"Invalid MoE weight: {w1.shape=} {w2.shape=}")
        shuffled = getattr(w1, "is_shuffled", False) or getattr(w2, "is_shuffled", False)
        if qt == "per_1x32":
            w1, w2, w1_scale, w2_scale = self._mxfp4_a16w4(w1, w2, w1_scale, w2_scale, act, shuffled,
                                                            expert_mask, doweight_stage1, model_dim, inter_dim)
        else:
            if qt != "No" and {w1.dtype, w2.dtype} != {dtypes.fp8}:
                raise RuntimeError(f"AITER on {self.arch} computes fp8 in {dtypes.fp8}; got {w1.dtype}, {w2.dtype}")
            if shuffled:
                w1 = _read_through(self._plain, w1, tuple(w1.shape[1:]))
                w2 = _read_through(self._plain, w2, tuple(w2.shape[1:]))
        ids = topk_ids if expert_mask is None else self._local_ids(topk_ids, expert_mask)
        a1, a1_scale = self._quantise(hidden_states, qt)
        stage_qt = ref.QuantType[qt]
        if act == "Situv2":
            # `gemm_only` stands in for w2's shape: with 2I intermediate columns stage 1 sees no
            # gate/up pair and, with activation No, returns its bare GEMM
            gemm_only = torch.empty(w2.shape[0], w2.shape[1], 2 * w2.shape[2], dtype=w2.dtype)
            gate_up = ref.stages.torch_moe_stage1(a1, w1, gemm_only, topk_weight, ids, dtype=torch.float32,
                                                  activation=ref.ActivationType.No, quant_type=stage_qt,
                                                  a1_scale=a1_scale, w1_scale=w1_scale, doweight=doweight_stage1)
            gate, up = gate_up.chunk(2, dim=-1)
            a2 = situv2(gate, up, 1.0 if beta is None else beta, 1.0 if linear_beta is None else linear_beta).to(dtype)
        else:
            a2 = ref.stages.torch_moe_stage1(a1, w1, w2, topk_weight, ids, dtype=dtype,
                                             activation=ref.ActivationType[act], quant_type=stage_qt,
                                             a1_scale=a1_scale, w1_scale=w1_scale, doweight=doweight_stage1)
        a2, a2_scale = self._quantise(a2, qt)
        return ref.stages.torch_moe_stage2(a2, w1, w2, topk_weight, ids, dtype=dtype, quant_type=stage_qt,
                                           w2_scale=w2_scale, a2_scale=a2_scale, doweight=not doweight_stage1)

    def _mxfp4_a16w4(self, w1, w2, s1, s2, act, shuffled, expert_mask, doweight_stage1, model_dim, inter_dim):
        """AITER main's a16w4 path (bf16 activations x mxfp4 weights), which it runs for SiTU only,
        on weights and scales in its a16w4 shuffles."""
        dtypes = self.ref.dtypes
        switched = [k for k in ("AITER_SITUV2_A8W4", "AITER_SITUV2_A4W4") if self.env.get(k) == "1"]
        if act != "Situv2" or switched:
            raise NotImplementedError(f"AITER quantises these {act} activations ({switched or 'a4w4'}); "
                                      "the emulator models a16w4")
        if not shuffled or expert_mask is not None or doweight_stage1:
            raise NotImplementedError("a16w4 SiTUv2 is not supported: non-preshuffled weights, expert-parallel "
                                      "masking or doweight_stage1=True")
        if {w1.dtype, w2.dtype} != {dtypes.fp4x2} or {s1.dtype, s2.dtype} != {dtypes.fp8_e8m0}:
            raise RuntimeError(f"mxfp4 takes {dtypes.fp4x2} weights and {dtypes.fp8_e8m0} scales; got "
                               f"{w1.dtype}, {w2.dtype}, {s1.dtype}, {s2.dtype}")
        w1 = _read_through(self._a16w4, w1, (1, *w1.shape[1:]))
        w2 = _read_through(self._a16w4, w2, (1, *w2.shape[1:]))
        return w1, w2, self._read_scales(s1, w1.shape[1], model_dim), self._read_scales(s2, w2.shape[1], inter_dim)

    def _read_scales(self, s: torch.Tensor, rows: int, k: int) -> torch.Tensor:
        groups = k // 32
        padded = -(-groups // SCALE_TILE_GROUPS) * SCALE_TILE_GROUPS
        if s.shape[-1] != padded or s.shape[0] % rows:
            raise RuntimeError(f"e8m0 scales must be [E*{rows}, {padded}] (groups padded to {SCALE_TILE_GROUPS}); "
                               f"got {tuple(s.shape)}")
        plain = _read_through(self._a16w4_scales, s.view(torch.uint8), (rows, padded))
        return plain[:, :groups].contiguous().view(s.dtype)

    @staticmethod
    def _local_ids(topk_ids: torch.Tensor, expert_mask: torch.Tensor) -> torch.Tensor:
        """AITER's expert_mask meaning (its torch_moe): local expert = rank among the masked-in
        global ids; the others become -1 and contribute nothing."""
        local = expert_mask.cumsum(0, dtype=torch.int32) - 1
        local[expert_mask == 0] = -1
        return local[topk_ids.long()]

    def _quantise(self, x: torch.Tensor, qt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fused_moe's dynamic activation quantisation, with AITER's torch quantisers."""
        if qt in ("No", "per_1x32"):  # per_1x32: a16w4, bf16 activations
            return x, None
        ref = self.ref
        quant = ref.quant.get_torch_quant(ref.stages.quant_remap.get(ref.QuantType[qt], ref.QuantType[qt]))
        y, scale = quant(x.reshape(-1, x.shape[-1]), quant_dtype=ref.dtypes.fp8)  # 1x128 groups need 2-D
        return y.view(x.shape), scale if scale.numel() == 1 else scale.view(*x.shape[:-1], -1)

    # -- routing -------------------------------------------------------------------------------

    def _topk_softmax(self, topk_weights: torch.Tensor, topk_indices: torch.Tensor, token_expert_indices: torch.Tensor,
                      gating_output: torch.Tensor, need_renorm: bool) -> None:
        weights, ids = torch.softmax(gating_output.float(), dim=-1).topk(topk_weights.shape[1], dim=-1)
        if need_renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        topk_weights.copy_(weights)
        topk_indices.copy_(ids)

    def _biased_grouped_topk(self, gating_output: torch.Tensor, correction_bias: torch.Tensor,
                             topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_expert_group: int,
                             topk_group: int, need_renorm: bool, routed_scaling_factor: float = 1.0) -> None:
        weights, ids = self.ref.topk.biased_grouped_topk_torch(
            gating_output, correction_bias, topk_ids.shape[1], need_renorm, num_expert_group, topk_group)
        topk_weights.copy_(weights * routed_scaling_factor)
        topk_ids.copy_(ids)
