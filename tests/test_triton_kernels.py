"""The Triton kernels against the torch reference. On a GPU (`make test-gpu`); without one,
skipped, unless TRITON_INTERPRET=1 asks for Triton's CPU interpreter (small shapes only;
the interpreter's bf16 dot and fp8 rounding are wrong, so it runs fp16 and skips fp8; mxfp4
runs there with fp16 activations)."""

import functools
import json
import os
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

import moe_overlay as mo
from moe_overlay.backends.problems import (
    FP8_MODELS,
    MODELS,
    TOKEN_COUNTS,
    empty_weights,
    random_input,
    random_routing,
    random_weights,
    with_weights,
)
from moe_overlay.backends.reference import reference_moe
from moe_overlay.backends.triton_moe import plan
from moe_overlay.backends.triton_moe.bench import relative_error
from moe_overlay.backends.triton_moe.configs import (
    USER_FILES_ENV,
    LayerShape,
    current_table,
    default_config,
    is_tuned,
    table_devices,
)
from moe_overlay.backends.triton_moe.target import MX_LAYOUT_ENV
from moe_overlay.routing import grouped_topk

pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available()
INTERPRET = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16
needs_device = pytest.mark.skipif(not (CUDA or INTERPRET), reason="no GPU (TRITON_INTERPRET=1 runs these on CPU)")
needs_cuda = pytest.mark.skipif(not CUDA, reason="no GPU")
FP8_CAPABLE = CUDA and (torch.version.hip is not None or torch.cuda.get_device_capability() >= (8, 9))
fp8_ok = pytest.mark.skipif(not FP8_CAPABLE, reason="fp8 needs sm_89 or newer (the interpreter rounds it wrongly)")


@functools.cache
def _target():
    """The target the kernels compile for (make test-gpu TARGET=gfx942: the one this GPU stands in for)."""
    from moe_overlay.backends.triton_moe.target import current_target

    return current_target()


def _table_key() -> str:
    """The launch table's device key that this run's launches read first."""
    return table_devices(torch.device(DEVICE), _target())[0]


def _plan(spec, m):
    """The plan a call of `m` tokens of `spec` runs (the launch table's entry on this target)."""
    from moe_overlay.backends.triton_moe import launch

    prepared = mo.PreparedExperts(spec, empty_weights(spec, DEVICE), mo.get_backend("triton"))
    prepared.prepare()
    w13 = prepared.tensors["w13"]
    x = torch.empty(m, spec.hidden_size, dtype=spec.dtype, device=DEVICE)
    layer = launch.Layer.of(x, w13, prepared.tensors["w2"],
                            spec.top_k, spec.activation.kind, list(spec.activation.params),
                            spec.apply_router_weight_on_input, spec.quant.granularity,
                            spec.quant.activations == "fp8_token")
    return launch.call_plan(layer, torch.device(DEVICE), m)


def _check(spec, m, tol, seed=0, peak_at=None):
    """Triton through the adapter vs the reference, on fresh random data (peak_at: each row's
    largest value put in that column, twice the input's largest); every row written."""
    tensors = random_weights(spec, DEVICE, seed)
    w, ids = random_routing(m, spec, DEVICE, seed + 1)
    x = random_input(m, spec, DEVICE, seed + 2)
    if peak_at is not None:
        x[:, peak_at] = 2 * x.abs().amax()
    emap = spec.expert_map_tensor(DEVICE)
    ref = reference_moe(x, tensors["w13"], tensors["w2"], w, ids, spec.quant, spec.activation,
                        spec.apply_router_weight_on_input, (tensors.get("w13_scale"), tensors.get("w2_scale")),
                        expert_map=emap)
    prepared = mo.PreparedExperts(spec, tensors, mo.get_backend("triton"))
    prepared.prepare()
    out = prepared.apply(x, w, ids)
    assert out.shape == x.shape and out.dtype == x.dtype and torch.isfinite(out).all()
    err = relative_error(out, ref)
    assert err < tol, f"relative error {err:.2e} for {spec} at M={m}"
    return prepared, out, (x, w, ids)


SMALL = [
    mo.MoESpec(8, 256, 128, 2, dtype=DTYPE),
    mo.MoESpec(8, 200, 72, 2, dtype=DTYPE),  # sizes that no block divides
    mo.MoESpec(16, 256, 128, 4, mo.Activation.situ(), dtype=DTYPE),
    mo.MoESpec(8, 256, 128, 1, apply_router_weight_on_input=True, dtype=DTYPE),
    mo.MoESpec(8, 256, 128, 1, apply_router_weight_on_input=True, expert_map=(0, -1, 1, -1, 2, 3, -1, -1), dtype=DTYPE),
    mo.MoESpec(8, 256, 128, 3, expert_map=(-1, 0, 1, -1, 2, 3, -1, 4), dtype=DTYPE),
]


@needs_device
@pytest.mark.parametrize("spec", SMALL, ids=lambda s: f"E{s.num_experts}H{s.hidden_size}I{s.intermediate_size}"
                         f"k{s.top_k}{s.activation.kind}{'-oninput' if s.apply_router_weight_on_input else ''}"
                         f"{'-ep' if s.expert_map else ''}")
@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])  # tiny (<= 16 routes, no sort) and sorted paths
def test_small_layers_match_the_reference(spec, m):
    _check(spec, m, tol=1e-2)


@needs_cuda
def test_target_mode_holds_the_stand_ins_sm_to_a_compute_units_programs(monkeypatch):
    """`--unit-programs` on an NVIDIA GPU standing in for gfx942: the layer's output is as
    without, each loaded GEMM kernel is held to the programs gfx942's CU holds of it (its
    LDS there: the kernel compiled for gfx942), and its carveout, read back from the driver,
    is what standin.hold asked for."""
    import ctypes

    from moe_overlay.backends.triton_moe import kernels, standin, target

    if torch.version.hip is not None:
        pytest.skip("a stand-in is an NVIDIA GPU")
    monkeypatch.setenv(target.TARGET_ENV, os.environ.get(target.TARGET_ENV) or "gfx942")
    monkeypatch.setenv(target.UNIT_ENV, "1")
    monkeypatch.setattr(standin, "_held", {})
    spec = mo.MoESpec(8, 256, 128, 2, dtype=DTYPE)
    for _ in range(2):  # held from the second launch of each kernel on
        _check(spec, 40, tol=1e-2)
    steps = _plan(spec, 40)
    assert steps.target.unit_programs
    held = {function: asked for function, asked in standin._held.items() if asked[0]}
    loaded = {k.function: k for fn in (kernels.gate_up_kernel, kernels.down_kernel, kernels.down_resident_kernel)
              for cache in fn.device_caches.values() for k in cache[0].values()}
    gemms = [(loaded[f], programs) for f, (programs, _) in held.items() if f in loaded]
    assert sorted(k.metadata.name.split("_")[0] for k, _ in gemms) == ["down", "gate"]  # one of each
    for k, programs in gemms:
        step = steps.gate_up if k.metadata.name.startswith("gate_up") else steps.down
        lds = standin.target_lds(k, steps.target.amd_options(step.kpack), steps.target)
        assert programs == steps.target.programs_a_unit(lds, k.metadata.num_warps), (k.metadata.name, lds, programs)
    for function, (_, percent) in held.items():
        value = ctypes.c_int()
        assert standin._cuda().cuFuncGetAttribute(ctypes.byref(value), standin.CARVEOUT, ctypes.c_void_p(function)) == 0
        assert value.value == percent


