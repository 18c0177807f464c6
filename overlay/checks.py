"""Input checks that turn a mistake into one clear message before any kernel runs."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .errors import MoEInputError
from .spec import MXFP4_GROUP, MoESpec


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def canonical_shapes(spec: MoESpec) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
    """Name -> (shape, allowed dtypes) of every tensor of the layer in canonical layout."""
    e, h, i = spec.num_local_experts, spec.hidden_size, spec.intermediate_size
    q = spec.quant
    floats = (torch.float32, torch.bfloat16, torch.float16)
    rows = {"w13": (2 * i, h), "w2": (h, i)}
    shapes: dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]] = {}
    for name, (n, k) in rows.items():
        if q.weights == "none":
            shapes[name] = ((e, n, k), floats)
        elif q.weights == "fp8":
            shapes[name] = ((e, n, k), (q.fp8_dtype,))
            scale = {"tensor": (e,), "channel": (e, n), "block": (e, _ceil(n, q.block[0]), _ceil(k, q.block[1]))}
            shapes[f"{name}_scale"] = (scale[q.granularity or "tensor"], (torch.float32,))
        else:
            shapes[name] = ((e, n, k // 2), (torch.uint8,))
            shapes[f"{name}_scale"] = ((e, n, k // MXFP4_GROUP), (torch.uint8,))
        if spec.has_bias:
            shapes[f"{name}_bias"] = ((e, n), floats)
    return shapes


def check_canonical_weights(spec: MoESpec, tensors: Mapping[str, torch.Tensor]) -> None:
    expected = canonical_shapes(spec)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise MoEInputError(f"expert tensors: missing {missing}, unexpected {extra} for {spec.quant}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise MoEInputError(f"expert tensors are on several devices: {sorted(map(str, devices))}")
    for name, (shape, dtypes) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise MoEInputError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype not in dtypes:
            raise MoEInputError(f"{name} has dtype {t.dtype}, expected one of {dtypes}")


def check_inputs(
    spec: MoESpec,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights_device: torch.device,
) -> None:
    """Shapes, dtypes and devices of one call (data-dependent checks live in the kernels)."""
    if x.dim() != 2 or x.shape[1] != spec.hidden_size:
        raise MoEInputError(f"hidden states must be [tokens, {spec.hidden_size}], got {tuple(x.shape)}")
    if x.dtype != spec.dtype:
        raise MoEInputError(f"hidden states are {x.dtype} but the layer was described as {spec.dtype}")
    expected = (x.shape[0], spec.top_k)
    for name, t, dtype in (("topk_ids", topk_ids, torch.int32), ("topk_weights", topk_weights, torch.float32)):
        if tuple(t.shape) != expected:
            raise MoEInputError(f"{name} must have shape {expected} (tokens, top_k), got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise MoEInputError(f"{name} must be {dtype}, got {t.dtype}")
    for name, t in (("hidden states", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != weights_device:
            raise MoEInputError(f"{name} are on {t.device} but the expert weights are on {weights_device}")


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Ids outside [0, num_experts) would index garbage: refuse them (synchronises the device)."""
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise MoEInputError(
            f"topk_ids hold values in [{int(topk_ids.min())}, {int(topk_ids.max())}], "
            f"outside [0, {num_experts}) experts"
        )
