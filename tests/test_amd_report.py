"""`make amd-report`: every launch the AMD targets run for the shipped layers (the shipped
gfx942/gfx950 entries, or the defaults fitted to the target's LDS), compiled for gfx942 and
gfx950 with Triton's AMD backend on this machine: none spills, none needs more LDS than its
target has, and the report reads each kernel's resources from its AMDGCN."""

from dataclasses import replace

import pytest

pytest.importorskip("triton")
from triton.backends import backends

from moe_overlay.backends.problems import TOKEN_COUNTS, format_models
from moe_overlay.backends.triton_moe.amd_report import FORMATS, Resources, main_loop, repeated_dots, report
from moe_overlay.backends.triton_moe.target import AMD_TARGETS, MX_LAYOUT_ENV

pytestmark = pytest.mark.skipif("amd" not in backends, reason="this triton has no AMD backend")


def test_no_launch_an_amd_target_runs_spills_or_overflows_its_lds():
    table, problems = report(list(AMD_TARGETS), list(FORMATS), list(TOKEN_COUNTS))
    assert problems == []
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    for arch in AMD_TARGETS:
        for weights in FORMATS:
            for name in format_models(weights):
                for m in TOKEN_COUNTS:
                    kernels = {r[4] for r in rows if r[0] == f"| {arch}" and r[1] == f"{name} {weights}"
                               and r[2] == str(m)}
                    assert any(k.startswith("gate_up") for k in kernels), (arch, name, weights, m)
                    assert any(k.startswith("down") for k in kernels), (arch, name, weights, m)
    sorted_dots = [r for r in rows if r[4] in ("gate_up_kernel", "down_kernel") and r[2] != "1"]
    assert sorted_dots and all(int(r[12]) > 0 for r in sorted_dots)  # matrix instructions a K step
    # kpack reached the compiler: gfx942's 2, none on gfx950
    kpacks = {(r[0], r[1], r[2], r[4]): r[6] for r in rows if r[4] in ("gate_up_kernel", "down_kernel")}
    assert {k for (arch, *_), k in kpacks.items() if arch == "| gfx950"} == {"1"}
    assert {k for (arch, *_), k in kpacks.items() if arch == "| gfx942"} == {"2"}


def test_the_shipped_units_entries_of_gfx942_compile_there_without_spills(monkeypatch):
    """MOE_OVERLAY_TRITON_MX_LAYOUT=units reads gfx942's units entries (Kimi-K3's mxfp4 kept
    apart from the packed bytes'), one an M bucket: each compiles for gfx942 with matrix
    instructions in its GEMMs, nothing spills, LDS within 64 KiB."""
    monkeypatch.setenv(MX_LAYOUT_ENV, "units")
    table, problems = report(["gfx942"], ["mxfp4"], list(TOKEN_COUNTS))
    assert problems == []
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert {(r[2], r[3]) for r in rows} == {(str(m), "tuned") for m in TOKEN_COUNTS}
    assert all(int(r[12]) > 0 for r in rows if r[4] in ("gate_up_kernel", "down_kernel"))


GCN = """\
.LBB0_3:                                ;   in Loop: Header=BB0_4 Depth=1
\tv_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], v[0:3]
.LBB0_4:                                ; %.lr.ph
                                        ; =>This Inner Loop Header: Depth=1
\tv_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], v[0:3]
\tv_and_b32_e32 v8, 15, v9
\ts_cbranch_scc1 .LBB0_6
.LBB0_5:                                ;   in Loop: Header=BB0_4 Depth=1
\tv_cndmask_b32_e64 v10, v11, v12, s[0:1]
\tbuffer_store_dwordx2 v[10:11], v13, s[4:7], 0 offen
\ts_branch .LBB0_4
.LBB0_6:
\tv_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], v[0:3]
\tv_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], v[0:3]
    .agpr_count:     4
    .vgpr_count:     250
    .vgpr_spill_count: 3
"""


