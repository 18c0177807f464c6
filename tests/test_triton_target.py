"""Target mode and the launch plan without a GPU: what each target can do is decided in one
place (triton_moe/target.py), and an NVIDIA GPU standing in for gfx942 or gfx950 gets exactly
what that target runs: its mxfp4 layout, its launch-table entries fitted to its LDS, and none
of NVIDIA's kernels or launch features."""

import json
from dataclasses import replace

import pytest
import torch

import moe_overlay as mo
from moe_overlay.backends.problems import model, with_weights
from moe_overlay.backends.triton_moe import configs, target
from moe_overlay.backends.triton_moe.target import AMD_TARGETS, MX_LAYOUT_ENV, TARGET_ENV, nvidia_target

H100 = mo.Platform("cuda", "nvidia", "sm_90")
KIMI = model("Kimi-K3").spec


@pytest.fixture(autouse=True)
def _no_target_mode(monkeypatch):
    monkeypatch.delenv(TARGET_ENV, raising=False)
    monkeypatch.delenv(MX_LAYOUT_ENV, raising=False)
    monkeypatch.delenv(target.UNIT_ENV, raising=False)


def test_an_nvidia_gpu_stands_in_for_an_amd_target_with_its_limits_and_none_of_nvidias_features(monkeypatch):
    hopper = nvidia_target(90)
    assert hopper.hopper and hopper.mx_words and not hopper.stands_in
    assert target.stand_in(hopper, "NVIDIA H200") == hopper  # not asked: the GPU as itself
    monkeypatch.setenv(TARGET_ENV, "gfx942")
    gfx942 = target.stand_in(hopper, "NVIDIA H200")
    assert gfx942 == replace(AMD_TARGETS["gfx942"], stands_in="NVIDIA H200")
    assert (gfx942.shared_bytes, gfx942.warp_size, gfx942.hopper) == (64 * 1024, 64, False)
    assert "stood in for by NVIDIA H200" in gfx942.describe() and "no NVIDIA-only kernels" in gfx942.describe()
    monkeypatch.setenv(TARGET_ENV, "gfx950")
    assert target.stand_in(hopper, "NVIDIA H200").shared_bytes == 160 * 1024
    # an AMD GPU runs as itself: its own architecture is no stand-in, another one is refused
    assert target.stand_in(AMD_TARGETS["gfx950"], "gfx950") == AMD_TARGETS["gfx950"]
    with pytest.raises(ValueError, match=f"{TARGET_ENV}=gfx950 cannot run on gfx942"):
        target.stand_in(AMD_TARGETS["gfx942"], "gfx942")
    monkeypatch.setenv(TARGET_ENV, "mi300x")
    with pytest.raises(ValueError, match=f"{TARGET_ENV}='mi300x' is not a target; use one of gfx942, gfx950"):
        target.stand_in(hopper, "NVIDIA H200")


def test_the_mxfp4_layout_can_be_asked_for_to_measure_the_other_one(monkeypatch):
    """A layout not the target's own reads and writes launch entries of its own for mxfp4
    shapes (`...-mxfp4-units`), never the own layout's; other formats' entries are shared."""
    mxfp4 = configs.LayerShape.of(with_weights(KIMI, "mxfp4"))
    bf16 = configs.LayerShape.of(with_weights(KIMI, "bf16"))
    monkeypatch.setenv(MX_LAYOUT_ENV, "words")
    words = target.stand_in(AMD_TARGETS["gfx950"], "gfx950")
    assert words.mx_words and mxfp4.entries_of(words).key == "E896-H3584-I384-k16-mxfp4-words"
    own = target.stand_in(nvidia_target(90), "NVIDIA H200")  # NVIDIA's own layout
    assert own.mx_words and not own.mx_entries and mxfp4.entries_of(own) == mxfp4
    monkeypatch.setenv(MX_LAYOUT_ENV, "bytes")
    assert not target.stand_in(nvidia_target(90), "NVIDIA H200").mx_words
    monkeypatch.setenv(MX_LAYOUT_ENV, "units")
    units = target.stand_in(replace(AMD_TARGETS["gfx942"], stands_in="NVIDIA H200"), "NVIDIA H200")
    assert units.mx_units and not units.mx_words and "mxfp4 as units" in units.describe()
    assert "its own launch entries (units)" in units.describe()
    assert mxfp4.entries_of(units).key.endswith("-mxfp4-units") and bf16.entries_of(units) == bf16
    table = {"gfx942": {mxfp4.key: {"16": _entry(64, 2)}}}  # the bytes' entry: not units'
    assert not configs.is_tuned(table, ("gfx942",), mxfp4.entries_of(units))
    assert configs.lookup({"gfx942": {mxfp4.entries_of(units).key: {"16": _entry(32, 2)}}}, ("gfx942",),
                          mxfp4.entries_of(units), 16) == (configs.LaunchConfig.from_json(_entry(32, 2)), True)
    assert target.platform_target("cpu", "", "").mx_units  # the interpreter's too
    monkeypatch.setenv(MX_LAYOUT_ENV, "nibbles")
    with pytest.raises(ValueError, match=f"{MX_LAYOUT_ENV}='nibbles' is not an mxfp4 layout"):
        target.stand_in(nvidia_target(90), "NVIDIA H200")


