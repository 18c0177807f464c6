"""Upstream's MoE quant methods -> the adapter's QuantSpec and canonical tensors: one table.

Each entry is keyed by the path of the upstream quant-method class that vLLM's
`resolve_quant_method` picks for a checkpoint format (exact class: a subclass is another
format until someone maps it). Its mapper says

- `spec(method)`: the adapter's `QuantSpec` for what upstream's kernel computes (weights and,
  for w8a8 kernels, how activations are quantised), read from the method's own attributes;
  it raises `NotMapped` (format and why) for anything the adapter does not model;
- `tensors(method, layer, spec)`: the layer's canonical tensors (`w13`, `w2`, their scales and
  biases, see `moe_overlay.checks.canonical_shapes`) as views of the parameters that upstream's
  `create_weights` made and its loader filled. Never a copy of the weights: only scale reshapes
  (`[E, N, 1] -> [E, N]`) and, for per-tensor fp8, a merge of the w1/w3 scales done in place
  (as upstream's own post-processing does; see `_merge_w13_tensor_scales`). Online quantisation
  (a bf16 checkpoint served as fp8) quantises the loaded parameters in place, as upstream would.

Every class path and parameter name below has a contract entry in `patches/ledger.py`
(`quant_method_expectations`), so an upstream rename refuses to start instead of falling
back silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import moe_overlay as mo
from moe_overlay.quant import fp8_max, quantize_fp8_tensor
from moe_overlay.spec import MXFP4_GROUP


class NotMapped(Exception):
    """The layer uses something the adapter does not model yet (format and reason in the message)."""


Tensors = dict[str, torch.Tensor]

UNQUANTIZED = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod"
FP8 = "vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod"
FP8_ONLINE = "vllm.model_executor.layers.quantization.online.fp8:Fp8PerTensorOnlineMoEMethod"
_CT_MOE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
CT_W8A8_FP8 = f"{_CT_MOE}.compressed_tensors_moe_w8a8_fp8:CompressedTensorsW8A8Fp8MoEMethod"
CT_W4A4_MXFP4 = f"{_CT_MOE}.compressed_tensors_moe_w4a4_mxfp4:CompressedTensorsW4A4Mxfp4MoEMethod"
MXFP4 = "vllm.model_executor.layers.quantization.mxfp4:Mxfp4MoEMethod"


@dataclass(frozen=True)
class QuantMapper:
    format: str  # the checkpoint format, as a person would name it
    spec: Callable[[Any], mo.QuantSpec]
    tensors: Callable[[Any, Any, mo.MoESpec], Tensors]
    # The layer's parameters the mapper reads (every one create_weights may register for the format).
    params: tuple[str, ...] = ()
    # The names the mapper relies on as they appear in the class's source (its instance attributes,
    # the parameter names it registers): patches/ledger.py refuses to start when one disappears.
    mentions: tuple[str, ...] = ()


def class_path(method: object) -> str:
    cls = type(method)
    return f"{cls.__module__}:{cls.__qualname__}"


def mapper_for(method: object) -> QuantMapper:
    mapper = QUANT_METHODS.get(class_path(method))
    if mapper is None:
        raise NotMapped(f"{type(method).__name__} checkpoints are not mapped to the adapter yet")
    return mapper


def quant_spec(method: object) -> mo.QuantSpec:
    return mapper_for(method).spec(method)


def canonical_tensors(method: object, layer: Any, spec: mo.MoESpec) -> Tensors:
    tensors = mapper_for(method).tensors(method, layer, spec)
    if spec.has_bias:
        tensors.update(w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
    return tensors


# -- unquantised -----------------------------------------------------------------------------


def _unquantized_tensors(method, layer, spec: mo.MoESpec) -> Tensors:
    return {"w13": layer.w13_weight, "w2": layer.w2_weight}


# -- fp8 -------------------------------------------------------------------------------------


def _block(shape) -> tuple[int, int]:
    return int(shape[0]), int(shape[1])


def _merge_w13_tensor_scales(w13: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per-tensor fp8: the checkpoint has one scale for w1 and one for w3 (`scales [E, 2]`);
    the adapter (like every per-tensor kernel) takes one per expert. Requantise each half to
    the larger scale in place, exactly what upstream's process_fp8_weight_tensor_strategy_moe
    does, and write that scale to both columns, so the parameters stay a consistent checkpoint
    (a later reload of one shard merges again). Returns the `[E]` view of the merged scale."""
    if scales.shape[1] == 1:
        return scales[:, 0]
    shard = w13.shape[1] // scales.shape[1]
    merged = scales.amax(dim=1)
    fmax = fp8_max(w13.dtype)
    for s in range(scales.shape[1]):
        redo = (scales[:, s] != merged).nonzero().flatten().tolist()
        for e in redo:
            rows = w13.data[e, s * shard:(s + 1) * shard]
            value = rows.float() * scales[e, s] / merged[e]
            rows.copy_(value.clamp(-fmax, fmax).to(w13.dtype))
    scales.data.copy_(merged.unsqueeze(1).expand_as(scales))
    return scales[:, 0]