def test_resources_come_from_the_amdgcn_metadata_and_the_loops_llvm_marks():
    # the loop's blocks wherever laid out, marked on the label's line or the next; not its block that stores
    # (a tile's epilogue in a loop over several tiles' K steps)
    assert main_loop(GCN) == (2, 1)
    r = Resources.of("gate_up_kernel", GCN, 48 * 1024, 4, kpack=2)
    assert (r.kpack, r.vgprs, r.agprs, r.vgpr_spills, r.mfma_a_step, r.valu_a_step) == (2, 250, 4, 3, 2, 1)
    assert r.waves_a_simd("gfx942") == 1  # 48 KiB: one workgroup of 4 waves a CU
    assert r.waves_a_simd("gfx950") == 2  # 160 KiB: three workgroups, but 256 registers a lane: two waves
    # vgpr_count is VGPRs and AGPRs together (LLVM's TotalNumVgprs): 482 of a lane's 512 is one wave
    wide = Resources.of("gate_up_kernel", GCN.replace("250", "482").replace("4\n", "226\n"), 0, 4)
    assert (wide.vgprs, wide.agprs, wide.waves_a_simd("gfx942")) == (482, 226, 1)
    assert r.problems(AMD_TARGETS["gfx942"]) == ["3 VGPRs spilled"]
    big = Resources.of("down_kernel", GCN.replace("3\n", "0\n"), 70 * 1024, 8)
    assert big.problems(AMD_TARGETS["gfx942"]) == ["71680 bytes of LDS, over gfx942's 65536"]
    assert big.problems(AMD_TARGETS["gfx950"]) == []


TTGIR = """\
#mma = #ttg.amd_mfma<{version = 3, warpsPerCTA = [4, 1], instrShape = [32, 32, 8], isTransposed = true}>
#mma1 = #ttg.amd_mfma<{version = 3, warpsPerCTA = [1, 4], instrShape = [16, 16, 16], isTransposed = true}>
      %acc = tt.dot %a, %q, %c : tensor<32x16xf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 8}>> * \
tensor<16x64xf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 8}>> -> tensor<32x64xf32, #mma>
      %acc2 = tt.dot %a2, %q, %c2 : tensor<16x16xf16, #ttg.dot_op<{opIdx = 0, parent = #mma1, kWidth = 8}>> * \
tensor<16x64xf16, #ttg.dot_op<{opIdx = 1, parent = #mma1, kWidth = 8}>> -> tensor<16x64xf32, #mma1>
"""


def test_dots_whose_waves_compute_the_same_products_are_a_problem():
    """Four waves along M of a 32-row dot of 32x32 instructions compute each product four
    times (each decoding the same weights); along N of 64 columns of 16x16 ones, once."""
    assert repeated_dots(TTGIR) == 4
    assert repeated_dots(TTGIR.replace("[4, 1]", "[1, 2]")) == 1
    assert repeated_dots(TTGIR.replace("[4, 1]", "[1, 2]").replace("[1, 4]", "[2, 4]")) == 2
    r = Resources.of("gate_up_kernel", GCN.replace("3\n", "0\n"), 0, 4, ttgir=TTGIR)
    assert r.repeated == 4
    assert r.problems(AMD_TARGETS["gfx942"]) == ["its waves compute each product of a dot 4 times"]