def test_the_layout_follows_the_target_not_the_vendor(monkeypatch):
    triton_backend = mo.get_backend("triton")
    spec = with_weights(KIMI, "mxfp4")
    words = mo.Layout("triton", mx_words=True)
    expected = {name: words if t.mx_words else mo.CANONICAL for name, t in AMD_TARGETS.items()}
    assert triton_backend.layout_for(spec, H100) == words
    for arch in AMD_TARGETS:
        assert triton_backend.layout_for(spec, mo.Platform("cuda", "amd", arch)) == expected[arch]
    for arch in AMD_TARGETS:
        monkeypatch.setenv(TARGET_ENV, arch)  # the H100 standing in for it takes its layout
        assert triton_backend.layout_for(spec, H100) == expected[arch]
    monkeypatch.delenv(TARGET_ENV)
    monkeypatch.setenv(MX_LAYOUT_ENV, "words")
    assert triton_backend.layout_for(spec, mo.Platform("cuda", "amd", "gfx950")) == words
    monkeypatch.setenv(MX_LAYOUT_ENV, "units")  # the gate/up's weights where H is whole 64-K chunks, and the
    gfx942 = mo.Platform("cuda", "amd", "gfx942")  # down's where I is and SiTU bounds its fp16 input
    assert spec.activation.kind == "situ"
    assert triton_backend.layout_for(spec, gfx942) == mo.Layout("triton", mx_units=("w13", "w2"))
    assert triton_backend.layout_for(replace(spec, activation=mo.Activation("silu")), gfx942) == mo.Layout(
        "triton", mx_units=("w13",))
    assert triton_backend.layout_for(replace(spec, intermediate_size=352), gfx942) == mo.Layout(
        "triton", mx_units=("w13",))
    assert triton_backend.layout_for(replace(spec, hidden_size=3616), gfx942) == mo.CANONICAL


def test_target_mode_reads_the_targets_entries_only_fitted_to_its_lds():
    gpu, shape = torch.device("cuda", 0), configs.LayerShape.of(with_weights(KIMI, "bf16"))
    stand_in = replace(AMD_TARGETS["gfx942"], stands_in="NVIDIA H200")
    assert configs.table_devices(gpu, stand_in) == ("gfx942",)  # never the H200's own entries
    assert configs.shared_limit(gpu, stand_in) == 64 * 1024
    assert configs.table_devices(torch.device("cpu"), AMD_TARGETS["gfx950"]) == ("cpu", "gfx950")
    assert configs.shared_limit(torch.device("cpu"), AMD_TARGETS["gfx950"]) == 160 * 1024  # compiled for it here
    table = {"NVIDIA H200": {shape.key: {"1024": _entry(128, 6)}}, "gfx942": {shape.key: {"1024": _entry(64, 2)}}}
    assert configs.lookup(table, ("NVIDIA H200", "gfx942"), shape, 1024)[0].block_m == 128
    config, tuned = configs.lookup(table, ("gfx942",), shape, 1024)
    assert tuned and config.block_m == 64
    # the H200-sized entry, were it read on gfx942, has its stages lowered to fit 64 KiB
    h200 = configs.LaunchConfig.from_json(_entry(128, 6))
    gfx942 = AMD_TARGETS["gfx942"]
    fitted = configs.fit_shared(h200, shape, 1024, gfx942)
    assert fitted.gate_up.num_stages < 6 and all(
        used <= 64 * 1024 for used in configs.shared_bytes(fitted, shape, False, gfx942).values())
    # gfx942 holds one stage of a pipeline in registers: two stages, one LDS buffer
    assert [gfx942.shared_stages(n) for n in (1, 2, 3)] == [1, 1, 2]
    assert [AMD_TARGETS["gfx950"].shared_stages(n) for n in (1, 2, 3)] == [1, 2, 3]