KERNEL = {"block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "group_m": 2}
KERNEL_MX = {**KERNEL, "block_k": 64}  # mxfp4 K steps: whole 64-K chunks (mx_units)
MXFP4 = mo.QuantSpec("mxfp4")
MXFP4_SMALL = [
    mo.MoESpec(8, 224, 96, 2, quant=MXFP4, dtype=DTYPE),  # K of both GEMMs not a multiple of their K steps
    mo.MoESpec(16, 256, 128, 4, mo.Activation.situ(3.0, 9.0), quant=MXFP4, dtype=DTYPE),
    mo.MoESpec(8, 256, 128, 1, apply_router_weight_on_input=True, expert_map=(0, -1, 1, -1, 2, 3, -1, -1),
               quant=MXFP4, dtype=DTYPE),
]


@needs_device
@pytest.mark.parametrize("spec", MXFP4_SMALL, ids=["odd-k", "situ", "k1-oninput-ep"])
@pytest.mark.parametrize("m", [1, 5, 40])  # tiny and sorted; most experts get no token
def test_mxfp4_layers_match_the_dequantising_reference(spec, m):
    _check(spec, m, tol=1e-2)


@needs_device
def test_mxfp4_reads_the_packed_weights_and_every_scale():
    """Flipping one e8m0 scale of one expert (x2) or one packed byte moves that expert's output:
    the kernel reads what it is given, not a copy made at prepare()."""
    spec = MXFP4_SMALL[1]
    prepared, out, (x, w, ids) = _check(spec, 17, tol=1e-2)
    expert = int(ids[0, 0])
    prepared.tensors["w2_scale"][expert] += 1  # every down scale of that expert doubles
    doubled = prepared.apply(x, w, ids)
    assert relative_error(doubled, out) > 1e-2
    prepared.tensors["w2_scale"][expert] -= 1
    torch.testing.assert_close(prepared.apply(x, w, ids), out)


@needs_device
@pytest.mark.parametrize("spec, m, block_m, n_split, whole_block", [
    (MXFP4_SMALL[0], 40, 32, 0, False), (MXFP4_SMALL[1], 150, 48, 2, False), (MXFP4_SMALL[1], 150, 48, 2, True)],
    ids=["odd-k-tiled", "situ-three-tiles-streamed", "situ-three-tiles-streamed-whole-block"])
def test_mxfp4_decoded_a_program_matches_the_scaled_dot(spec, m, block_m, n_split, whole_block, tmp_path,
                                                        monkeypatch):
    """The same sorted entry with and without `mx_dequant` (each program decodes its packed
    weight tiles to 16 bits for a plain dot, where the layout is packed bytes; words ignore
    it): both GEMMs take it (the down tiled, or streamed over N tiles, a third of a block or
    all of it a program), outputs within fp32 rounding of each other, and the reference's
    within mxfp4's error."""
    if _target().mx_words:
        pytest.skip("mxfp4 runs as words on this target: mx_dequant is for packed bytes")
    kernel = {"block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2, "group_m": 2}
    outs = []
    for use in (False, True):
        entry = {"block_m": block_m, "gate_up": {**kernel, "mx_dequant": use},
                 "down": {**kernel, "n_split": n_split, "mx_dequant": use, "whole_block": whole_block}}
        table = {_table_key(): {LayerShape.of(spec).key: {str(m): entry}}}
        (tmp_path / f"configs-{use}.json").write_text(json.dumps({"devices": table}))
        monkeypatch.setenv(USER_FILES_ENV, str(tmp_path / f"configs-{use}.json"))
        steps = _plan(spec, m)
        units = _target().mx_units  # the gate/up's mx_units have their own decode
        assert (steps.gate_up.mx_dequant, steps.down.mx_dequant, steps.down.tile_m2) == (
            use and not units, use, 16 * whole_block)
        outs.append(_check(spec, m, tol=1e-2)[1])
    assert relative_error(outs[1], outs[0]) < 1e-3


UNITS_ENTRIES = {  # (launch entry, tokens) of mx_units layers: tiny mode split over K, the gemv, sorted
    "tiny-split2": ({"block_m": 16, "gate_up": {**KERNEL_MX, "split_k": 2}, "down": KERNEL_MX}, 3),
    "tiny-gemv": ({"block_m": 16, "gate_up": {**KERNEL_MX, "block_n": 8, "block_k": 128, "split_k": 2, "gemv": True},
                   "down": KERNEL_MX}, 3),
    "sorted-k128": ({"block_m": 32, "gate_up": {**KERNEL_MX, "block_k": 128}, "down": KERNEL_MX}, 40),
    # the down streamed over N tiles, a whole block (two row tiles) a program
    "sorted-three-tiles": ({"block_m": 48, "gate_up": KERNEL_MX,
                            "down": {**KERNEL_MX, "n_split": 2, "whole_block": True}}, 150),
}


@needs_device
@pytest.mark.parametrize("spec, entry", [(MXFP4_SMALL[1], entry) for entry in UNITS_ENTRIES]
                         + [(MXFP4_SMALL[2], "tiny-gemv"), (MXFP4_SMALL[2], "sorted-three-tiles")],
                         ids=[*UNITS_ENTRIES, "k1-oninput-ep-tiny-gemv", "k1-oninput-ep-sorted-three-tiles"])
def test_mxfp4_gate_up_units_match_the_dequantising_reference(spec, entry, tmp_path, monkeypatch):
    """MOE_OVERLAY_TRITON_MX_LAYOUT=units: the gate/up's weights as int16 units (layout.mx_units),
    fp16 quarter dots of activations made fp16 a row (launch.fp16_rows), or the gemv's fp32
    products; the down's too after SiTU (fp16 dots of its fp16 output, or tiny mode's fp32
    products), after SiLU packed bytes; within mxfp4's error of the reference. (Not within a
    tighter bound of the packed bytes' output: in bf16, SiTU's activations kept in fp16 put
    sorted-k128 5e-3 from it, 6e-3 from the reference where the bytes are 9e-3.)"""
    config, m = UNITS_ENTRIES[entry]
    units_key = replace(LayerShape.of(spec), layout="units").key  # no target's own layout: entries apart
    (tmp_path / "configs.json").write_text(json.dumps({"devices": {_table_key(): {units_key: {str(m): config}}}}))
    monkeypatch.setenv(USER_FILES_ENV, str(tmp_path / "configs.json"))
    monkeypatch.setenv(MX_LAYOUT_ENV, "units")
    steps = _plan(spec, m)
    assert steps.tiny == entry.startswith("tiny") and steps.target.mx_units
    assert steps.gate_up.kernel == (plan.GEMV if "gemv" in entry else plan.GATE_UP)
    prepared, _, _ = _check(spec, m, tol=1e-2)
    units = ("w13", "w2") if spec.activation.kind == "situ" else ("w13",)  # SiTU bounds the down's fp16 input
    assert prepared.layout.mx_units == units and prepared.tensors["w13"].dtype == torch.int16
    assert prepared.tensors["w2"].dtype == (torch.int16 if "w2" in units else torch.uint8)


@needs_device
def test_fp16_rows_keep_bf16_values_exactly_and_rows_past_fp16s_range():
    """The mx_units gate/up's activations: rows of bf16 to fp16 times a power of two a row,
    exact for every value (bf16's 8 significant bits, down to 2^-29 of the row's largest),
    rows past 65504 and of zeros too."""
    from moe_overlay.backends.triton_moe.launch import fp16_rows

    x = torch.randn(4, 200, device=DEVICE).to(torch.bfloat16)
    x[1] *= 2.0**20  # past fp16's 65504
    x[2] *= 2.0**-20
    x[3] = 0
    q, scale = fp16_rows(x)
    assert q.dtype == torch.float16 and scale.shape == (4, 1)
    assert torch.equal(q.float() * scale, x.float())
    assert (q[:3].float().abs().amax(1) > 2.0**14).all() and (q[:3].float().abs().amax(1) <= 2.0**15).all()


FP8_BLOCK_SMALL = with_weights(mo.MoESpec(8, 384, 256, 2), "fp8-block")
# (launch config, token count): tiny mode with K split 4 ways (the down kernel unrolls over
# the splits) and narrow tiles, and with the gemv gate/up; sorted mode with
# blocks of 32 grouped 2 by 2; the down with 2, 3 or 8 programs per block, each walking its
# share of the N tiles (bf16/fp16: a resident activation block; fp8 and mxfp4: the streamed
# down_kernel; 8 programs over 4 to 7 tiles leave some with none); blocks of 48 rows
# (gate/up: row tiles of 32 and 16 sharing each weight tile; down: a program per 16 rows, or
# per block as the gate/up has it);
# weight tiles through tensor descriptors (plain loads where the weights' rows are not
# 16-byte aligned: "unaligned").
UNUSUAL = {
    "tiny-split4": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 16, "split_k": 4},
                     "down": {**KERNEL, "block_k": 64}}, 5),
    # gate/up as a matrix-vector product per route: 5 tokens share experts, each route reads its own
    "tiny-gemv": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 8, "block_k": 64, "split_k": 2, "gemv": True},
                   "down": {**KERNEL, "block_k": 64}}, 5),
    "tiny-gemv-one-token": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 4, "block_k": 128, "split_k": 4,
                                                        "num_stages": 1, "gemv": True},
                             "down": {**KERNEL, "block_k": 64}}, 1),
    "sorted-grouped": ({"block_m": 32, "gate_up": KERNEL, "down": KERNEL}, 40),
    "sorted-resident": ({"block_m": 32, "gate_up": KERNEL, "down": {**KERNEL, "n_split": 2}}, 40),
    "sorted-resident-3": ({"block_m": 16, "gate_up": KERNEL, "down": {**KERNEL, "n_split": 3}}, 40),
    "sorted-split-8": ({"block_m": 32, "gate_up": KERNEL, "down": {**KERNEL, "block_n": 64, "n_split": 8}}, 40),
    "sorted-three-tiles": ({"block_m": 48, "gate_up": KERNEL, "down": KERNEL}, 150),
    "sorted-three-tiles-resident": ({"block_m": 48, "gate_up": KERNEL, "down": {**KERNEL, "n_split": 2}}, 150),
    "sorted-three-tiles-whole-block": ({"block_m": 48, "gate_up": KERNEL, "down": {**KERNEL, "whole_block": True}},
                                       150),
    # the down's routes shared by 2 programs a token (k=1 layers: one program, the split has nothing to share)
    "tiny-down-split": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 16, "split_k": 2},
                         "down": {**KERNEL, "block_k": 64, "split_k": 2}}, 5),
    # the down's K steps as wide as a small I (fp8: two or four 128-wide groups, each quantised and scaled on its own)
    "tiny-down-wide": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 16, "split_k": 2},
                        "down": {**KERNEL, "block_k": 256}}, 5),
    "tiny-down-wider": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 16, "split_k": 2},
                         "down": {**KERNEL, "block_k": 512, "split_k": 2}}, 1),
    # the down started by programmatic dependent launch while its gate/up runs (NVIDIA sm_90+; elsewhere plain)
    "tiny-pdl": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 16, "split_k": 2},
                  "down": {**KERNEL, "block_k": 64, "split_k": 2, "pdl": True}}, 5),
    "tiny-descriptors": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 16, "split_k": 4, "descriptors": True},
                          "down": {**KERNEL, "block_k": 64}}, 5),
    "sorted-descriptors": ({"block_m": 32, "gate_up": {**KERNEL, "descriptors": True},
                            "down": {**KERNEL, "descriptors": True}}, 40),
    "sorted-three-tiles-resident-descriptors": ({"block_m": 48, "gate_up": {**KERNEL, "descriptors": True},
                                                 "down": {**KERNEL, "n_split": 2, "descriptors": True}}, 150),
    # fp8 dots of 16 or 32 rows, the weight tile the left operand (wgmma's M; NVIDIA sm_90+, elsewhere as written)
    "tiny-weight-left": ({"block_m": 16, "gate_up": {**KERNEL, "block_n": 64, "split_k": 2, "weight_left": True},
                          "down": {**KERNEL, "block_k": 64}}, 5),
    "sorted-weight-left": ({"block_m": 32, "gate_up": {**KERNEL, "block_n": 64, "weight_left": True},
                            "down": {**KERNEL, "block_n": 64, "n_split": 2, "weight_left": True}}, 40),
    "sorted-three-tiles-weight-left": ({"block_m": 48, "gate_up": {**KERNEL, "block_n": 64, "weight_left": True},
                                       "down": {**KERNEL, "block_n": 64, "weight_left": True}}, 150),
}
# variants that are another's with NVIDIA's launch features added: on other targets, the same launch
NVIDIA_TWINS = {"tiny-pdl": "tiny-down-split", "tiny-descriptors": "tiny-split4",
                "sorted-descriptors": "sorted-grouped",
                "sorted-three-tiles-resident-descriptors": "sorted-three-tiles-resident"}