def test_the_tuner_leaves_out_what_spills_on_gfx942(monkeypatch):
    """tune's AMD check, with an absent Hopper standing in for gfx942, for Kimi-K3's mxfp4
    gate/up at M=8192: 128x128 tiles on 4 warps spill registers (and overflow the LDS) when
    compiled for gfx942 and are left out of the timing, where 64x128 and 64x64 tiles fit."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from moe_overlay.backends.problems import model, with_weights
    from moe_overlay.backends.triton_moe.configs import KernelConfig
    from moe_overlay.backends.triton_moe.offline import AbsentGpu, fresh_device
    from moe_overlay.backends.triton_moe.target import TARGET_ENV
    from moe_overlay.backends.triton_moe.tune import Point, _amd_rejects

    monkeypatch.setenv(TARGET_ENV, "gfx942")
    spec = replace(with_weights(model("Kimi-K3").spec, "mxfp4"), num_experts=64)  # fewer experts: less memory
    spills = KernelConfig(block_n=128, block_k=128, num_warps=4, num_stages=2)
    fits = [KernelConfig(block_n=64, block_k=128, num_warps=8, num_stages=2),
            KernelConfig(block_n=64, block_k=64, num_warps=4, num_stages=2)]
    driver.set_active(AbsentGpu(GPUTarget("cuda", 90, 32), fresh_device()))
    try:
        rejects = _amd_rejects(Point("Kimi-K3 mxfp4", spec, 8192), 192, [("gate_up", c) for c in [spills, *fits]])
    finally:
        driver.set_active(None)
    assert rejects == [("gate_up", spills)]


@pytest.mark.parametrize("weights, block_m, gate_up, down", [
    # Kimi-K3's gfx942 entry at M=8192: the down's decoded tile changes layout through LDS (48 KiB
    # there, where its tiles sum to 24.5)
    ("mxfp4", 192, {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "mx_dequant": True},
     {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 2, "n_split": 2, "mx_dequant": True}),
    ("fp8-block", 64, {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 2},  # e4m3fnuz there
     {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 2}),
])
def test_the_hold_takes_a_stand_ins_kernel_at_the_lds_it_takes_compiled_for_the_target(monkeypatch, weights,
                                                                                     block_m, gate_up, down):
    """standin.target_lds, as `--unit-programs` reads it: a kernel the stand-in (an absent
    Hopper in gfx942 target mode) compiled, compiled again for gfx942 from its source, takes the
    LDS that the same launch compiled for gfx942 itself takes; compiling only (the tuner's
    workers), the stand-in compiles each for gfx942 too, for the hold to find in the cache."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from moe_overlay.backends.problems import model, with_weights
    from moe_overlay.backends.triton_moe import kernels, standin
    from moe_overlay.backends.triton_moe.amd_report import compiled
    from moe_overlay.backends.triton_moe.configs import KernelConfig
    from moe_overlay.backends.triton_moe.launch import compile_only
    from moe_overlay.backends.triton_moe.offline import AbsentGpu, absent_gpu, fresh_device
    from moe_overlay.backends.triton_moe.target import TARGET_ENV, UNIT_ENV
    from moe_overlay.backends.triton_moe.tune import Platform, Point, Problem

    gfx942 = AMD_TARGETS["gfx942"]
    monkeypatch.setenv(TARGET_ENV, "gfx942")
    monkeypatch.setenv(UNIT_ENV, "1")
    prepared = []
    target_lds = standin.target_lds
    monkeypatch.setattr(standin, "target_lds", lambda k, *on: prepared.append(k.metadata.name) or target_lds(k, *on))
    spec = replace(with_weights(model("Kimi-K3").spec, weights), num_experts=64)
    point = Point(f"Kimi-K3 {weights}", spec, 8192)
    configs = {"gate_up": KernelConfig(**gate_up), "down": KernelConfig(**down)}
    stand_in = fresh_device()
    driver.set_active(AbsentGpu(GPUTarget("cuda", 90, 32), stand_in))
    try:
        with compile_only():
            problem = Problem(point, 1, random=False, platform=Platform("cuda", "nvidia", "sm_90"))
            runners = dict(zip(configs, problem.runners(block_m), strict=True))
            for kind, cfg in configs.items():
                runners[kind](cfg)
    finally:
        driver.set_active(None)
    assert {"gate_up_kernel", "down_kernel"} <= set(prepared)
    amd = fresh_device()
    problem = Problem(point, 1, random=False, platform=Platform("cuda", "amd", "gfx942"))
    with absent_gpu("hip", "gfx942", amd):
        runners = dict(zip(configs, problem.runners(block_m), strict=True))
        for kind, cfg in configs.items():
            runners[kind](cfg)
    on_gfx942 = {r.kernel: r.lds for r in compiled(amd) if r.kernel.startswith(("gate_up", "down"))}
    held = {k.metadata.name: target_lds(k, gfx942.amd_options(gfx942.kpack), gfx942)
            for fn in (kernels.gate_up_kernel, kernels.down_kernel) for k in fn.device_caches[stand_in][0].values()}
    assert held == on_gfx942 and len(held) == 2