def test_the_tuner_offers_a_stand_in_only_what_its_target_runs():
    from moe_overlay.backends.triton_moe.tune import Point, candidates

    gfx942 = replace(AMD_TARGETS["gfx942"], stands_in="NVIDIA H200")
    for weights in ("bf16", "fp8-block", "mxfp4"):
        for tokens in (1, 128, 8192):
            point = Point("Kimi-K3", with_weights(KIMI, weights), tokens)
            amd = [k for c in candidates(point, gfx942) for k in c.gate_up + c.down]
            nvidia = [k for c in candidates(point, nvidia_target(90)) for k in c.gate_up + c.down]
            assert amd, (weights, tokens)
            assert not any(k.gluon or k.weight_left or k.descriptors or k.pdl for k in amd), (weights, tokens)
            assert {k.num_stages for k in amd} <= {1, 2, 3}
            assert any(k.gluon or k.weight_left or k.descriptors for k in nvidia) == (weights != "bf16")
            # mxfp4's decode a program: for the AMD targets' packed bytes, from blocks of 64 rows
            dequant = {c.block_m for c in candidates(point, gfx942) for k in c.gate_up + c.down if k.mx_dequant}
            assert dequant == ({b for b in (64, 128, 192) if tokens == 8192} if weights == "mxfp4" else set())
            assert not any(k.mx_dequant for k in nvidia)  # words
            # a whole block a down program: for blocks of three row tiles only, never the resident down
            whole = {c.block_m for c in candidates(point, gfx942) for k in c.down if k.whole_block}
            assert whole == ({192} if tokens == 8192 else set()), (weights, tokens)
            assert not any(k.whole_block and point.shape.down_kind(k) == "resident"
                           for c in candidates(point, gfx942) for k in c.down)
            gfx950 = replace(AMD_TARGETS["gfx950"], stands_in="NVIDIA H200")  # its fp4 conversions decode
            assert not any(k.mx_dequant for c in candidates(point, gfx950) for k in c.gate_up + c.down)


def test_the_plan_says_which_kernel_runs_each_step_and_runs_nvidias_only_on_hopper():
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import plan

    words = plan.Layer(configs.LayerShape(896, 3584, 384, 16, "mxfp4"), "situ", mx_words=True)
    config = configs.LaunchConfig(16, configs.KernelConfig(64, 64, 4, 3, split_k=4, gluon=True),
                                  configs.KernelConfig(128, 128, 4, 2, split_k=16, gluon=True, pdl=True))
    hopper, gfx942 = nvidia_target(90), replace(AMD_TARGETS["gfx942"], mx_words=True)
    on_amd = plan.make_plan(words, config, True, gfx942)
    assert (on_amd.gate_up.kernel, on_amd.down.kernel, on_amd.pdl) == (plan.GATE_UP, plan.DOWN_TINY, False)
    assert on_amd.describe() == ("gfx942, tiny mode (no sort): gate/up gate_up (N 64 K 64, 4 warps, 3 stages, "
                                 "K split 4, kpack 2); down tiny (N 128 K 128, 4 warps, 2 stages, 16 programs a "
                                 "token)")
    if plan.gluon_kernels is not None:
        on_hopper = plan.make_plan(words, config, True, hopper)
        assert (on_hopper.gate_up.kernel, on_hopper.down.kernel, on_hopper.pdl) == (
            plan.GLUON_MX_TINY, plan.GLUON_MX_TINY, True)
        assert on_hopper.describe().endswith("; PDL")
    block = plan.Layer(configs.LayerShape(256, 7168, 256, 8, "fp8-block"), granularity="block")
    sorted_config = configs.LaunchConfig(48, configs.KernelConfig(64, 128, 4, 3, weight_left=True),
                                         configs.KernelConfig(64, 128, 4, 3, n_split=2, resident=True,
                                                              descriptors=True))
    for t, left, desc in ((hopper, True, True), (gfx942, False, False)):
        p = plan.make_plan(block, sorted_config, False, t)
        assert p.gate_up.kernel == plan.GATE_UP and p.gate_up.quantise_first and p.gate_up.weight_left == left
        assert p.down.kernel == plan.RESIDENT and p.down.descriptors == desc