assert all(UNUSUAL[twin][1] == UNUSUAL[name][1] for name, twin in NVIDIA_TWINS.items())
UNALIGNED = mo.MoESpec(8, 100, 36, 2, dtype=DTYPE)  # 200- and 72-byte weight rows
GLUON_SPECS = [with_weights(spec, "fp8-block") for spec in (  # H a whole number of the Gluon kernel's passes
    mo.MoESpec(8, 512, 256, 2),
    mo.MoESpec(16, 512, 256, 4, mo.Activation.situ(3.0, 9.0)),
    mo.MoESpec(8, 512, 128, 1, apply_router_weight_on_input=True, expert_map=(0, -1, 1, -1, 2, 3, -1, -1)),
)]


@needs_cuda
@fp8_ok
@pytest.mark.parametrize("spec", GLUON_SPECS, ids=["silu", "situ", "k1-oninput-ep"])
@pytest.mark.parametrize("m", [40, 300])  # blocks of 64 partly filled, and experts of several blocks
@pytest.mark.parametrize("block_n", [64, 32])
def test_gluon_block_fp8_gate_up_equals_the_tl_kernel(spec, m, block_n, tmp_path, monkeypatch):
    """The same entry with and without `gluon` (gluon_kernels on NVIDIA from sm_90, which must
    take it there; elsewhere both run kernels.gate_up_kernel), N tiles of 64 and of 32: the
    same sums in the same order, so the same output, and the reference's within fp8's error."""

    kernel = {"block_n": block_n, "block_k": 128, "num_warps": 4, "num_stages": 4, "group_m": 1}
    outs = []
    for gluon in (False, True):
        entry = {"block_m": 64, "gate_up": {**kernel, "gluon": gluon}, "down": kernel}
        table = {_table_key(): {LayerShape.of(spec).key: {str(m): entry}}}
        (tmp_path / f"configs-{gluon}.json").write_text(json.dumps({"devices": table}))
        monkeypatch.setenv(USER_FILES_ENV, str(tmp_path / f"configs-{gluon}.json"))
        assert (_plan(spec, m).gate_up.kernel == plan.GLUON_BLOCK_FP8) == (gluon and _target().hopper)
        outs.append(_check(spec, m, tol=2e-2)[1])
    assert torch.equal(outs[0], outs[1])