def _dynamic_tensor_activations(method) -> str:
    """Dynamic per-tensor fp8 activations, or per token where upstream asks for batch invariance
    (vLLM 0.33's VLLM_BATCH_INVARIANT sets the method's per_act_token_quant)."""
    return "fp8_token" if getattr(method, "per_act_token_quant", False) else "fp8_tensor"


def _fp8_spec(method) -> mo.QuantSpec:
    if method.block_quant:
        # With a TP shard that is not a whole number of checkpoint blocks upstream refines the
        # scale grid (weight_scale_refine) and the loader upsamples the scales onto it.
        block = method.moe_block_shape if method.weight_scale_refine is not None else method.weight_block_size
        # Fp8Config refuses block weights with static activations: dynamic per token and block[1] columns.
        return mo.QuantSpec("fp8", "block", _block(block), "e4m3fn", "fp8_block")
    if method.quant_config.activation_scheme != "dynamic":
        raise NotMapped("fp8 per-tensor with static activation scales (activation_scheme 'static') "
                        "is not modelled by the adapter (it quantises activations dynamically)")
    return mo.QuantSpec("fp8", "tensor", activations=_dynamic_tensor_activations(method))


def _fp8_tensors(method, layer, spec: mo.MoESpec) -> Tensors:
    w13, w2 = layer.w13_weight, layer.w2_weight
    if method.block_quant:
        return {"w13": w13, "w2": w2, "w13_scale": layer.w13_weight_scale_inv,
                "w2_scale": layer.w2_weight_scale_inv}
    return {"w13": w13, "w2": w2, "w13_scale": _merge_w13_tensor_scales(w13, layer.w13_weight_scale),
            "w2_scale": layer.w2_weight_scale}


# -- online fp8: a bf16 checkpoint quantised once loaded (`--quantization fp8` / `fp8_per_tensor`) --------


def _fp8_online_spec(method) -> mo.QuantSpec:
    return mo.QuantSpec("fp8", "tensor", activations=_dynamic_tensor_activations(method))