def test_gfx942s_dots_ask_triton_for_kpack_2_and_16x16_mfmas_only_where_it_compiles_for_gfx942(tmp_path):
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import plan

    layer = plan.Layer(configs.LayerShape(896, 3584, 384, 16, "bf16"), "situ")
    entry = configs.KernelConfig(64, 64, 4, 2)
    gfx942 = AMD_TARGETS["gfx942"]
    steps = plan.make_plan(layer, configs.LaunchConfig(64, entry, entry), False, gfx942)
    assert (steps.gate_up.kpack, steps.down.kpack) == (2, 2) and "kpack 2" in steps.describe()
    assert gfx942.compile_options(steps.gate_up.kpack) == {"kpack": 2, "matrix_instr_nonkdim": 16}
    asks_one = configs.LaunchConfig(64, replace(entry, kpack=1), entry)
    assert plan.make_plan(layer, asks_one, False, gfx942).gate_up.kpack == 1  # the entry's word over the target's
    # a stand-in runs what gfx942 would, but its compiler has no kpack; gfx950 and NVIDIA have none either
    assert replace(gfx942, stands_in="NVIDIA H200").compile_options(2) == {}
    for other in (AMD_TARGETS["gfx950"], nvidia_target(90)):
        p = plan.make_plan(layer, configs.LaunchConfig(64, replace(entry, kpack=2), entry), False, other)
        options = {"matrix_instr_nonkdim": 16} if other.vendor == "amd" else {}  # 16x16 MFMAs on both AMD targets
        assert (p.gate_up.kpack, other.compile_options(p.gate_up.kpack)) == (1, options)
    # mxfp4's decode a program, where the entry asks, for packed bytes only (words decode their own way)
    mx = configs.LaunchConfig(64, replace(entry, mx_dequant=True), replace(entry, mx_dequant=True, n_split=2))
    packed = plan.make_plan(plan.Layer(configs.LayerShape(896, 3584, 384, 16, "mxfp4"), "situ"), mx, False, gfx942)
    assert (packed.gate_up.mx_dequant, packed.down.kernel, packed.down.mx_dequant) == (True, plan.STREAMED, True)
    assert "weights decoded to bf16 a program" in packed.describe()
    words = plan.Layer(configs.LayerShape(896, 3584, 384, 16, "mxfp4"), "situ", mx_words=True)
    assert not plan.make_plan(words, mx, False, gfx942).gate_up.mx_dequant
    assert not plan.make_plan(layer, mx, False, gfx942).gate_up.mx_dequant  # bf16: nothing to decode
    # a whole block of three row tiles a down program: its two tiles, as the gate/up takes them
    whole = configs.LaunchConfig(192, entry, replace(entry, whole_block=True, n_split=2))
    steps = plan.make_plan(plan.Layer(configs.LayerShape(896, 3584, 384, 16, "mxfp4"), "situ"), whole, False, gfx942)
    assert (steps.down.kernel, steps.down.config.whole_block, steps.down.tile_m2) == (plan.STREAMED, True, 64)
    assert "a whole block a program" in steps.describe()
    assert plan.make_plan(layer, configs.LaunchConfig(192, entry, entry), False, gfx942).down.tile_m2 == 0
    with pytest.raises(ValueError, match="whole_block is for the tiled and streamed down, not the resident one"):
        plan.make_plan(layer, configs.LaunchConfig(192, entry, replace(entry, whole_block=True, n_split=2)),
                       False, gfx942)
    with pytest.raises(ValueError, match=r"kpack must be 1 or 2 \(0: the target's\); got 4"):
        replace(entry, kpack=4)
    bad = tmp_path / "table.json"
    kernel = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 2, "kpack": 3}
    bad.write_text(json.dumps({"devices": {"gfx942": {"E8-H4096-I1792-k2-bf16": {
        "16": {"block_m": 16, "gate_up": kernel, "down": kernel}}}}}))
    with pytest.raises(ValueError, match="entry gfx942 / E8-H4096-I1792-k2-bf16 / 16 is not valid: kpack"):
        configs.read_file(bad)