GLUON_MX_SPECS = [with_weights(spec, "mxfp4") for spec in GLUON_SPECS]  # H and I whole word chunks and wgmmas
GLUON_MX_ENTRIES = {  # (block_m, gate_up) of gluon_kernels' mx_words gate/up
    "16-rows": (16, {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 1}),
    "32-rows-two-wgmmas": (32, {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4, "group_m": 1}),
    "64-rows-two-chunks": (64, {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 2, "group_m": 1}),
}


@needs_cuda
@pytest.mark.parametrize("spec", GLUON_MX_SPECS, ids=["silu", "situ", "k1-oninput-ep"])
@pytest.mark.parametrize("m", [40, 300])
@pytest.mark.parametrize("entry", GLUON_MX_ENTRIES)
def test_gluon_mx_words_gate_up_equals_the_tl_kernel(spec, m, entry, tmp_path, monkeypatch):
    """The same mxfp4 entry with and without `gluon` (gluon_kernels' mx_words kernel on NVIDIA
    from sm_90, which must take it there; elsewhere both run kernels.gate_up_kernel): the same
    decoded weights and the same wgmma sums, so the same output, and the reference's within
    bf16's error."""
    block_m, gate_up = GLUON_MX_ENTRIES[entry]
    down = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 1}
    _equal_with_and_without_gluon(spec, m, block_m, gate_up, down, "gate_up", tmp_path, monkeypatch)


def _equal_with_and_without_gluon(spec, m, block_m, gate_up, down, gemm, tmp_path, monkeypatch):
    """_with_and_without_gluon's two outputs are equal."""
    gluon_off, gluon_on = _with_and_without_gluon(spec, m, block_m, gate_up, down, gemm, tmp_path, monkeypatch)
    assert torch.equal(gluon_off, gluon_on)


def _with_and_without_gluon(spec, m, block_m, gate_up, down, gemm, tmp_path, monkeypatch, taken=True):
    """The layer's outputs with `gemm`'s entry ("gate_up", "tiny_gate_up", "down" or "tiny_down")
    without and with `gluon`: on NVIDIA from sm_90 launch must take gluon_kernels' kernel when
    asked and `taken` (elsewhere both run the `tl` kernel); each within bf16's error of the
    reference."""
    step, kernel = {"gate_up": ("gate_up", plan.GLUON_MX), "tiny_gate_up": ("gate_up", plan.GLUON_MX_TINY),
                    "down": ("down", plan.GLUON_MX), "tiny_down": ("down", plan.GLUON_MX_TINY)}[gemm]
    key = gemm.removeprefix("tiny_")
    outs = []
    for gluon in (False, True):
        entry = {"block_m": block_m, "gate_up": gate_up, "down": down}
        entry[key] = {**entry[key], "gluon": gluon}
        table = {_table_key(): {LayerShape.of(spec).key: {str(m): entry}}}
        (tmp_path / f"configs-{gluon}.json").write_text(json.dumps({"devices": table}))
        monkeypatch.setenv(USER_FILES_ENV, str(tmp_path / f"configs-{gluon}.json"))
        _, out, _ = _check(spec, m, tol=1e-2)
        assert (getattr(_plan(spec, m), step).kernel == kernel) == (gluon and taken and _target().hopper)
        outs.append(out)
    return outs


GLUON_MX_DOWNS = {  # (block_m, streamed down) of gluon_kernels' mx_words down
    "16-rows-a-program-idle": (16, {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3, "n_split": 3}),
    "32-rows-wide-tiles": (32, {"block_n": 256, "block_k": 64, "num_warps": 4, "num_stages": 4, "n_split": 1}),
    "64-rows-two-chunks": (64, {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 2, "n_split": 2}),
}


@needs_cuda
@pytest.mark.parametrize("spec", GLUON_MX_SPECS, ids=["silu", "situ", "k1-oninput-ep"])
@pytest.mark.parametrize("m", [40, 300])
@pytest.mark.parametrize("entry", GLUON_MX_DOWNS)
def test_gluon_mx_words_down_equals_the_tl_kernel(spec, m, entry, tmp_path, monkeypatch):
    """The same streamed mxfp4 down with and without `gluon` (gluon_kernels' mx_words down on
    NVIDIA from sm_90, which must take it there; elsewhere both run kernels.down_kernel): N
    tiles of two 64- or 128-row halves, K steps of one and two word chunks, a program left
    without an N tile (4 tiles over 3 programs), the router weight on the output and on the
    input: the same sums, so the same output, and the reference's within bf16's error."""
    block_m, down = GLUON_MX_DOWNS[entry]
    gate_up = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 1, "gluon": True}
    _equal_with_and_without_gluon(spec, m, block_m, gate_up, down, "down", tmp_path, monkeypatch)


def tiny_mx_cases(entries: dict) -> Callable:
    """needs_cuda and tiny mode's mx_words cases: each of GLUON_MX_SPECS, one token or 16
    routes, each of `entries`."""
    marks = (pytest.mark.parametrize("entry", entries), pytest.mark.parametrize("tokens", ["one", "sixteen-routes"]),
             pytest.mark.parametrize("spec", GLUON_MX_SPECS, ids=["silu", "situ", "k1-oninput-ep"]), needs_cuda)
    return lambda test: functools.reduce(lambda marked, mark: mark(marked), marks, test)