def _fp8_online_tensors(method, layer, spec: mo.MoESpec) -> Tensors:
    """Upstream loads the bf16 weights, then quantises each expert's w13 (w1 and w3 together) and
    w2 to fp8 with one scale each, amax / fp8 max, the amax taken over the ranks that shard the
    expert (`amax_for_moe_weight_quant`). The adapter does the same once the layer is loaded: the
    parameters then hold fp8 and the scales sit beside them under upstream's names, and a reload
    (bf16 again) is quantised the same way."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import amax_for_moe_weight_quant, weight_amax

    dtype = spec.quant.fp8_dtype
    for name in ("w13", "w2"):
        weight = getattr(layer, f"{name}_weight")
        if weight.dtype == dtype:
            continue  # already quantised (upstream's flag keeps a second pass away; see OverlayMoEMethod)
        amax = amax_for_moe_weight_quant(weight_amax(weight.flatten(1), dim=-1), method.moe.tp_size)
        quantised = torch.empty_like(weight, dtype=dtype)
        scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
        for e in range(weight.shape[0]):  # one expert at a time: its fp32 copy only
            quantised[e : e + 1], scale[e : e + 1] = quantize_fp8_tensor(weight[e : e + 1], amax[e : e + 1], dtype)
        weight.data = quantised
        layer.register_parameter(f"{name}_weight_scale", torch.nn.Parameter(scale, requires_grad=False))
    return {"w13": layer.w13_weight, "w2": layer.w2_weight, "w13_scale": layer.w13_weight_scale,
            "w2_scale": layer.w2_weight_scale}


# -- compressed-tensors w8a8 fp8 ---------------------------------------------------------------


def _ct_fp8_spec(method) -> mo.QuantSpec:
    from compressed_tensors.quantization import QuantizationStrategy as S

    w, a = method.weight_quant, method.input_quant
    if not a.dynamic:
        raise NotMapped(f"compressed-tensors fp8 with static {a.strategy} activation scales is not "
                        "modelled by the adapter (it quantises activations dynamically)")
    if w.strategy == S.CHANNEL:  # upstream allows only dynamic per-token activations with these
        return mo.QuantSpec("fp8", "channel", activations="fp8_token")
    if w.strategy == S.TENSOR:
        # upstream quantises dynamic tensor-strategy activations in 1x128 groups (kFp8Dynamic128Sym)
        return mo.QuantSpec("fp8", "tensor", activations="fp8_block")
    block = _block(method.weight_block_size)
    if a.strategy != S.GROUP or a.group_size != block[1]:
        raise NotMapped(f"compressed-tensors fp8 block {list(block)} weights with {a.strategy} activations "
                        f"(group {a.group_size}) are not modelled; the adapter groups activations by block[1]")
    return mo.QuantSpec("fp8", "block", block, "e4m3fn", "fp8_block")


def _ct_fp8_tensors(method, layer, spec: mo.MoESpec) -> Tensors:
    w13, w2 = layer.w13_weight, layer.w2_weight
    s13, s2 = layer.w13_weight_scale, layer.w2_weight_scale
    gran = spec.quant.granularity
    if gran == "channel":  # upstream keeps a trailing 1: [E, N, 1]
        return {"w13": w13, "w2": w2, "w13_scale": s13.squeeze(-1), "w2_scale": s2.squeeze(-1)}
    if gran == "tensor":
        s13 = _merge_w13_tensor_scales(w13, s13)
    return {"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2}


# -- compressed-tensors mxfp4 (mxfp4-pack-quantized) ------------------------------------------


def _ct_mxfp4_spec(method) -> mo.QuantSpec:
    if method.group_size != MXFP4_GROUP:
        raise NotMapped(f"mxfp4 with group size {method.group_size} is not modelled (the adapter's is 32)")
    if method.use_cutlass_mxfp4:
        # On a GPU with native fp4 upstream runs CUTLASS w4a4 (activations quantised to mxfp4 too);
        # the adapter computes w4a16 (what upstream's Marlin and XPU paths compute), so it would not
        # be what stock computes there.
        raise NotMapped("mxfp4 with mxfp4 activations (upstream's CUTLASS w4a4 on this GPU) is not "
                        "modelled by the adapter (weight-only mxfp4)")
    return mo.QuantSpec("mxfp4")


def _ct_mxfp4_tensors(method, layer, spec: mo.MoESpec) -> Tensors:
    # compressed-tensors packs two e2m1 codes per byte, element 2j in the low nibble
    # (compressors/nvfp4/helpers.py pack_fp4_to_uint8: `idx[:, 0] | idx[:, 1] << 4`), along K,
    # and stores e8m0 exponents (bias 127) as uint8 (mx_utils.compress_mx_scale): the adapter's
    # canonical mxfp4 exactly. Upstream's own post-processing renames *_weight_packed to
    # *_weight; it never runs on a layer the adapter owns, so the names stay the checkpoint's.
    return {"w13": layer.w13_weight_packed, "w2": layer.w2_weight_packed,
            "w13_scale": layer.w13_weight_scale, "w2_scale": layer.w2_weight_scale}


# -- mxfp4 (quant_method 'mxfp4'; Kimi-K3's compressed-tensors experts, which vLLM rewrites to it) ----


def _mxfp4_spec(method) -> mo.QuantSpec:
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import _backend_activation_key

    if getattr(method, "is_k3_situ_int4_gfx942", False):  # vLLM 0.32's opt-in; 0.31 has none
        raise NotMapped("mxfp4 requantised to int4 while loading (--quantization-config.moe.weight "
                        "int4_per_group_32) is not modelled by the adapter (it runs the checkpoint's mxfp4)")
    activations = _backend_activation_key(method.mxfp4_backend)
    if activations is not None:
        raise NotMapped(f"mxfp4 with {activations} activations (upstream's {method.mxfp4_backend.value} kernel on "
                        "this GPU) is not modelled by the adapter (weight-only mxfp4)")
    return mo.QuantSpec("mxfp4")


def _mxfp4_tensors(method, layer, spec: mo.MoESpec) -> Tensors:
    # The checkpoint's bytes as they are (upstream's Kimi-K3 loader puts compressed-tensors'
    # weight_packed into w13_weight/w2_weight): the adapter's canonical mxfp4, as for the table's
    # compressed-tensors entry.
    return {"w13": layer.w13_weight, "w2": layer.w2_weight,
            "w13_scale": layer.w13_weight_scale, "w2_scale": layer.w2_weight_scale}


QUANT_METHODS: dict[str, QuantMapper] = {
    UNQUANTIZED: QuantMapper(
        "unquantised", lambda method: mo.QuantSpec(), _unquantized_tensors,
        params=("w13_weight", "w2_weight"), mentions=('"w13_weight"', '"w2_weight"'),
    ),
    FP8: QuantMapper(
        "fp8 (quant_method 'fp8': 128x128 block weight_scale_inv, or per-tensor)", _fp8_spec, _fp8_tensors,
        params=("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv",
                "w13_weight_scale", "w2_weight_scale"),
        mentions=("self.block_quant", "self.weight_block_size", "self.moe_block_shape", "self.weight_scale_refine",
                  "self.quant_config", '"weight_scale_inv"', '"weight_scale"', 'f"w13_{self.weight_scale_name}"',
                  'f"w2_{self.weight_scale_name}"', '"w13_weight"', '"w2_weight"'),
    ),
    FP8_ONLINE: QuantMapper(
        "bf16 quantised to fp8 per tensor while loading (--quantization fp8 / fp8_per_tensor)",
        _fp8_online_spec, _fp8_online_tensors,
        params=("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"),
        mentions=("weight_amax(", ".flatten(1)", "amax_for_moe_weight_quant(", "self.moe.tp_size",
                  "_already_called_process_weights_after_loading"),
    ),
    CT_W8A8_FP8: QuantMapper(
        "compressed-tensors fp8 w8a8 (per-channel, per-tensor or block weights)", _ct_fp8_spec, _ct_fp8_tensors,
        params=("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"),
        mentions=("self.weight_quant", "self.input_quant", "self.weight_block_size", '"w13_weight"', '"w2_weight"',
                  '"w13_weight_scale"', '"w2_weight_scale"', "kFp8Dynamic128Sym"),
    ),
    CT_W4A4_MXFP4: QuantMapper(
        "compressed-tensors mxfp4-pack-quantized (e2m1, e8m0 scale per 32)", _ct_mxfp4_spec, _ct_mxfp4_tensors,
        params=("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale"),
        mentions=("self.group_size", "self.use_cutlass_mxfp4", '"w13_weight_packed"', '"w2_weight_packed"',
                  '"w13_weight_scale"', '"w2_weight_scale"'),
    ),
    MXFP4: QuantMapper(
        "mxfp4 (quant_method 'mxfp4', e2m1 with an e8m0 scale per 32; Kimi-K3's compressed-tensors experts)",
        _mxfp4_spec, _mxfp4_tensors,
        params=("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"),
        mentions=("self.mxfp4_backend", '"w13_weight"', '"w2_weight"',
                  '"w13_weight_scale"', '"w2_weight_scale"', "mxfp4_block = 32"),
    ),
}