def test_on_an_amd_target_a_dots_waves_are_no_more_than_its_mfma_tiles():
    """Triton's AMD backend gives each wave a 16x16 MFMA tile at least, so the plan lowers a dot
    GEMM's warps to its tiles there (the target's or its stand-in's), and leaves NVIDIA's and
    the matrix-vector kernels' as the entry has them."""
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import plan

    narrow = configs.KernelConfig(16, 256, 4, 2, split_k=2)
    wide = configs.KernelConfig(64, 128, 8, 2)
    gfx942 = AMD_TARGETS["gfx942"]
    mx = plan.Layer(configs.LayerShape(896, 3584, 384, 16, "mxfp4"), "situ")
    bf16 = plan.Layer(configs.LayerShape(8, 4096, 1792, 2, "bf16"), "silu")  # gate and up interleaved: N twice
    tiny = plan.make_plan(mx, configs.LaunchConfig(16, narrow, narrow), True, gfx942)
    assert (tiny.gate_up.kernel, tiny.gate_up.config.num_warps) == (plan.GATE_UP, 1)  # 16 x 16: one tile
    assert tiny.down.config.num_warps == 4  # tiny mode's down has no dot
    assert plan.make_plan(bf16, configs.LaunchConfig(16, narrow, narrow), True, gfx942).gate_up.config.num_warps == 2
    # 48 rows: tiles of 32 and 16 rows sharing the warps; 64 columns: 4 tiles of the smaller
    three = plan.make_plan(mx, configs.LaunchConfig(48, wide, wide), False, gfx942)
    assert (three.gate_up.config.num_warps, three.down.config.num_warps) == (4, 4)
    assert plan.make_plan(mx, configs.LaunchConfig(64, wide, wide), False, gfx942).gate_up.config.num_warps == 8
    standing_in = replace(gfx942, stands_in="NVIDIA H200")
    assert plan.make_plan(mx, configs.LaunchConfig(16, narrow, narrow), True, standing_in).gate_up.config == \
        tiny.gate_up.config
    for kept in (nvidia_target(90), target.INTERPRETER):
        assert plan.make_plan(mx, configs.LaunchConfig(16, narrow, narrow), True, kept).gate_up.config == narrow
    gemv = replace(narrow, gemv=True, block_n=8)
    assert plan.make_plan(mx, configs.LaunchConfig(16, gemv, narrow), True, gfx942).gate_up.config == gemv


def test_the_tuner_times_on_an_amd_target_only_what_the_plan_runs_each_once():
    """Every candidate the tuner offers gfx942 is a launch the plan runs as it is (its warps no
    more than its dots' MFMA tiles), none twice, the narrow one-token tiles among them on fewer
    warps; on Hopper the 4-warp one-token tiles of 16 columns stay."""
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import plan
    from moe_overlay.backends.triton_moe.tune import Point, candidates

    gfx942 = AMD_TARGETS["gfx942"]
    for weights, tokens in (("mxfp4", 1), ("mxfp4", 1024), ("bf16", 1), ("bf16", 8192)):
        spec = with_weights(KIMI, weights)
        point = Point(f"Kimi-K3 {weights}", spec, tokens)
        layer = plan.Layer(point.shape, "situ")
        tiny = configs.is_tiny(tokens, spec.top_k)
        for c in candidates(point, gfx942):
            assert len(set(c.gate_up)) == len(c.gate_up) and len(set(c.down)) == len(c.down)
            for g in c.gate_up:
                launch = configs.LaunchConfig(c.block_m, g, c.down[0])
                assert plan.make_plan(layer, launch, tiny, gfx942).gate_up.config == g, (weights, tokens, g)
            for d in c.down:
                launch = configs.LaunchConfig(c.block_m, c.gate_up[0], d)
                assert plan.make_plan(layer, launch, tiny, gfx942).down.config == d, (weights, tokens, d)
        narrow = [g for c in candidates(point, gfx942) for g in c.gate_up if tiny and not g.gemv and g.block_n <= 16]
        assert not tiny or {g.num_warps for g in narrow} <= {1, 2}
        hopper = [g for c in candidates(point, nvidia_target(90)) for g in c.gate_up
                  if tiny and not g.gemv and g.block_n == 16]
        assert not tiny or 4 in {g.num_warps for g in hopper}


