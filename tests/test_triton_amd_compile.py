"""The Triton MoE kernels compiled for AMD GPUs on a machine without one.

Triton's AMD backend ships in the triton wheel, so each launch the backend makes can be built
here into AMDGCN for gfx942 (MI300X, MI325X) and gfx950 (MI355X): through the real launcher
(`launch.compile_only()`), with Triton's active driver standing in for the GPU. This shows that
the kernels compile for those targets with this Triton and which matrix instructions they use;
nothing runs, so correctness and speed on AMD hardware are not shown here.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends import backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

import moe_overlay as mo  # noqa: E402
from moe_overlay.backends.problems import random_input, random_routing, random_weights, with_weights  # noqa: E402
from moe_overlay.backends.triton_moe import kernels, launch  # noqa: E402
from moe_overlay.backends.triton_moe.amd_report import repeated_dots  # noqa: E402
from moe_overlay.backends.triton_moe.configs import LaunchConfig, fit_shared  # noqa: E402
from moe_overlay.backends.triton_moe.offline import AbsentGpu  # noqa: E402
from moe_overlay.backends.triton_moe.target import AMD_TARGETS, MX_LAYOUT_ENV, current_target  # noqa: E402
from moe_overlay.layout import to_layout  # noqa: E402

pytestmark = pytest.mark.skipif("amd" not in backends, reason="this triton has no AMD backend")

ARCHS = ("gfx942", "gfx950")
FORMATS = ("bf16", "fp8-tensor", "fp8-channel", "fp8-block", "fp8-channel-token", "mxfp4")
SPEC = mo.MoESpec(8, 512, 256, 2, mo.Activation.situ(3.0, 9.0))
# The matrix instructions of the general-mode gate/up and down kernels (sorted rows, tensor cores),
# by target and weights: fp8 on MI300's own fp8 (e4m3fnuz) or gfx950's f8f6f4 unit; mxfp4 with
# 16-bit activations on bf16 units, its e2m1 converted in registers (gfx950: by a conversion
# instruction that also applies the e8m0 scale).
MATRIX = {
    ("gfx942", "bf16"): [r"v_mfma_f32_\w+_bf16"],
    ("gfx942", "fp8"): [r"v_mfma_f32_\w+_fp8_fp8"],
    ("gfx942", "mxfp4"): [r"v_mfma_f32_\w+_bf16"],
    ("gfx950", "bf16"): [r"v_mfma_f32_\w+_bf16"],
    ("gfx950", "fp8"): [r"v_mfma_f32_\w+_f8f6f4"],
    ("gfx950", "mxfp4"): [r"v_mfma_f32_\w+_bf16", r"v_cvt_scalef32_pk_bf16_fp4"],
}
DOT_KERNELS = ("gate_up_kernel", "down_kernel", "down_resident_kernel")  # tl.dot; the rest: none
DECODED = "1024 tokens, mxfp4 decoded a program"  # kernels._mx_dequant: bf16 MFMA, no fp4 conversion instruction


def _launches(arch: str, weights: str, layer: launch.Layer, x: torch.Tensor) -> dict[str, tuple[int, LaunchConfig]]:
    """What the backend launches on an untuned AMD GPU (the default configs, as launch_config
    gives them there: fitted to the target's shared memory), and the other kernels and tilings
    the tuner can pick, fitted alike."""
    target = current_target()
    tiny, general, wide = (launch.launch_config(layer.shape, x.device, m, target) for m in (1, 64, 1024))
    # the one-token down as an H200 entry may ask for it: started by programmatic dependent launch,
    # an NVIDIA feature, which AMD launches leave out (Triton's HIP options have no launch_pdl)
    tiny = dataclasses.replace(tiny, down=dataclasses.replace(tiny.down, pdl=True))
    runs = {"one token": (1, tiny), "64 tokens": (64, general), "1024 tokens": (1024, wide),
            "64 tokens, down over N tiles": (64, dataclasses.replace(
                general, down=dataclasses.replace(general.down, n_split=2))),
            "one token, gemv gate/up": (1, dataclasses.replace(
                tiny, gate_up=dataclasses.replace(tiny.gate_up, gemv=True, block_n=8, num_stages=1)))}
    if layer.shape.fp8:  # the fp8 gemv stepping two 128-wide groups, as the H200's block-fp8 entries take it,
        # and the one-token down stepping two (all of this I; the H200's Maverick entries step four)
        runs["one token, gemv gate/up, two groups a step"] = (1, dataclasses.replace(
            tiny, gate_up=dataclasses.replace(tiny.gate_up, gemv=True, block_n=8, block_k=256, num_stages=1)))
        runs["one token, down of two groups a step"] = (1, dataclasses.replace(
            tiny, down=dataclasses.replace(tiny.down, block_k=256)))
    if layer.shape.interleaved:
        runs["96 tokens, two row tiles"] = (96, dataclasses.replace(general, block_m=48))
    if weights == "mxfp4":  # the packed tiles decoded to bf16 once a program, for plain dots
        runs[DECODED] = (1024, dataclasses.replace(wide, gate_up=dataclasses.replace(wide.gate_up, mx_dequant=True),
                                                   down=dataclasses.replace(wide.down, mx_dequant=True)))
    if layer.down_units:  # blocks of three row tiles, the down streamed a whole block a program
        runs["96 tokens, three row tiles, the down a whole block"] = (96, dataclasses.replace(
            general, block_m=48, down=dataclasses.replace(general.down, n_split=2, whole_block=True)))
    if weights == "fp8-block":  # the resident down an H200 entry may ask for
        runs["64 tokens, resident down"] = (64, dataclasses.replace(
            general, down=dataclasses.replace(general.down, n_split=2, resident=True)))
    return {name: (m, fit_shared(config, layer.shape, m, target)) for name, (m, config) in runs.items()}


def _compile(arch: str, device: int, weights: str) -> dict[str, dict[str, tuple[str, int, int]]]:
    """Every launch of _launches compiled for `arch`: (AMDGCN, shared memory bytes, times its
    waves compute a dot's products) by kernel name and cache key, per launch."""
    spec = with_weights(SPEC, weights)
    layout = mo.get_backend("triton").layout_for(spec, mo.Platform("cuda", "amd", arch))  # e4m3fnuz on gfx942
    tensors = to_layout(random_weights(spec, "cpu", seed=0), spec, layout)
    w13, w2 = tensors["w13"], tensors["w2"]
    compiled: dict[str, dict[str, tuple[str, int, int]]] = {}
    driver.set_active(AbsentGpu(GPUTarget("hip", arch, 64), device))
    try:
        x1 = random_input(1, spec, "cpu", seed=1)
        layer = launch.Layer.of(x1, w13, w2, spec.top_k, spec.activation.kind, list(spec.activation.params),
                                spec.apply_router_weight_on_input, spec.quant.granularity,
                                spec.quant.activations == "fp8_token")
        for name, (m, config) in _launches(arch, weights, layer, x1).items():
            before = _compiled(device)
            weights_m, ids = random_routing(m, spec, "cpu", seed=2)
            with launch.compile_only():
                launch.fused_experts(layer, random_input(m, spec, "cpu", seed=3), w13, w2, tensors.get("w13_scale"),
                                     tensors.get("w2_scale"), weights_m, ids, None, config)
            compiled[name] = {k: v for k, v in _compiled(device).items() if k not in before}
    finally:
        driver.set_active(None)
    return compiled


def _compiled(device: int) -> dict[str, tuple[str, int, int]]:
    """(AMDGCN, shared memory bytes, amd_report.repeated_dots) of the kernels compiled so far
    for `device`, by kernel name and cache key."""
    out = {}
    for name in dir(kernels):
        fn = getattr(kernels, name)
        if isinstance(fn, triton.runtime.jit.JITFunction) and device in fn.device_caches:
            for key, kernel in fn.device_caches[device][0].items():
                out[f"{name} {key}"] = (kernel.asm["amdgcn"], kernel.metadata.shared,
                                        repeated_dots(kernel.asm["ttgir"]))
    return out


@pytest.mark.parametrize("weights", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_launch_compiles_for_amd_with_its_matrix_instructions(arch, weights):
    """Each launch compiles, every kernel it would run among them (the sort, the quantisation,
    both GEMMs in each of their forms, the top-k sum), each fits the target's LDS (64 KiB on
    gfx942: the H200-sized defaults do not, fit_shared lowers their stages), each dot kernel
    uses the matrix instructions of its target and format, and no two waves compute the same
    products (the one-token default's 16 columns: the plan gives it one wave, not 4)."""
    device = 1000 + 100 * ARCHS.index(arch) + FORMATS.index(weights)  # compiled kernels kept apart per test
    compiled = _compile(arch, device, weights)
    for launch_name, code in compiled.items():
        assert code or launch_name == "1024 tokens", f"{launch_name}: nothing new compiled"
    names = {key.split()[0] for code in compiled.values() for key in code}
    fp8, per_token = weights.startswith("fp8"), weights == "fp8-channel-token"
    assert names == {
        "align_count_kernel", "align_scatter_kernel", "gate_up_kernel", "down_kernel", "down_tiny_kernel",
        "sum_routes_kernel", *(["quantize_tokens_kernel" if per_token else "quantize_groups_kernel"] if fp8 else []),
        "gate_up_gemv_kernel",
        *(["down_resident_kernel"] if weights in ("bf16", "fp8-block") else [])}
    expected = MATRIX[(arch, weights.split("-")[0])]
    for launch_name, code in compiled.items():
        for key, (gcn, shared, repeated) in code.items():
            kernel = key.split()[0]
            assert shared <= AMD_TARGETS[arch].shared_bytes, f"{arch} {weights} {launch_name}: {kernel}: {shared} B"
            assert repeated == 1, f"{arch} {weights} {launch_name}: {kernel}'s waves compute its dots {repeated} times"
            if kernel in DOT_KERNELS:
                for pattern in MATRIX[(arch, "bf16")] if launch_name == DECODED else expected:
                    assert re.search(pattern, gcn), f"{arch} {weights}: no {pattern} in {kernel} ({launch_name})"


def test_gate_up_units_compile_for_gfx942_to_fp16_matrix_instructions_without_spills(monkeypatch):
    """MOE_OVERLAY_TRITON_MX_LAYOUT=units on gfx942: every mxfp4 launch of a SiTU layer (both
    weights as units) compiles, the activations made fp16 a row first (launch.fp16_rows:
    quantize_tokens_kernel), both GEMMs' quarter dots on fp16 MFMAs, no VGPR spilled, LDS
    within 64 KiB."""
    monkeypatch.setenv(MX_LAYOUT_ENV, "units")
    compiled = _compile("gfx942", 1900, "mxfp4")
    assert {"quantize_tokens_kernel", "gate_up_kernel", "gate_up_gemv_kernel", "down_kernel",
            "down_tiny_kernel"} <= {key.split()[0] for code in compiled.values() for key in code}
    for launch_name, code in compiled.items():
        for key, (gcn, shared, repeated) in code.items():
            kernel = key.split()[0]
            assert repeated == 1, f"{launch_name}: {kernel}'s waves compute its dots {repeated} times"
            assert shared <= AMD_TARGETS["gfx942"].shared_bytes, f"{launch_name}: {kernel}: {shared} B"
            spills = re.search(r"\.vgpr_spill_count:\s+(\d+)", gcn)
            assert spills and int(spills.group(1)) == 0, f"{launch_name}: {kernel} spills"
            if kernel in ("gate_up_kernel", "down_kernel"):
                assert re.search(r"v_mfma_f32_\w+_f16", gcn), f"{launch_name}: no fp16 MFMA in {kernel}"