GLUON_MX_TINY = {  # (gate/up, down) of tiny mode with gluon_kernels' mx_words gate/up
    "split-2": ({"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "split_k": 2},
                {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 1, "split_k": 2}),
    "unsplit-two-wgmmas-pdl": ({"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4, "split_k": 1},
                               {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 1, "pdl": True}),
    "a-step-a-split-two-chunks": ({"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 2, "split_k": 4},
                                  {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 1, "split_k": 1}),
}


@tiny_mx_cases(GLUON_MX_TINY)
def test_gluon_mx_words_tiny_gate_up_equals_the_tl_kernel(spec, tokens, entry, tmp_path, monkeypatch):
    """Tiny mode's mxfp4 gate/up with and without `gluon` (gluon_kernels' tiny mx_words kernel
    on NVIDIA from sm_90, which must take it there; elsewhere both run kernels.gate_up_kernel):
    one token, and 16 routes (several to one expert: one program takes them all), K split 1,
    2 and 4 ways (one K step a split), N tiles of one and two wgmmas, PDL: the same output."""
    gate_up, down = GLUON_MX_TINY[entry]
    m = 1 if tokens == "one" else 16 // spec.top_k
    _equal_with_and_without_gluon(spec, m, 16, gate_up, down, "tiny_gate_up", tmp_path, monkeypatch)


GLUON_MX_TINY_DOWNS = {  # tiny mode's downs in gluon_kernels' one-token mx_words down
    "a-route-a-program-pdl": {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 2, "split_k": 4,
                              "pdl": True},
    "all-routes-256-rows-steps-of-64": {"block_n": 256, "block_k": 64, "num_warps": 4, "num_stages": 3, "split_k": 1},
}


@tiny_mx_cases(GLUON_MX_TINY_DOWNS)
def test_gluon_mx_words_tiny_down_matches_the_tl_kernel(spec, tokens, entry, tmp_path, monkeypatch):
    """Tiny mode's mxfp4 down with and without `gluon` (gluon_kernels' one-token mx_words down
    on NVIDIA from sm_90, which must take it there; elsewhere both run kernels.down_tiny_kernel):
    each output within bf16's error of the reference, and the two within the rounding of the
    activations to bf16 (the Gluon down's wgmma takes them so; the `tl` one keeps fp32)."""
    m = 1 if tokens == "one" else 16 // spec.top_k
    gate_up = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "split_k": 2}
    down = GLUON_MX_TINY_DOWNS[entry]
    two_steps = spec.intermediate_size >= 2 * down["block_k"]  # else the tl kernel runs
    tl_out, gluon_out = _with_and_without_gluon(spec, m, 16, gate_up, down, "tiny_down", tmp_path, monkeypatch,
                                                taken=two_steps)
    assert relative_error(gluon_out, tl_out) < 5e-3


RESIDENT_FP8_SPECS = [with_weights(spec, "fp8-block") for spec in (
    mo.MoESpec(8, 384, 384, 2),  # three K steps, weight tiles through descriptors
    mo.MoESpec(8, 256, 200, 4, mo.Activation.situ(3.0, 9.0)),  # a last K step of 72: plain loads, masked
    mo.MoESpec(8, 512, 256, 1, apply_router_weight_on_input=True, expert_map=(0, -1, 1, -1, 2, 3, -1, -1)),
)]
RESIDENT_FP8_DOWNS = {  # (block_m, down), each against the same entry's streamed down
    "64-rows": (64, {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "n_split": 1,
                     "descriptors": True}),
    "32-rows-weight-left": (32, {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "n_split": 2,
                                 "descriptors": True, "weight_left": True}),
}


@needs_cuda
@fp8_ok
@pytest.mark.parametrize("spec", RESIDENT_FP8_SPECS, ids=["three-steps", "partial-step-situ", "k1-oninput-ep"])
@pytest.mark.parametrize("down", RESIDENT_FP8_DOWNS)
@pytest.mark.parametrize("m", [40, 300])  # blocks partly filled, and experts of several blocks
def test_block_fp8_resident_down_matches_the_streamed_one_and_the_reference(spec, down, m, tmp_path, monkeypatch):
    """The resident down (its activation tile loaded once per program) and the streamed one of
    the same entry add the same rescaled products: outputs within fp32 rounding of each other,
    and the reference's within fp8's error."""
    block_m, kernel = RESIDENT_FP8_DOWNS[down]
    outs = []
    for resident in (False, True):
        entry = {"block_m": block_m, "gate_up": {**kernel, "n_split": 0, "weight_left": False},
                 "down": {**kernel, "resident": resident}}
        table = {_table_key(): {LayerShape.of(spec).key: {str(m): entry}}}
        (tmp_path / f"configs-{resident}.json").write_text(json.dumps({"devices": table}))
        monkeypatch.setenv(USER_FILES_ENV, str(tmp_path / f"configs-{resident}.json"))
        assert _plan(spec, m).down.kernel == (plan.RESIDENT if resident else plan.STREAMED)
        outs.append(_check(spec, m, tol=2e-2)[1])
    assert relative_error(outs[1], outs[0]) < 1e-3


@needs_device
@pytest.mark.parametrize("spec", [SMALL[1], SMALL[2], SMALL[4], SMALL[5], UNALIGNED, MXFP4_SMALL[0],
                                  pytest.param(FP8_BLOCK_SMALL, marks=fp8_ok),
                                  pytest.param(with_weights(mo.MoESpec(8, 384, 256, 2), "fp8-channel-token"),
                                               marks=fp8_ok)],
                         ids=["odd-sizes", "situ", "k1-oninput-ep", "k3-ep", "unaligned", "mxfp4", "fp8-block",
                              "fp8-channel-token"])
@pytest.mark.parametrize("variant", UNUSUAL)
def test_unusual_launch_configs_match_the_reference(variant, spec, tmp_path, monkeypatch):
    """Each unusual entry matches the reference. A variant that is another's with NVIDIA's
    launch features (PDL, tensor descriptors) added runs where the target has them; elsewhere
    its plan must be its twin's, which runs."""
    m = UNUSUAL[variant][1]

    def plan_of(name):
        table = {_table_key(): {LayerShape.of(spec).key: {str(m): UNUSUAL[name][0]}}}
        (tmp_path / f"{name}.json").write_text(json.dumps({"devices": table}))
        monkeypatch.setenv(USER_FILES_ENV, str(tmp_path / f"{name}.json"))
        return _plan(spec, m)

    mine = plan_of(variant)
    if variant in NVIDIA_TWINS and not _target().hopper:
        assert not (mine.pdl or mine.gate_up.descriptors or mine.down.descriptors)
        assert mine.describe() == plan_of(NVIDIA_TWINS[variant]).describe()
        return
    _check(spec, m, tol=2e-2)


@needs_cuda
@fp8_ok
@pytest.mark.parametrize("spec", [
    with_weights(mo.MoESpec(8, 320, 200, 4, mo.Activation.situ(3.0, 9.0)), "fp8-block"),
    with_weights(mo.MoESpec(8, 384, 256, 1, apply_router_weight_on_input=True, expert_map=(0, -1, 1, -1, 2, 3, -1, -1)),
                 "fp8-block"),
    with_weights(mo.MoESpec(8, 320, 200, 2), "fp8-channel"),
    with_weights(mo.MoESpec(8, 320, 200, 2), "fp8-tensor"),
    with_weights(mo.MoESpec(8, 320, 200, 1), "fp8-channel-token"),
], ids=["block-partial-step-situ", "block-k1-oninput-ep", "channel", "tensor", "channel-token"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("gemv", [(16, 2, 4, 128), (32, 4, 1, 128), (16, 2, 8, 256)],
                         ids=["16-columns-split-4", "32-columns", "two-groups-a-step"])
def test_fp8_gemv_gate_up_matches_the_dot_kernel_and_the_reference(spec, m, gemv, tmp_path, monkeypatch):
    """Tiny fp8 through the gemv gate/up (one or two 128-wide groups a K step, the last group
    partial in H=320, with two a step the last step's second group empty; N tiles past I=200;
    the activation quantised per group, or per token over its whole row, as the dot kernel's
    path does; block scales each group, channel and tensor scales after) and through the dot
    kernel, same entry otherwise: outputs within fp32 rounding of each other, and the
    reference's within fp8's error."""

    block_n, warps, split, block_k = gemv
    down = {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 1, "group_m": 1}
    outs = []
    for use in (False, True):
        gate_up = {"block_n": block_n if use else 64, "block_k": block_k if use else 128, "num_warps": warps,
                   "num_stages": 1 if use else 3,
                   "group_m": 1, "split_k": split, "gemv": use}
        table = {_table_key(): {LayerShape.of(spec).key: {str(m): {
            "block_m": 16, "gate_up": gate_up, "down": down}}}}
        (tmp_path / f"configs-{use}.json").write_text(json.dumps({"devices": table}))
        monkeypatch.setenv(USER_FILES_ENV, str(tmp_path / f"configs-{use}.json"))
        step = _plan(spec, m).gate_up
        assert (step.kernel == plan.GEMV) == use and step.config.block_k == gate_up["block_k"]
        outs.append(_check(spec, m, tol=2e-2)[1])
    assert relative_error(outs[1], outs[0]) < 1e-3


@needs_device
@pytest.mark.parametrize("gemv", [False, True])
def test_split_tiny_gate_up_leaves_its_arrival_counts_at_zero(gemv):
    """Tiny gate/up split along K, and the down's routes split over programs: the last program
    of each tile to arrive adds the splits up and sets its count back to zero, so the next
    launch (another split, more tiles) finds them zero and sums the same way: results equal
    bit for bit, every count zero after each call."""
    from moe_overlay.backend import Platform
    from moe_overlay.backends.triton_moe import launch
    from moe_overlay.backends.triton_moe.backend import TritonBackend
    from moe_overlay.backends.triton_moe.configs import KernelConfig, LaunchConfig
    from moe_overlay.layout import to_layout

    # the interpreter: half of H (4 K steps: splits of 1, and 2, 1, 1) and of I
    spec = mo.MoESpec(16, 128, 64, 4, mo.Activation.situ(), dtype=DTYPE) if INTERPRET else SMALL[2]
    canonical = random_weights(spec, DEVICE, 0)
    w, ids = random_routing(3, spec, DEVICE, 1)
    x = random_input(3, spec, DEVICE, 2)
    t = to_layout(canonical, spec, TritonBackend().layout_for(spec, Platform.of(x.device)))
    layer = launch.Layer.of(x, t["w13"], t["w2"], spec.top_k, "situ", list(spec.activation.params), False, None)
    outs = []
    for split, block_n, down_split in [(4, 16, 2), (4, 16, 2), (3, 8, 4), (4, 16, 2)]:
        config = LaunchConfig(16, KernelConfig(block_n, 32, 4, 1 if gemv else 2, split_k=split, gemv=gemv),
                              KernelConfig(16, 64, 4, 1, split_k=down_split))
        outs.append(launch.fused_experts(layer, x, t["w13"], t["w2"], None, None, w, ids, None, config))
        assert all(int(c.abs().sum()) == 0 for c in launch._ARRIVALS[x.device])
    ref = reference_moe(x, canonical["w13"], canonical["w2"], w, ids, spec.quant, spec.activation, False)
    assert relative_error(outs[0], ref) < 1e-2
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[3])
    assert relative_error(outs[2], outs[0]) < 1e-3


@needs_cuda
@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("spec", [SMALL[2], MXFP4_SMALL[1], pytest.param(FP8_BLOCK_SMALL, marks=fp8_ok)],
                         ids=["situ", "mxfp4", "fp8-block"])
def test_one_token_pdl_launches_equal_plain_ones_in_cuda_graphs(spec, gemv):
    """The down started by programmatic dependent launch (where the GPU has it) reads the
    activation only after its gate/up has written all of it: the same bits as plain launches,
    called eagerly and replayed from a CUDA graph with another token."""
    from moe_overlay.backend import Platform
    from moe_overlay.backends.triton_moe import launch
    from moe_overlay.backends.triton_moe.backend import TritonBackend
    from moe_overlay.backends.triton_moe.configs import KernelConfig, LaunchConfig
    from moe_overlay.layout import to_layout

    t = to_layout(random_weights(spec, DEVICE, 0), spec, TritonBackend().layout_for(spec, Platform.of("cuda")))
    tokens = [[random_input(1, spec, DEVICE, 2 * i), *random_routing(1, spec, DEVICE, 2 * i + 1)] for i in (1, 2)]
    layer = launch.Layer.of(tokens[0][0], t["w13"], t["w2"],
                            spec.top_k, spec.activation.kind, list(spec.activation.params),
                            False, spec.quant.granularity)
    fp8 = spec.quant.weights == "fp8"
    gate_up = KernelConfig(16, 128 if fp8 else 64, 4, 1 if gemv else 2, split_k=2, gemv=gemv)
    outs = {}
    for pdl in (False, True):
        config = LaunchConfig(16, gate_up, KernelConfig(16, 128 if fp8 else 64, 4, 1, split_k=2, pdl=pdl))
        static = [v.clone() for v in tokens[0]]

        def call(config=config, static=static):
            x, w, ids = static
            return launch.fused_experts(layer, x, t["w13"], t["w2"], t.get("w13_scale"), t.get("w2_scale"), w, ids,
                                        None, config)

        first = call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for dst, src in zip(static, tokens[1], strict=True):
            dst.copy_(src)
        graph.replay()
        outs[pdl] = (first, out.clone(), call())
    assert launch.plan_for(layer, config, tiny=True).pdl == _target().hopper
    for plain, chained in zip(outs[False], outs[True], strict=True):
        assert torch.equal(plain, chained)
    first, replayed, second = outs[True]
    assert torch.equal(replayed, second) and not torch.equal(first, second)


@fp8_ok
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("inter", [256, 200])  # block, 200: up tiles straddle 128-row scale blocks (a scale per row)
@pytest.mark.parametrize("m", [1, 7, 60])
def test_fp8_w8a8_matches_the_reference(granularity, inter, m):
    spec = with_weights(mo.MoESpec(8, 384, inter, 2, mo.Activation.situ()), f"fp8-{granularity}")
    _check(spec, m, tol=2e-2)


@fp8_ok
@pytest.mark.parametrize("spec", [
    with_weights(mo.MoESpec(8, 384, 256, 2), "fp8-channel-token"),
    with_weights(mo.MoESpec(8, 384, 200, 1, apply_router_weight_on_input=True,
                            expert_map=(0, -1, 1, 2, -1, 3, 4, -1)), "fp8-channel-token"),
], ids=["k2", "k1-oninput-ep-odd-i"])
@pytest.mark.parametrize("m", [1, 7, 60])
def test_fp8_per_channel_weights_with_per_token_activations_match_the_reference(spec, m):
    _check(spec, m, tol=2e-2)


@fp8_ok
@pytest.mark.parametrize("m", [1, 3])  # tiny mode: the fp32 gate/up partials meet the reference's fp32 sums
def test_per_token_activations_are_scaled_by_the_whole_row(m):
    """Each row's largest value in its last column: every K step before it must still be
    quantised with the whole row's scale, as the reference does. On the H200 tiny mode meets
    the reference within 3.2e-4 (often exactly); with a scale per K step instead (a mutant
    tried there) the fp8 values round elsewhere and it missed by 3.5e-2 to 6.0e-2."""
    spec = with_weights(mo.MoESpec(8, 384, 256, 2), "fp8-channel-token")
    _check(spec, m, tol=5e-3, peak_at=383)


@fp8_ok
def test_activation_groups_are_quantised_once_as_the_main_loops_would():
    """quantize_groups (sorted-mode w8a8 activations, quantised before the GEMMs): per row and
    128 columns, scale = absmax / fp8 max and q = x / scale rounded to fp8, for the rows below
    the device count it is given; a partial last group counts only its own columns."""
    from moe_overlay.backends.triton_moe.launch import QUANT_GROUP, quantize_groups

    fp8 = torch.float8_e4m3fn if torch.version.hip is None else torch.float8_e4m3fnuz
    src = torch.randn(50, 300, device=DEVICE, dtype=DTYPE) * torch.logspace(-3, 2, 50, device=DEVICE)[:, None]
    src[3, :128] = 0  # an all-zero group: the scale's floor, no division by zero
    limit = torch.tensor([37], dtype=torch.int32, device=DEVICE)
    q, scale = quantize_groups(src, fp8, limit)
    assert q.dtype == fp8 and scale.shape == (50, 3)
    fmax = torch.finfo(fp8).max
    groups = torch.nn.functional.pad(src[:37].float(), (0, 3 * QUANT_GROUP - 300)).view(37, 3, QUANT_GROUP)
    want_scale = (groups.abs().amax(-1) / fmax).clamp(min=1e-12)
    torch.testing.assert_close(scale[:37], want_scale, rtol=1e-6, atol=0)
    back = (q[:37].float().view(37, -1) * scale[:37].repeat_interleave(QUANT_GROUP, 1)[:, :300])
    step = scale[:37].repeat_interleave(QUANT_GROUP, 1)[:, :300] * 2.0 ** -9  # e4m3's subnormal spacing
    assert ((back - src[:37].float()).abs() <= src[:37].float().abs() * 2.0 ** -4 + step).all()
    assert torch.isfinite(q[:37].float()).all() and (q[3, :128].float() == 0).all()
    q, scale = quantize_groups(src, fp8, limit, per_token=True)  # one scale per row, in every group
    want_scale = (src[:37].float().abs().amax(-1) / fmax).clamp(min=1e-12)
    torch.testing.assert_close(scale[:37], want_scale[:, None].expand(37, 3), rtol=1e-6, atol=0)
    back, exact = q[:37].float() * want_scale[:, None], src[:37].float()
    assert ((back - exact).abs() <= exact.abs() * 2.0 ** -4 + want_scale[:, None] * 2.0 ** -9).all()


@needs_device
@pytest.mark.parametrize(("kind", "beta", "linear_beta"), [("silu", 1.0, 1.0), ("situ", 1.0, 1.0), ("situ", 3.5, 7.0)])
def test_kernel_activation_matches_the_definition_far_into_saturation(kind, beta, linear_beta):
    """The kernels' SiLU/SiTU (fused into one division, exponents capped) against torch's
    definition in fp32, from -60 to 60 in gate and up: finite, and close everywhere."""
    import triton

    from moe_overlay.activations import silu_and_mul, situ_and_mul
    from moe_overlay.backends.triton_moe.launch import ACTIVATIONS
    from tests.triton_activation_kernel import activate_kernel

    grid = torch.linspace(-60, 60, 241)
    gate, up = (t.reshape(-1).contiguous().to(DEVICE) for t in torch.meshgrid(grid, grid, indexing="ij"))
    out = torch.empty_like(gate)
    activate_kernel[(triton.cdiv(gate.numel(), 1024),)](gate, up, out, gate.numel(), beta, linear_beta,
                                                        ACTIVATION=ACTIVATIONS[kind], BLOCK=1024)
    ref = (silu_and_mul(gate.double(), up.double()) if kind == "silu"
           else situ_and_mul(gate.double(), up.double(), beta, linear_beta))
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs() / ref.abs().clamp(min=1.0)
    assert float(err.max()) < 1e-5, f"{kind} beta={beta}: worst at gate={gate[err.argmax()]}, up={up[err.argmax()]}"


@needs_device
@pytest.mark.parametrize("kind", ["plain", "tiles"])
def test_floor_read_kernels_fold_every_word_they_time(kind):
    """The bandwidth floor's read-only kernels: each program's output is the xor of all it read,
    so a word left unread (or read twice) shows."""
    import numpy as np

    from moe_overlay.backends.triton_moe import bench

    src = torch.randint(-2**31, 2**31 - 1, (2 * 16 * 4 * bench.READ_TILE_COLS,), dtype=torch.int32, device=DEVICE)
    run, out = bench.plain_read(src, 512, 4, 4) if kind == "plain" else bench.tile_read(src, 16, 4, 4, 2)
    run()
    words = src.cpu().numpy().reshape(out.shape[0], 4, -1)  # program, iteration, its block or tile
    expected = np.bitwise_xor.reduce(words, axis=1).reshape(out.shape)
    np.testing.assert_array_equal(out.cpu().numpy(), expected)


@needs_device
def test_floor_dot_read_sums_every_byte_it_times():
    """The floor's read through a dot: each program's output is the column sums of all the
    int8 tiles it read, so a byte left unread (or read twice) shows."""
    from moe_overlay.backends.triton_moe import bench

    src = torch.randint(-2**31, 2**31 - 1, (2 * 32 * 4 * 32 // 4,), dtype=torch.int32, device=DEVICE)
    run, out = bench.dot_read(src, 32, 32, 4, 4, 2)  # K 32: NVIDIA's least for int8 dots
    run()
    expected = src.cpu().view(torch.int8).reshape(out.shape[0], 4 * 32, 32).to(torch.int32).sum(1)
    assert torch.equal(out.cpu(), expected)


@needs_device
@pytest.mark.parametrize("tokens", [40, 2348])  # one sort program (of the fewest routes); 23 of 512 routes
def test_align_sorts_every_route_once_into_padded_expert_blocks(tokens):
    from moe_overlay.backends.triton_moe.launch import ALIGN_CHUNKS, align, align_chunk

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (tokens, 5), generator=gen, dtype=torch.int32).to(DEVICE)
    assert align_chunk(ids.numel()) == (ALIGN_CHUNKS[0] if tokens == 40 else 512)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, 6, -1, 7, 8], dtype=torch.int32, device=DEVICE)
    a = align(ids, expert_map, 9, 16)
    local = expert_map[ids.reshape(-1).long()].cpu()
    counts = torch.bincount(local[local >= 0], minlength=9)
    padded = (counts + 15) // 16 * 16
    assert int(a.num_padded) == int(padded.sum())
    sorted_routes, experts, rows = a.sorted_routes.cpu(), a.block_expert.cpu(), a.block_rows.cpu()
    seen = []
    for b in range(int(a.num_padded) // 16):
        block = sorted_routes[b * 16 : b * 16 + int(rows[b])]
        assert (local[block.long()] == experts[b]).all()
        seen += block.tolist()
    assert sorted(seen) == torch.nonzero(local >= 0).flatten().tolist()
    assert experts[: int(a.num_padded) // 16].tolist() == sorted(experts[: int(a.num_padded) // 16].tolist())


# -- the four models' per-GPU layers under TP8 (GPU only: big) --------------------------------


@pytest.fixture(scope="module")
def model_weights():
    cache = {}

    def get(spec):
        if spec not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[spec] = random_weights(spec, "cuda", seed=0)
        return cache[spec]

    return get


# The formats the checkpoints ship (Kimi-K3 mxfp4, DeepSeek-V3 fp8 128x128 blocks, FP8 Maverick
# per-channel weights with per-token activations) and more: fp8-block and mxfp4 on both
# fp8 models' shapes, and Maverick's per-channel weights with 128-wide activation groups (which
# share fp8-channel-token's entries: at M=1 and 16 one-token downs of four and two groups a step).
MODEL_POINTS = [(m.name, "bf16", t) for m in MODELS for t in TOKEN_COUNTS] + [
    (name, weights, t) for weights in ("fp8-block", "mxfp4") for name in FP8_MODELS for t in TOKEN_COUNTS] + [
    ("Maverick", weights, t) for weights in ("fp8-channel-token", "fp8-channel") for t in TOKEN_COUNTS]


@needs_cuda
@pytest.mark.parametrize(("name", "weights", "m"), MODEL_POINTS, ids=lambda v: str(v))
def test_model_layers_match_the_reference(model_weights, name, weights, m):
    spec = with_weights(next(x for x in MODELS if x.name == name).spec, weights)
    tensors = model_weights(spec)
    w, ids = random_routing(m, spec, "cuda", seed=m)
    x = random_input(m, spec, "cuda", seed=m + 1)
    ref = reference_moe(x, tensors["w13"], tensors["w2"], w, ids, spec.quant, spec.activation,
                        spec.apply_router_weight_on_input, (tensors.get("w13_scale"), tensors.get("w2_scale")))
    # prepare() re-lays out in place: a copy keeps the cached weights canonical for the next point
    prepared = mo.PreparedExperts(spec, {k: v.clone() for k, v in tensors.items()}, mo.get_backend("triton"))
    prepared.prepare()
    out = prepared.apply(x, w, ids)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < (3e-2 if weights.startswith("fp8") else 2e-2)


# -- graphs, compile, op registration ---------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("descriptors", [False, True], ids=["plain-loads", "descriptors"])
@pytest.mark.parametrize("m", [1, 64])
def test_cuda_graph_replay_matches_eager_on_new_inputs(m, descriptors, tmp_path, monkeypatch):
    spec = mo.MoESpec(16, 512, 256, 4, mo.Activation.situ())
    if descriptors:  # their device scratch comes from the allocator hook: it must be captured too
        entry = default_config(LayerShape.of(spec), m).to_json()
        for kernel in ("gate_up", "down"):
            entry[kernel]["descriptors"] = True
        table = {_table_key(): {LayerShape.of(spec).key: {str(m): entry}}}
        (tmp_path / "configs.json").write_text(json.dumps({"devices": table}))
        monkeypatch.setenv(USER_FILES_ENV, str(tmp_path / "configs.json"))
    prepared, _, (x, w, ids) = _check(spec, m, tol=1e-2)
    static = [t.clone() for t in (x, w, ids)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prepared.apply(*static)
    x2 = random_input(m, spec, "cuda", 9)
    w2, ids2 = random_routing(m, spec, "cuda", 10)
    for dst, src in zip(static, (x2, w2, ids2), strict=True):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(out, prepared.apply(x2, w2, ids2))


class _Block(torch.nn.Module):
    """Router and experts, as a model's MoE block calls them; returns the routing too. No
    residual add: a bf16 sum that nearly cancels turns the last-bit differences that compiled
    routing weights may bring (inductor's fp32 maths: 6e-8 seen on an H200) into large
    relative ones (with one, this test failed once on an H200)."""

    def __init__(self, spec):
        super().__init__()
        torch.manual_seed(0)
        self.gate = torch.nn.Linear(spec.hidden_size, spec.num_experts, bias=False, device="cuda", dtype=spec.dtype)
        self.experts = mo.PreparedExperts(spec, random_weights(spec, "cuda", 0), mo.get_backend("triton"))
        self.experts.prepare()
        self.top_k = spec.top_k

    def forward(self, x):
        weights, ids = grouped_topk(self.gate(x), self.top_k, num_groups=4, topk_groups=2)
        return ids, weights, self.experts.apply(x, weights, ids)


@needs_cuda
def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    block = _Block(mo.MoESpec(16, 256, 128, 4))
    x = random_input(33, mo.MoESpec(16, 256, 128, 4), "cuda", 1)
    with torch.inference_mode():
        ids, weights, out = torch.compile(block, fullgraph=True)(x)
        eager_ids, eager_weights, eager_out = block(x)
    assert torch.equal(ids, eager_ids)
    torch.testing.assert_close(weights, eager_weights)
    torch.testing.assert_close(out, eager_out)


@needs_cuda
def test_custom_op_passes_opcheck():
    spec = mo.MoESpec(8, 256, 128, 2)
    t = random_weights(spec, "cuda", 0)
    w, ids = random_routing(20, spec, "cuda", 1)
    args = (random_input(20, spec, "cuda", 2), t["w13"], t["w2"], w, ids, None, None, None, "silu", [], False, "")
    torch.library.opcheck(torch.ops.moe_overlay.triton_experts.default, args)


@needs_cuda
def test_selected_automatically_and_described_with_its_tuning_state():
    platform = mo.Platform.of("cuda")
    spec = MODELS[3].spec
    selection = mo.select_backend(spec, platform)
    if platform.vendor == "nvidia":
        assert selection.backend.name == "triton"
    prepared = mo.PreparedExperts(spec, empty_weights(spec, "cuda"), mo.select_backend(spec, platform, "triton"))
    described = prepared.describe()
    assert described["backend"] == "triton"
    assert described["tuned"] == is_tuned(current_table(), table_devices(torch.device(DEVICE), _target()),
                                          LayerShape.of(spec))
    assert mo.get_backend("triton").is_tuned(mo.MoESpec(8, 320, 96, 2), platform) is False