def _entry(block_m: int, stages: int) -> dict:
    kernel = {"block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": stages, "group_m": 8}
    return {"block_m": block_m, "gate_up": kernel, "down": kernel}


def test_target_mode_can_hold_a_stand_ins_sm_to_the_programs_a_targets_compute_unit_holds(monkeypatch):
    """`--unit-programs`: each kernel's preferred shared-memory carveout lets an SM hold as
    many of its programs as the target's CU would hold by LDS (its 64 KiB on gfx942, the most a
    program may take) and wave slots, asked once a loaded kernel; not outside target mode."""
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import standin

    gfx942, gfx950 = AMD_TARGETS["gfx942"], AMD_TARGETS["gfx950"]
    assert [gfx942.programs_a_unit(lds, 4) for lds in (40960, 32768, 12288, 0)] == [1, 2, 5, 8]
    assert (gfx942.programs_a_unit(0, 8), gfx942.programs_a_unit(0, 1), gfx950.programs_a_unit(57344, 4)) == (4, 32, 2)
    assert gfx942.programs_a_unit(80 * 1024, 4) == 0  # over the CU's LDS: none fits
    # one program of 80 KiB on the stand-in with the driver's 1 KiB: 81 KiB of an H100's 228, rounded up
    assert standin.carveout_percent(1, 80 * 1024, 1024, 228 * 1024) == 36
    assert standin.carveout_percent(8, 0, 1024, 228 * 1024) == 4
    assert standin.carveout_percent(5, 64 * 1024, 1024, 228 * 1024) == 100
    # asked for by the environment (the bench's and the tuner's --unit-programs), in target mode only
    monkeypatch.setenv(target.UNIT_ENV, "1")
    with pytest.raises(ValueError, match=f"{target.UNIT_ENV}=1 is for target mode: set {TARGET_ENV} too"):
        target.stand_in(nvidia_target(90), "NVIDIA H200")
    monkeypatch.setenv(TARGET_ENV, "gfx942")
    held = target.stand_in(nvidia_target(90), "NVIDIA H200")
    assert held.unit_programs and "an SM holding the programs a compute unit would" in held.describe()
    monkeypatch.setenv(target.UNIT_ENV, "yes")
    with pytest.raises(ValueError, match=f"{target.UNIT_ENV}='yes': use 1"):
        target.stand_in(nvidia_target(90), "NVIDIA H200")
    # a launched kernel is held once: its carveout asked of the driver for the programs gfx942 holds
    asked = []

    class Driver:
        def cuFuncSetAttribute(self, function, attribute, value):
            asked.append((function.value, attribute, value))
            return 0

    class Loaded:
        function = 0x1234
        metadata = type("Metadata", (), {"num_warps": 4, "shared": 80 * 1024})

    monkeypatch.setattr(standin, "_cuda", Driver)
    monkeypatch.setattr(standin, "_sm_shared", lambda index: (228 * 1024, 1024))
    monkeypatch.setattr(standin, "_device_index", lambda: 0)
    monkeypatch.setattr(standin, "_held", {})
    monkeypatch.setattr(standin, "current_target", lambda: held)
    lds = []  # the kernel's LDS on the target: compiled for it (tests/test_amd_report.py), 40 KiB here
    monkeypatch.setattr(standin, "target_lds", lambda compiled, options, on: lds.append((options, on)) or 40960)
    standin.hold(Loaded(), {"kpack": 2})
    standin.hold(Loaded(), {"kpack": 2})
    standin.hold(None, {})  # the CPU interpreter's launch returns no kernel
    assert asked == [(0x1234, standin.CARVEOUT, 36)] and lds == [({"kpack": 2}, held)]
    monkeypatch.setattr(standin, "_held", {})
    monkeypatch.setattr(standin, "current_target", lambda: replace(held, unit_programs=False))
    standin.hold(Loaded(), {})
    assert len(asked) == len(lds) == 1  # not asked for: the stand-in's own occupancy
