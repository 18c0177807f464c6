"""The Triton backend without a GPU: support rules, layout, launch-config table, tuner
planning, the benchmark's floor and its torch._grouped_mm peer (the kernels: test_triton_kernels.py)."""

import argparse
import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import moe_overlay as mo
from moe_overlay.backends import problems
from moe_overlay.backends.problems import (
    MODELS,
    TOKEN_COUNTS,
    WEIGHT_FORMATS,
    bytes_per_expert,
    floor_for,
    random_input,
    random_routing,
    random_weights,
    with_weights,
)
from moe_overlay.backends.reference import reference_moe
from moe_overlay.backends.triton_moe import backend as triton_backend
from moe_overlay.backends.triton_moe import configs
from moe_overlay.backends.triton_moe.bench import grouped_mm_experts, relative_error
from moe_overlay.backends.triton_moe.target import AMD_TARGETS, INTERPRETER, MX_LAYOUTS, nvidia_target
from moe_overlay.backends.triton_moe.tune import (
    COMPILE_CHUNK,
    REG_BUDGET,
    STREAM_SPLITS,
    block_m_candidates,
    candidates,
    compile_tasks,
    gemm_candidates,
    points_from_args,
)
from moe_overlay.cli import build_parser
from moe_overlay.layout import mx_unwords, mx_words, to_canonical, to_layout
from moe_overlay.quant import dequantize_mxfp4, quantize_fp8

H100 = mo.Platform("cuda", "nvidia", "sm_90")
H200 = nvidia_target(90)  # the tuner's target on an H200: 227 KiB of shared memory a program
SPEC = mo.MoESpec(8, 256, 128, 2)
FP8_BLOCK = mo.QuantSpec("fp8", "block", (128, 128), "e4m3fn", "fp8_block")
TRITON = mo.get_backend("triton")


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


@pytest.fixture
def with_triton(monkeypatch):
    monkeypatch.setattr(triton_backend, "triton_installed", lambda: True)


def test_registered_between_aiter_and_upstream():
    assert TRITON.priority == 80
    by_priority = sorted(mo.backend_names(), key=lambda n: -mo.get_backend(n).priority)
    assert by_priority.index("aiter") < by_priority.index("triton") < by_priority.index("torch")


def test_without_triton_says_so(monkeypatch):
    monkeypatch.setattr(triton_backend, "triton_installed", lambda: False)
    assert TRITON.unsupported_reason(SPEC, H100) == "triton is not installed"


@pytest.mark.parametrize(("spec", "platform", "reason"), [
    (SPEC, mo.Platform("cpu", "cpu"), "needs a CUDA or ROCm GPU"),
    (SPEC, mo.Platform("cuda", "nvidia", "sm_75"), "needs sm_80 or newer"),
    (mo.MoESpec(8, 256, 128, 2, mo.Activation.gelu()), H100, "activation gelu is not implemented"),
    (mo.MoESpec(8, 256, 128, 2, has_bias=True), H100, "biases are not implemented"),
    (mo.MoESpec(8, 256, 128, 2, dtype=torch.float32), H100, "float32 layers are not supported"),
    (mo.MoESpec(8, 256, 128, 2, quant=mo.QuantSpec("mxfp4")), mo.Platform("cuda", "amd", "gfx90a"),
     "mxfp4 (tl.dot_scaled) needs gfx942 or gfx950"),
    (mo.MoESpec(8, 256, 128, 2, quant=mo.QuantSpec("mxfp4")), mo.Platform("cuda", "nvidia", "sm_75"), "sm_80"),
    (mo.MoESpec(8, 256, 128, 2, quant=mo.QuantSpec("fp8", "block", activations="fp8_token")), H100,
     "not 128x128 blocks"),
    (mo.MoESpec(8, 256, 128, 2, quant=mo.QuantSpec("fp8", "tensor", activations="fp8_tensor")), H100,
     "or per-token scales ('fp8_token'), not 'fp8_tensor'"),
    (mo.MoESpec(8, 256, 128, 2, quant=mo.QuantSpec("fp8", "block", (64, 64), activations="fp8_block")), H100,
     "128x128"),
    (mo.MoESpec(8, 256, 128, 2, quant=FP8_BLOCK), mo.Platform("cuda", "nvidia", "sm_80"), "sm_89 or newer"),
    (mo.MoESpec(8, 256, 128, 2, quant=mo.QuantSpec("fp8", "tensor", fp8_format="e4m3fnuz", activations="fp8_block")),
     H100, "need ROCm"),
    (mo.MoESpec(8, 256, 128, 2, quant=FP8_BLOCK), mo.Platform("cuda", "amd", "gfx90a"), "gfx942 or gfx950"),
])
def test_unsupported_layers_are_refused_with_the_reason(with_triton, spec, platform, reason):
    assert reason in TRITON.unsupported_reason(spec, platform)


@pytest.mark.parametrize(("spec", "platform"), [
    (SPEC, H100),
    (mo.MoESpec(896, 3584, 384, 16, mo.Activation.situ()), mo.Platform("cuda", "amd", "gfx942")),
    (mo.MoESpec(8, 256, 128, 1, apply_router_weight_on_input=True, expert_map=(0, -1, 1, -1, 2, 3, -1, 4)), H100),
    (mo.MoESpec(8, 256, 128, 2, dtype=torch.float16, quant=FP8_BLOCK), H100),
    (mo.MoESpec(8, 256, 128, 2, quant=FP8_BLOCK), mo.Platform("cuda", "amd", "gfx950")),
    (mo.MoESpec(8, 256, 128, 1, apply_router_weight_on_input=True,
                quant=mo.QuantSpec("fp8", "channel", activations="fp8_token")), H100),
    *[(mo.MoESpec(896, 3584, 384, 16, mo.Activation.situ(), dtype=dtype, quant=mo.QuantSpec("mxfp4")), platform)
      for dtype in (torch.bfloat16, torch.float16)
      for platform in (H100, mo.Platform("cuda", "nvidia", "sm_80"), mo.Platform("cuda", "amd", "gfx942"),
                       mo.Platform("cuda", "amd", "gfx950"))],
])
def test_supported_layers(with_triton, spec, platform):
    assert TRITON.unsupported_reason(spec, platform) is None


def test_auto_selection_prefers_triton_over_the_reference_on_a_gpu(with_triton):
    selection = mo.select_backend(SPEC, H100)
    assert selection.backend.name == "triton"


def test_layout_interleaves_bf16_gate_up_and_keeps_fp8_canonical_except_on_mi300():
    fp8 = mo.MoESpec(8, 256, 128, 2, quant=FP8_BLOCK)
    for platform in (H100, mo.Platform("cuda", "amd", "gfx942")):
        assert TRITON.layout_for(SPEC, platform) == mo.Layout("triton", gate_up="interleaved")
    w13 = torch.randn(8, 256, 256)
    interleaved = to_layout({"w13": w13, "w2": torch.randn(8, 256, 128)}, SPEC, TRITON.layout_for(SPEC, H100))
    assert torch.equal(interleaved["w13"][:, 0::2], w13[:, :128]) and torch.equal(interleaved["w13"][:, 1::2],
                                                                                    w13[:, 128:])
    assert TRITON.layout_for(fp8, H100) == mo.CANONICAL
    assert TRITON.layout_for(fp8, mo.Platform("cuda", "amd", "gfx950")) == mo.CANONICAL
    mi300 = TRITON.layout_for(fp8, mo.Platform("cuda", "amd", "gfx942"))
    assert mi300.fp8_format == "e4m3fnuz"
    w13, s13 = quantize_fp8(torch.randn(8, 256, 256), FP8_BLOCK)
    w2, s2 = quantize_fp8(torch.randn(8, 256, 128), FP8_BLOCK)
    canonical = {"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2}
    prepared = to_layout(canonical, fp8, mi300)
    assert prepared["w13"].dtype == torch.float8_e4m3fnuz
    # same values: fnuz bits read as half the e4m3fn value, scales doubled
    assert torch.equal(prepared["w13"].float() * 2, w13.float())
    back = to_canonical(prepared, fp8, mi300)
    assert torch.equal(back["w2"].view(torch.int8), w2.view(torch.int8).masked_fill(w2.view(torch.int8) == -128, 0))


MXFP4 = mo.QuantSpec("mxfp4")
KIMI_MXFP4 = mo.MoESpec(896, 3584, 384, 16, mo.Activation.situ(), quant=MXFP4)


@pytest.mark.parametrize(("spec", "platform", "words"), [
    (KIMI_MXFP4, H100, True),
    (replace(KIMI_MXFP4, dtype=torch.float16), H100, False),  # the decode makes bf16
    (KIMI_MXFP4, mo.Platform("cuda", "amd", "gfx942"), False),  # ROCm: tl.dot_scaled on packed bytes
    (KIMI_MXFP4, mo.Platform("cuda", "amd", "gfx950"), False),
    (mo.MoESpec(8, 224, 128, 2, quant=MXFP4), H100, False),  # gate/up's K (H) not whole 64-value chunks
    (mo.MoESpec(8, 256, 96, 2, quant=MXFP4), H100, False),  # down's K (I) neither
    (mo.MoESpec(8, 256, 128, 2, quant=MXFP4), H100, True),
])
def test_mxfp4_is_recoded_into_words_for_bf16_on_nvidia_only(spec, platform, words):
    assert TRITON.layout_for(spec, platform) == (mo.Layout("triton", mx_words=True) if words else mo.CANONICAL)


def _kernel_decode(words: torch.Tensor) -> torch.Tensor:
    """The kernels' decode of mx_words (_mx_word_offsets, _mx_decode) in torch, with scale 2^0:
    each word's four bf16 pairs by one turn and mask (two for pair 3), read as bf16 and times
    2^126."""
    e, n, count = words.shape
    k = count * 8
    r = torch.arange(n)[:, None]
    kw = torch.arange(count)[None, :]
    offsets = (r // 16) * (16 * count) + (kw // 8) * 128 + (r % 16) * 8 + kw % 8
    w = words.reshape(e, -1)[:, offsets].to(torch.int64) & 0xFFFFFFFF  # [E, N, K/8] in row order
    both, exp_high = 0x81C081C0, 0x01000100

    def turn(k: int) -> torch.Tensor:
        return ((w << k) | (w >> (32 - k))) & 0xFFFFFFFF

    pairs = [w & both, turn(4) & both, turn(10) & both, (turn(6) & (both - exp_high)) | (turn(14) & exp_high)]
    out = torch.empty(e, n, k // 32, 2, 2, 4, 2)  # K = 32c + 16h + 8q + 2t + p
    for j, pair in enumerate(pairs):
        for p in range(2):
            bits = ((pair >> (16 * p)) & 0xFFFF).to(torch.int16)
            value = bits.view(torch.bfloat16).float() * 2.0**126
            out[:, :, :, j // 2, j % 2, :, p] = value.view(e, n, k // 32, 4)
    return out.view(e, n, k)


def test_mx_words_hold_every_code_and_read_back_exactly():
    """Every e2m1 code in every position: the kernels' shifts and masks give the canonical
    values, mx_unwords the canonical bytes, and 16 rows' 64-K chunks lie together (512 bytes)."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 48, 128), dtype=torch.uint8, generator=gen)
    words = mx_words(packed)
    assert words.dtype == torch.int32 and words.shape == (3, 48, 32)
    ones = torch.full((3, 48, 8), 127, dtype=torch.uint8)
    assert torch.equal(_kernel_decode(words), dequantize_mxfp4(packed, ones))
    assert torch.equal(mx_unwords(words), packed)
    changed = packed.clone()
    changed[:, 1, :32] ^= 0xFF  # row 1's first 64 values: the 8 words after row 0's
    moved = (mx_words(changed) != words).reshape(3, -1).any(0).nonzero().flatten()
    assert moved.tolist() == list(range(8, 16))


def test_mx_words_round_trip_through_the_layout_and_refuse_scales_the_decode_cannot_hold():
    spec = mo.MoESpec(4, 128, 64, 2, quant=MXFP4)
    tensors = random_weights(spec, "cpu", seed=0)
    layout = mo.Layout("triton", mx_words=True)
    words = to_layout(tensors, spec, layout)
    assert words["w13"].dtype == torch.int32 and words["w13"].shape == (4, 128, 16)
    scales = tensors["w13_scale"]  # [4, 128, 4]: row 16b + 8h + i, group 2c + g -> byte 64b + 32c + 4i + 2h + g
    assert words["w13_scale"].shape == scales.shape
    for row, group in ((0, 0), (9, 1), (16 + 7, 2), (127, 3)):
        place = 64 * (row // 16) + 32 * (group // 2) + 4 * (row % 8) + 2 * (row // 8 % 2) + group % 2
        assert torch.equal(words["w13_scale"].flatten(1)[:, place], scales[:, row, group]), (row, group)
    back = to_canonical(words, spec, layout)
    assert all(torch.equal(back[name], tensors[name]) for name in tensors)
    tensors["w2_scale"][2, 5, 1] = 129  # 2^2: the bf16 multiplier 2^(s - 1) would overflow
    with pytest.raises(mo.SpecError, match=r"w2_scale holds e8m0 129 \(2\^2\).*up to 2\^1"):
        to_layout(tensors, spec, layout)
    odd = mo.MoESpec(4, 128, 96, 2, quant=MXFP4)  # down's K (I = 96) is not whole 64-value chunks
    with pytest.raises(mo.SpecError, match="w2 has 128 rows and K 96"):
        to_layout(random_weights(odd, "cpu", seed=0), odd, layout)


def test_kernel_name_and_tuned_state_off_gpu():
    assert "moe_overlay::triton_experts" in TRITON.kernel_name(SPEC)
    assert TRITON.is_tuned(SPEC, mo.Platform("cpu", "cpu")) is None


def test_fake_gives_the_output_shape_without_triton():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        out = torch.ops.moe_overlay.triton_experts(
            torch.empty(5, 256, dtype=torch.bfloat16), torch.empty(8, 256, 256, dtype=torch.bfloat16),
            torch.empty(8, 256, 128, dtype=torch.bfloat16), torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int32),
            None, None, None, "silu", [], False, "")
    assert out.shape == (5, 256) and out.dtype == torch.bfloat16


# -- launch configurations -------------------------------------------------------------------


GFX942 = AMD_TARGETS["gfx942"]
ADA = nvidia_target(89)


def _kernel(step, layer, config, tiny=False, target=H200):
    """The kernel the plan of `layer` under `config` on `target` runs for `step` (gate_up, down)."""
    from moe_overlay.backends.triton_moe import plan

    return getattr(plan.make_plan(layer, config, tiny, target), step).kernel


def _gluon_runs() -> bool:
    """Whether this Triton has Gluon's Hopper calls (the plan offers Gluon kernels only then)."""
    from moe_overlay.backends.triton_moe import plan

    return plan.gluon_kernels is not None


def _entry(block_m, block_n=64):
    kernel = {"block_n": block_n, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 1}
    return {"block_m": block_m, "gate_up": kernel, "down": kernel}


def _write(path, devices):
    path.write_text(json.dumps({"devices": devices}))
    return path


def test_shape_keys_name_everything_that_changes_the_best_launch():
    assert configs.LayerShape.of(SPEC).key == "E8-H256-I128-k2-bf16"
    ep = mo.MoESpec(8, 256, 128, 2, dtype=torch.float16, expert_map=(0, 1, -1, -1, 2, 3, -1, -1))
    assert configs.LayerShape.of(ep).key == "E4-H256-I128-k2-fp16"
    assert configs.LayerShape.of(mo.MoESpec(8, 256, 128, 2, quant=FP8_BLOCK)).key == "E8-H256-I128-k2-fp8-block"


def test_defaults_grow_blocks_with_the_routes_per_expert():
    shape = configs.LayerShape.of(mo.MoESpec(8, 4096, 1792, 2))
    assert configs.default_config(shape, 1).block_m == configs.TINY_ROUTES
    sizes = [configs.default_config(shape, m).block_m for m in (16, 64, 1024, 8192)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128


def test_user_file_adds_and_overrides_entries_and_never_wipes(tmp_path):
    shipped = _write(tmp_path / "shipped.json",
                     {"GPU": {"A": {"1": _entry(16), "128": _entry(64)}, "B": {"1": _entry(16)}}})
    user = _write(tmp_path / "user.json", {"GPU": {"A": {"128": _entry(128)}, "C": {"8": _entry(32)}},
                                           "Other GPU": {"A": {"1": _entry(32)}}})
    table = configs.load_table([shipped, user])
    assert table["GPU"]["A"]["1"] == _entry(16)  # kept
    assert table["GPU"]["A"]["128"] == _entry(128)  # overridden
    assert table["GPU"]["B"] == {"1": _entry(16)}  # untouched shape kept
    assert table["GPU"]["C"]["8"] == _entry(32) and table["Other GPU"]["A"]["1"] == _entry(32)  # added


def test_user_files_come_from_the_environment_after_the_shipped_ones(tmp_path, monkeypatch):
    shipped_dir = tmp_path / "shipped"
    shipped_dir.mkdir()
    _write(shipped_dir / "gpu.json", {"GPU": {"E8-H256-I128-k2-bf16": {"1": _entry(16), "64": _entry(32)}}})
    user = _write(tmp_path / "mine.json", {"GPU": {"E8-H256-I128-k2-bf16": {"64": _entry(64)}}})
    monkeypatch.setattr(configs, "SHIPPED_DIR", shipped_dir)
    configs._table.cache_clear()
    try:
        monkeypatch.setenv(configs.USER_FILES_ENV, str(user))
        shape = configs.LayerShape.of(SPEC)
        config, tuned = configs.lookup(configs.current_table(), ("GPU",), shape, 50)
        assert tuned and config.block_m == 64
        assert configs.lookup(configs.current_table(), ("GPU",), shape, 1)[0].block_m == 16
    finally:
        configs._table.cache_clear()


def test_fp8_launches_step_one_scale_block_and_keep_programs_per_down_row_tile(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import launch

    resident = {**_entry(64), "down": {**_entry(64)["down"], "n_split": 2}}
    shapes = [configs.LayerShape(8, 256, 128, 2, w) for w in ("bf16", "fp8-block")]
    monkeypatch.setenv(configs.USER_FILES_ENV, str(_write(tmp_path / "mine.json",
                                                           {"cpu": {s.key: {"512": resident} for s in shapes}})))
    bf16, fp8 = (launch.launch_config(s, torch.device("cpu"), 512, INTERPRETER) for s in shapes)
    assert bf16.down.n_split == 2 and bf16.down.block_k == 64
    assert bf16.down.n_split == 2 == fp8.down.n_split
    assert [s.down_kind(c.down) for s, c in zip(shapes, (bf16, fp8), strict=True)] == ["resident", "streamed"]
    assert shapes[1].down_kind(replace(fp8.down, n_split=0)) == "tiled"
    assert fp8.down.block_k == 128 == fp8.gate_up.block_k


def test_resident_flag_turns_block_fp8_downs_of_small_i_resident_and_nothing_else(tmp_path, monkeypatch):
    """`resident` picks down_resident_kernel for block fp8 with n_split and I <= 512; other
    formats drop it (bf16/fp16 are resident with n_split anyway), as does a larger I."""
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import launch

    entry = {**_entry(64), "down": {**_entry(64)["down"], "n_split": 2, "resident": True}}
    shapes = [configs.LayerShape(8, 256, i, 2, w) for w, i in (("fp8-block", 384), ("fp8-block", 640),
                                                                ("fp8-channel", 384), ("mxfp4", 384), ("bf16", 384))]
    monkeypatch.setenv(configs.USER_FILES_ENV, str(_write(tmp_path / "mine.json",
                                                           {"cpu": {s.key: {"512": entry} for s in shapes}})))
    downs = [launch.launch_config(s, torch.device("cpu"), 512, INTERPRETER).down for s in shapes]
    assert [d.resident for d in downs] == [True, False, False, False, False]
    assert [s.down_kind(d) for s, d in zip(shapes, downs, strict=True)] == [
        "resident", "streamed", "streamed", "streamed", "resident"]
    assert shapes[0].down_kind(replace(downs[0], n_split=0)) == "tiled"
    # a config that still carries the flag (one not from launch_config) runs streamed where it does not apply
    assert [s.down_kind(downs[0]) for s in shapes[1:4]] == ["streamed"] * 3
    # its shared memory: the 64-row activation block and 3 stages of 64-row weight tiles, three K steps, one byte
    assert configs.resident_bytes(64, downs[0], shapes[0], INTERPRETER) == (64 + 3 * 64) * 384
    # gfx942 keeps one stage and the activation block in registers: the larger of the activation and 2 stages
    assert configs.resident_bytes(64, downs[0], shapes[0], AMD_TARGETS["gfx942"]) == 2 * 64 * 384
    # bf16: all of I (256 + 128) at two bytes a value, whatever the entry's block_k
    assert configs.resident_bytes(128, downs[4], shapes[4], INTERPRETER) == (128 + 3 * 64) * 384 * 2
    assert configs.resident_bytes(128, downs[4], shapes[4], AMD_TARGETS["gfx950"]) == 3 * 64 * 384 * 2


def test_mxfp4_launches_keep_their_k_steps_of_whole_scale_groups_and_plain_loads(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import launch

    shape = configs.LayerShape(8, 256, 128, 2, "mxfp4")
    assert shape.key.endswith("-mxfp4") and not shape.interleaved and not shape.fp8
    spec = mo.MoESpec(8, 256, 128, 2, quant=mo.QuantSpec("mxfp4"))
    assert configs.LayerShape.of(spec) == shape
    entry = {"block_m": 48, "gate_up": {**_entry(48)["gate_up"], "block_k": 32, "descriptors": True, "gemv": True},
             "down": {**_entry(48)["down"], "block_k": 256, "n_split": 2, "descriptors": True}}
    table = {"cpu": {shape.key: {"512": entry}}}
    monkeypatch.setenv(configs.USER_FILES_ENV, str(_write(tmp_path / "mine.json", table)))
    config = launch.launch_config(shape, torch.device("cpu"), 512, INTERPRETER)
    assert config.block_m == 48  # two row tiles, as bf16 has
    assert config.gate_up.block_k == configs.MX_MIN_K and config.down.block_k == 256
    assert config.gate_up.gemv  # mxfp4 has a gemv gate/up (it runs in tiny mode)
    assert not (config.gate_up.descriptors or config.down.descriptors)
    assert config.down.n_split == 2  # the streamed down reads packed tiles as the tiled one does


def test_gemv_gate_up_is_offered_and_kept_for_tiny_points_of_every_format(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import launch

    def gate_ups(model, weights, tokens):
        args = ["tune", "--model", model, "--weights", weights, "--tokens", str(tokens)]
        return [g for c in candidates(points_from_args(_parse(args))[0], H200)
                for g in c.gate_up]

    gemv = [g for g in gate_ups("Maverick", "bf16", 1) if g.gemv]
    assert gemv and all(8 <= 2 * g.block_n * g.block_k // (32 * g.num_warps) <= 64 for g in gemv)
    assert {g.split_k for g in gemv} <= {g.split_k for g in gate_ups("Maverick", "bf16", 1) if not g.gemv}
    for model, weights in (("DeepSeek-V3", "fp8-block"), ("Maverick", "fp8-channel-token")):
        fp8 = [g for g in gate_ups(model, weights, 1) if g.gemv]  # one or two 128-wide groups a K step
        assert fp8 and {g.block_k for g in fp8} == set(configs.FP8_GEMV_STEPS)
        assert all(8 <= 2 * g.block_n * g.block_k // (32 * g.num_warps) <= 128 for g in fp8)
    mxfp4 = [g for g in gate_ups("Kimi-K3", "mxfp4", 1) if g.gemv]
    assert mxfp4 and all(g.block_k >= configs.MX_MIN_K for g in mxfp4)
    assert not any(g.gemv for g in gate_ups("Maverick", "bf16", 1024))

    tiny = {**_entry(16), "gate_up": {**_entry(16)["gate_up"], "split_k": 4, "gemv": True}}
    shapes = [configs.LayerShape(8, 256, 128, 2, w) for w in ("bf16", "fp8-block", "fp8-channel")]
    monkeypatch.setenv(configs.USER_FILES_ENV, str(_write(tmp_path / "mine.json",
                                                           {"cpu": {s.key: {"1": tiny} for s in shapes}})))
    bf16, block, channel = (launch.launch_config(s, torch.device("cpu"), 1, INTERPRETER) for s in shapes)
    assert bf16.gate_up.gemv and bf16.gate_up.split_k == 4
    for fp8 in (block, channel):  # their K step made the 128-wide group
        assert fp8.gate_up.gemv and fp8.gate_up.block_k == configs.FP8_STEP
    assert configs.LaunchConfig.from_json(bf16.to_json()) == bf16
    assert not configs.LaunchConfig.from_json(_entry(16)).gate_up.gemv  # entries from before it
    for block_k, step in [(256, 256), (512, 128)]:  # the fp8 gemv: two groups a step, not four
        entry = {**tiny, "gate_up": {**tiny["gate_up"], "block_k": block_k}}
        monkeypatch.setenv(configs.USER_FILES_ENV, str(_write(tmp_path / f"k{block_k}.json",
                                                               {"cpu": {shapes[1].key: {"1": entry}}})))
        assert launch.launch_config(shapes[1], torch.device("cpu"), 1, INTERPRETER).gate_up.block_k == step
    with pytest.raises(ValueError, match="steps one or two 128-wide groups, not 64"):
        launch._gate_up_gemv(*(torch.empty(1),) * 6, launch.Layer(shapes[2]), bf16.gate_up, torch.empty(1), False)


def test_weight_left_is_offered_and_kept_for_fp8_tiles_of_few_rows_only(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import launch

    def cands(model, weights, tokens):
        args = ["tune", "--model", model, "--weights", weights, "--tokens", str(tokens)]
        return candidates(points_from_args(_parse(args))[0], H200)

    def kernels(model, weights, tokens):
        return [(c.block_m, k) for c in cands(model, weights, tokens) for k in c.gate_up + c.down]

    for weights, tokens in (("fp8-block", 1), ("fp8-block", 1024), ("fp8-channel-token", 16)):
        model = "Maverick" if weights == "fp8-channel-token" else "DeepSeek-V3"
        left = [(m, k) for m, k in kernels(model, weights, tokens) if k.weight_left]
        # row tiles under 64 (a block of 48's down runs 16 rows a program), weight rows filling wgmma's M
        assert left and all(m <= 48 and k.num_warps >= 4 and k.block_n >= 16 * k.num_warps for m, k in left)
        plain = {replace(k, weight_left=False) for m, k in kernels(model, weights, tokens) if not k.weight_left}
        assert {replace(k, weight_left=False) for _, k in left if k.num_warps == 4} <= plain  # each timed both ways
    # a block of three row tiles (48: 32 and 16 rows) has weight-left gate/ups; blocks of 64 rows and up none
    assert any(k.weight_left for c in cands("DeepSeek-V3", "fp8-block", 1024) if c.block_m == 48 for k in c.gate_up)
    assert not any(k.weight_left for _, k in kernels("DeepSeek-V3", "fp8-block", 8192))
    assert not any(k.weight_left for _, k in kernels("DeepSeek-V3", "bf16", 1024) + kernels("Kimi-K3", "mxfp4", 1))

    entry = {"block_m": 16, "gate_up": {**_entry(16)["gate_up"], "weight_left": True},
             "down": {**_entry(16)["down"], "weight_left": True}}
    shapes = [configs.LayerShape(8, 256, 128, 2, w) for w in ("bf16", "fp8-block")]
    monkeypatch.setenv(configs.USER_FILES_ENV, str(_write(tmp_path / "mine.json",
                                                           {"cpu": {s.key: {"64": entry} for s in shapes}})))
    bf16, fp8 = (launch.launch_config(s, torch.device("cpu"), 64, INTERPRETER) for s in shapes)
    assert not (bf16.gate_up.weight_left or bf16.down.weight_left)  # no fp8 dot to turn
    assert fp8.gate_up.weight_left and fp8.down.weight_left
    assert not configs.LaunchConfig.from_json(_entry(16)).gate_up.weight_left  # entries from before it
    # the plan turns the dot where the entry asks, for fp8 tiles of under 64 rows, on Hopper (sm_90+)
    from moe_overlay.backends.triton_moe import plan

    def left(layer, cfg, rows, target=H200):  # a block of `rows` rows: one row tile
        return plan.make_plan(layer, configs.LaunchConfig(rows, cfg, cfg), False, target).gate_up.weight_left

    layer = launch.Layer(shapes[1], granularity="block")
    assert left(layer, fp8.gate_up, 32)
    assert not left(layer, fp8.gate_up, 64)
    assert not left(layer, replace(fp8.gate_up, weight_left=False), 16)
    assert not left(launch.Layer(shapes[0]), fp8.gate_up, 16)
    assert not left(layer, fp8.gate_up, 16, ADA)
    assert not left(layer, fp8.gate_up, 16, GFX942)


def test_gluon_gate_up_is_offered_and_kept_for_block_fp8_and_mxfp4_only(tmp_path, monkeypatch):
    pytest.importorskip("triton")

    from moe_overlay.backends.triton_moe import launch

    def gluon_gate_ups(model, weights, tokens):
        args = ["tune", "--model", model, "--weights", weights, "--tokens", str(tokens)]
        return [(c.block_m, g) for c in candidates(points_from_args(_parse(args))[0], H200)
                for g in c.gate_up if g.gluon]

    offered = gluon_gate_ups("DeepSeek-V3", "fp8-block", 8192)
    assert offered and all(m == configs.GLUON_BLOCK_M and g.num_warps == 4 for m, g in offered)
    assert {g.block_n for _, g in offered} == {64}
    for model, weights, tokens in (("DeepSeek-V3", "fp8-block", 1024), ("Maverick", "fp8-channel-token", 8192),
                                   ("DeepSeek-V3", "bf16", 8192), ("DeepSeek-V3", "fp8-block", 1)):
        assert not gluon_gate_ups(model, weights, tokens), (model, weights, tokens)  # no block of 64 / format / tiny
    for tokens in (16, 1024, 8192):  # mxfp4: blocks of 16 to 64 rows (the wgmma's N), N tiles of whole wgmmas
        offered = gluon_gate_ups("Kimi-K3", "mxfp4", tokens)
        assert offered and {m for m, _ in offered} <= set(configs.GLUON_MX_BLOCK_MS)
        assert {(g.block_n, g.block_k, g.num_warps) for _, g in offered} == {(64, 64, 4), (128, 64, 4)}
    # mxfp4 tiny mode: K splits that share Kimi-K3's 56 (or 28) K steps evenly, and no others
    offered = gluon_gate_ups("Kimi-K3", "mxfp4", 1)
    assert {m for m, _ in offered} == {configs.TINY_ROUTES}
    assert {(g.block_k, g.split_k) for _, g in offered} == {(64, s) for s in (1, 2, 4, 7, 8, 14)} | {
        (128, s) for s in (1, 2, 4, 7, 14)}
    assert {(g.block_n, g.num_warps) for _, g in offered} == {(64, 4), (128, 4)}

    entry = {"block_m": 64, "gate_up": {**_entry(64)["gate_up"], "block_k": 128, "gluon": True},
             "down": _entry(64)["down"]}
    shapes = [configs.LayerShape(8, 512, 256, 2, w) for w in ("bf16", "fp8-channel", "fp8-block", "mxfp4")]
    monkeypatch.setenv(configs.USER_FILES_ENV, str(_write(tmp_path / "mine.json",
                                                           {"cpu": {s.key: {"512": entry} for s in shapes}})))
    bf16, channel, block, mx = (launch.launch_config(s, torch.device("cpu"), 512, INTERPRETER) for s in shapes)
    assert not bf16.gate_up.gluon and not channel.gate_up.gluon and block.gate_up.gluon and mx.gate_up.gluon

    def uses(layer, config, tiny=False, target=H200):
        return _kernel("gate_up", layer, config, tiny, target).startswith("gluon")

    layer = launch.Layer(shapes[2], granularity="block")
    compiled = _gluon_runs()
    assert uses(layer, block) == compiled
    assert uses(layer, replace(block, gate_up=replace(block.gate_up, block_n=32))) == compiled
    assert not uses(layer, replace(block, gate_up=replace(block.gate_up, block_n=256)))  # two scale blocks
    assert not uses(layer, block, tiny=True)
    assert not uses(layer, replace(block, gate_up=replace(block.gate_up, block_k=64)))  # not quantised first
    assert not uses(layer, replace(block, gate_up=replace(block.gate_up, gluon=False)))
    assert not uses(layer, replace(block, block_m=32))
    assert not uses(layer, replace(block, gate_up=replace(block.gate_up, num_warps=8)))
    assert not uses(layer, replace(block, gate_up=replace(block.gate_up, num_stages=1)))  # a pass needs two slots
    assert not uses(launch.Layer(configs.LayerShape(8, 384, 256, 2, "fp8-block"), granularity="block"), block)  # K
    assert not uses(launch.Layer(shapes[1], granularity="channel"), block)
    assert not uses(layer, block, target=ADA)
    assert not uses(layer, block, target=GFX942)

    # mx_words (int32 weights: NVIDIA's mxfp4 layout), the entry's block_k of 128 kept
    words = launch.Layer(shapes[3], mx_words=True)
    assert uses(words, mx) == compiled
    for block_m in configs.GLUON_MX_BLOCK_MS:
        assert uses(words, replace(mx, block_m=block_m)) == compiled
    assert uses(words, replace(mx, gate_up=replace(mx.gate_up, block_n=128, block_k=64))) == compiled
    assert not uses(launch.Layer(shapes[3]), mx)  # packed bytes (ROCm's): the `tl` kernel's tl.dot_scaled
    assert not uses(words, replace(mx, block_m=128))  # N of 128 tokens: not offered
    assert not uses(words, replace(mx, block_m=48))  # three row tiles
    assert not uses(words, replace(mx, gate_up=replace(mx.gate_up, block_n=32)))  # half a wgmma
    assert not uses(words, replace(mx, gate_up=replace(mx.gate_up, block_n=192)))  # I of 256 in tiles of 192
    assert not uses(words, replace(mx, gate_up=replace(mx.gate_up, block_k=256)))
    assert not uses(launch.Layer(configs.LayerShape(8, 576, 256, 2, "mxfp4"), mx_words=True), mx)  # H of 4.5 steps
    assert not uses(words, replace(mx, gate_up=replace(mx.gate_up, num_stages=1)))
    assert not uses(words, replace(mx, gate_up=replace(mx.gate_up, num_warps=8)))
    # tiny mode: when the K split shares the K steps (512 / 128: 4) evenly, and not as a gemv
    for split in (1, 2, 4):
        assert uses(words, replace(mx, gate_up=replace(mx.gate_up, split_k=split)), tiny=True) == compiled
    assert not uses(words, replace(mx, gate_up=replace(mx.gate_up, split_k=3)), tiny=True)
    assert not uses(words, replace(mx, gate_up=replace(mx.gate_up, split_k=8)), tiny=True)
    assert not uses(words, replace(mx, gate_up=replace(mx.gate_up, gemv=True)), tiny=True)
    assert not uses(words, mx, target=ADA)
    assert not uses(words, mx, target=replace(GFX942, mx_words=True))


def test_gluon_tiny_down_is_kept_for_mx_words_in_whole_tiles_and_few_routes_a_program():
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import launch

    down = configs.KernelConfig(128, 64, 4, 2, split_k=2, gluon=True)
    config = configs.LaunchConfig(configs.TINY_ROUTES, configs.KernelConfig(64, 64, 4, 3, split_k=2), down)
    words = launch.Layer(configs.LayerShape(8, 512, 256, 16, "mxfp4"), mx_words=True)  # top-16: 8 routes a share

    def uses(layer, target=H200, **changes):
        return _kernel("down", layer, replace(config, down=replace(down, **changes)), True, target) != "tiny"

    compiled = _gluon_runs()
    assert uses(words) == compiled
    assert uses(words, block_n=256, block_k=128, num_stages=4, split_k=16) == compiled
    assert not uses(words, split_k=1)  # 16 routes a program: more than the wgmma's 8 columns
    assert not uses(launch.Layer(words.shape))  # packed bytes (ROCm's)
    assert not uses(words, gluon=False)
    assert not uses(words, block_n=64)  # halves of half a wgmma
    assert not uses(words, block_n=384)  # H of 512 in tiles of 384
    assert not uses(words, block_k=256)
    assert not uses(words, num_stages=1)
    assert not uses(words, num_warps=8)
    odd_i = launch.Layer(configs.LayerShape(8, 512, 320, 16, "mxfp4"), mx_words=True)
    assert uses(odd_i) == compiled  # I of 5 K steps of 64
    assert not uses(odd_i, block_k=128)  # 2.5 steps of 128
    one_step = launch.Layer(configs.LayerShape(8, 512, 128, 16, "mxfp4"), mx_words=True)
    assert uses(one_step) == compiled  # I of 2 K steps of 64
    assert not uses(one_step, block_k=128)  # one K step a route: Triton 3.6 fails to lower it
    assert not uses(words, ADA)


def test_gluon_down_is_offered_and_kept_for_streamed_mx_words_only():
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import launch

    def gluon_downs(model, weights, tokens):
        args = ["tune", "--model", model, "--weights", weights, "--tokens", str(tokens)]
        return [(c.block_m, d) for c in candidates(points_from_args(_parse(args))[0], H200)
                for d in c.down if d.gluon]

    for tokens in (16, 1024, 8192):  # streamed, blocks of 16 to 64 rows, N tiles of two halves of whole wgmmas
        offered = gluon_downs("Kimi-K3", "mxfp4", tokens)
        assert offered and {m for m, _ in offered} <= set(configs.GLUON_MX_BLOCK_MS)
        assert {(d.block_n, d.block_k, d.num_warps) for _, d in offered} == {(128, 64, 4), (256, 64, 4)}
        assert all(d.n_split >= 1 for _, d in offered)
    assert not gluon_downs("DeepSeek-V3", "fp8-block", 8192)  # format
    # tiny mode: the one-token Gluon down, each program 8 routes at most (Kimi-K3's 16 over 2 to 16)
    offered = gluon_downs("Kimi-K3", "mxfp4", 1)
    assert offered and {m for m, _ in offered} == {configs.TINY_ROUTES}
    assert {(d.block_n, d.block_k, d.split_k) for _, d in offered} == {
        (n, k, s) for n in (128, 256) for k in (64, 128) for s in (2, 4, 8, 16)}
    assert not gluon_downs("DeepSeek-V3", "fp8-block", 1)

    down = configs.KernelConfig(128, 64, 4, 3, n_split=2, gluon=True)
    config = configs.LaunchConfig(16, configs.KernelConfig(64, 64, 4, 3, gluon=True), down)
    words = launch.Layer(configs.LayerShape(8, 512, 256, 2, "mxfp4"), mx_words=True)

    def uses(layer, config, target=H200):
        return _kernel("down", layer, config, False, target).startswith("gluon")

    def with_down(**changes):
        return replace(config, down=replace(down, **changes))

    compiled = _gluon_runs()
    assert uses(words, config) == compiled
    for block_m in configs.GLUON_MX_BLOCK_MS:
        assert uses(words, replace(config, block_m=block_m)) == compiled
    assert uses(words, with_down(block_n=256, block_k=128, num_stages=2, n_split=5)) == compiled
    assert not uses(launch.Layer(words.shape), config)  # packed bytes (ROCm's)
    assert not uses(words, with_down(n_split=0))  # a program per tile: down_kernel's tiled walk
    assert not uses(words, with_down(gluon=False))
    assert not uses(words, with_down(block_n=64))  # halves of half a wgmma
    assert not uses(words, with_down(block_n=384))  # H of 512 in tiles of 384
    assert not uses(words, with_down(block_k=256))
    assert not uses(words, with_down(num_stages=1))
    assert not uses(words, with_down(num_warps=8))
    assert not uses(words, replace(config, block_m=48))  # three row tiles
    assert not uses(words, replace(config, block_m=128))
    odd_i = launch.Layer(configs.LayerShape(8, 512, 320, 2, "mxfp4"), mx_words=True)
    assert uses(odd_i, config) == compiled  # I of 5 K steps of 64
    assert not uses(odd_i, with_down(block_k=128))  # 2.5 steps of 128
    assert not uses(words, config, target=ADA)
    assert not uses(words, config, target=replace(GFX942, mx_words=True))


def test_weight_descriptors_only_for_contiguous_16_byte_aligned_weights(monkeypatch):
    tl = pytest.importorskip("triton.language")
    from moe_overlay.backends.triton_moe import launch
    from moe_overlay.backends.triton_moe.launch import weight_descriptors

    w = torch.empty(4, 64, 128, dtype=torch.bfloat16)
    assert weight_descriptors(w)
    assert not weight_descriptors(w.transpose(1, 2))  # not contiguous
    assert not weight_descriptors(torch.empty(4, 64, 100, dtype=torch.bfloat16))  # 200-byte rows
    assert weight_descriptors(torch.empty(4, 64, 16, dtype=torch.float8_e4m3fn))  # 16-byte rows
    assert not weight_descriptors(torch.empty(4 * 64 * 128 + 1, dtype=torch.bfloat16)[1:].view(4, 64, 128))
    asked = launch.Step("tiled", configs.KernelConfig(64, 64, 4, 3), descriptors=True)
    assert launch._descriptors(asked, w) and not launch._descriptors(replace(asked, descriptors=False), w)
    assert not launch._descriptors(asked, w.transpose(1, 2))  # asked for, but the weight rules them out
    monkeypatch.delattr(tl, "make_tensor_descriptor")  # a Triton from before them
    assert not weight_descriptors(w)


def test_tuner_times_one_token_layers_with_and_without_pdl_and_keeps_the_faster(monkeypatch):
    """Tiny points: the chosen pair timed as one layer, its down started by programmatic
    dependent launch and not (only where the GPU has it), the faster kept in the entry."""
    from moe_overlay.backends.triton_moe import timing, tune

    seconds = {False: 4.0, True: 3.0}
    ran = []

    class Layer:
        def run_layer(self, config):
            ran.append(config)

    def fake_seconds(fn, **_):
        fn()
        return seconds[ran[-1].down.pdl]

    monkeypatch.setattr(timing, "graph_replay_seconds", fake_seconds)
    config = configs.LaunchConfig.from_json(_entry(16))
    kinds = []
    best, s = min(tune._with_pdl(Layer(), [config], kinds, H200), key=lambda r: r[1])
    assert best.down.pdl and s == 3.0 and best.gate_up == config.gate_up
    assert [c.down.pdl for c in ran] == [False, True]
    assert kinds == [f"layer, dot gate/up: no PDL {1e6:.1f} us, PDL {0.75e6:.1f} us"]
    seconds[True] = 5.0
    assert min(tune._with_pdl(Layer(), [config], [], H200), key=lambda r: r[1])[0] == config  # slower: left off
    ran.clear()
    assert tune._with_pdl(Layer(), [config], [], GFX942) == [(config, 4.0)] and len(ran) == 1  # no PDL: timed once
    assert configs.LaunchConfig.from_json(best.to_json()) == best


_HASHES_IN_ORDER = """
import json, random, sys
from triton.runtime.jit import JITFunction
from moe_overlay.backends.triton_moe import gluon_kernels, kernels
fns = {f"{m.__name__}.{n}": v for m in (kernels, gluon_kernels) for n, v in vars(m).items()
       if isinstance(v, JITFunction)}
names = sorted(fns)
random.Random(int(sys.argv[1])).shuffle(names)
print(json.dumps({n: fns[n].cache_key for n in names}, sort_keys=True))
"""


def test_kernel_hashes_do_not_hang_on_the_order_a_process_computes_them():
    """The tuner's timing process finds in Triton's disk cache what its compile workers built
    only if every kernel hashes the same in every process, whatever it launched first
    (kernels.settle_cache_keys: Triton 3.6 did not, and the timing pass compiled everything
    again)."""
    hashes = [json.loads(subprocess.run([sys.executable, "-c", _HASHES_IN_ORDER, str(seed)], check=True,
                                        capture_output=True, text=True).stdout) for seed in (1, 2, 3)]
    assert len(hashes[0]) > 40 and any(name.endswith("gate_up_gemv_kernel") for name in hashes[0])
    assert hashes[0] == hashes[1] == hashes[2]


def test_no_kernel_specialises_on_what_the_tuners_compile_problems_shrink():
    """The tuner's compile workers build each point with COMPILE_EXPERTS experts per top-k, not
    all of them, and the routes' blocks of their own routing: kernels that took E or the block
    count as a specialised integer (Triton's divisible-by-16 and equal-to-1 cases) compiled
    differently there (Maverick's top-1: 4 experts against 128), and the timing pass compiled
    them again."""
    from triton.runtime.jit import JITFunction

    from moe_overlay.backends.triton_moe import gluon_kernels, kernels

    shrunk = {"num_experts", "num_blocks_m", "num_routes"}
    seen = set()
    for module in (kernels, gluon_kernels):
        for fn in vars(module).values():
            if isinstance(fn, JITFunction) and fn.fn.__name__.endswith("_kernel"):
                for p in fn.params:
                    if p.name in shrunk:
                        seen.add(p.name)
                        assert p.do_not_specialize, f"{fn.fn.__name__}: {p.name}"
    assert seen == shrunk


def test_tune_point_ranks_each_split_and_gate_up_kind_then_keeps_the_fastest_layer(monkeypatch, capsys):
    """A one-token point: gate/ups ranked per K split and kind (dot, gemv), each with the
    fastest down; the fastest pair of each kind is timed as a layer, with and without PDL, and
    the fastest layer is the entry, here a gemv pair that ranked second by its kernels' times.
    On the way it says how many kernels it has timed (here at every step)."""
    from moe_overlay.backends.triton_moe import launch, timing, tune

    point = points_from_args(_parse(["tune", "--model", "Kimi-K3", "--weights", "fp8-block", "--tokens", "1"]))[0]

    def dot(split):
        return configs.KernelConfig(64, 128, 4, 3, split_k=split, weight_left=True)

    def gemv(split):
        return configs.KernelConfig(16, 128, 2, 1, split_k=split, gemv=True)

    down = configs.KernelConfig(16, 128, 4, 1)
    kernel_seconds = {dot(2): 5.0, dot(4): 4.0, gemv(2): 4.5, gemv(4): 6.0, down: 3.0}
    ran = []

    class FakeProblem:
        tiny = True
        layer = launch.Layer(point.shape, "situ", granularity="block")

        def __init__(self, point, routings, random):
            pass

        def runners(self, block_m):
            return (lambda cfg: ran.append(("gate_up", cfg)), lambda cfg: ran.append(("down", cfg)))

        def run_layer(self, config):
            ran.append(("layer", config))

    def fake_seconds(fn, **_):
        fn()
        kind, cfg = ran[-1]
        if kind == "layer":
            return 7.0 if cfg.gate_up.gemv and cfg.down.pdl else 8.0
        return kernel_seconds[cfg]

    monkeypatch.setattr(tune, "Problem", FakeProblem)
    monkeypatch.setattr(tune, "PROGRESS_S", 0.0)
    monkeypatch.setattr(timing, "graph_replay_seconds", fake_seconds)
    monkeypatch.setattr(launch, "plan_for", lambda layer, config, tiny: launch.make_plan(layer, config, tiny, H200))
    config, seconds, kinds = tune.tune_point(point, [tune.Candidates(16, [dot(2), dot(4), gemv(2), gemv(4)], [down])],
                                             H200)
    assert config.gate_up == gemv(2) and config.down == replace(down, pdl=True)
    assert seconds == 7.0 / tune.ROUTINGS
    assert kinds[0].startswith("plan: sm_90, tiny mode (no sort): gate/up gemv (N 16 K 128")
    assert [k.split(":")[0] for k in kinds[1:]] == [
        "block_m 16 split_k 2", "block_m 16 split_k 2 gemv", "block_m 16 split_k 4", "block_m 16 split_k 4 gemv",
        "layer, dot gate/up", "layer, gemv gate/up"]
    assert [cfg for kind, cfg in ran if kind == "layer"] == [
        replace(configs.LaunchConfig(16, dot(4), down), down=replace(down, pdl=p)) for p in (False, True)] + [
        replace(configs.LaunchConfig(16, gemv(2), down), down=replace(down, pdl=p)) for p in (False, True)]
    said = [line.split(": ")[1].split(" [")[0] for line in capsys.readouterr().out.splitlines()]
    assert said == [f"timed {n}/5 kernels" for n in (1, 2, 3, 4, 5)]


def test_tune_point_that_nothing_ran_at_says_why(monkeypatch):
    """Every candidate failing (here at its launch): the error names the point and the
    commonest causes, counted."""
    from moe_overlay.backends.triton_moe import tune

    point = points_from_args(_parse(["tune", "--model", "Kimi-K3", "--weights", "mxfp4", "--tokens", "16"]))[0]

    def refuse(cfg):
        raise ValueError(f"line one\nblock_k {cfg.block_k} refused")

    class FailingProblem:
        tiny = True

        def __init__(self, point, routings, random):
            pass

        def runners(self, block_m):
            return refuse, refuse

    monkeypatch.setattr(tune, "Problem", FailingProblem)
    cfgs = [configs.KernelConfig(16, k, 4, 1) for k in (64, 64, 128)]
    with pytest.raises(RuntimeError, match=r"^no candidate launch configuration ran for Kimi-K3 mxfp4 M=16; "
                                           r"3 x ValueError: block_k 64 refused; 2 x ValueError: block_k 128 refused$"):
        tune.tune_point(point, [tune.Candidates(16, cfgs, [cfgs[0], cfgs[2]])], H200)


def test_tuner_tries_descriptors_on_the_leaders_and_keeps_them_only_when_faster(monkeypatch):
    from moe_overlay.backends.triton_moe import tune

    plain = [configs.KernelConfig(n, 64, 4, 3) for n in (16, 32, 64, 128, 256)]
    seconds = dict(zip(plain, (3.0, 2.0, 2.5, 4.0, 2.2), strict=True))
    for c, s in list(seconds.items()):
        seconds[replace(c, descriptors=True)] = s + 0.5
    timed = []

    def fake_timed(run, cfgs, errors):
        timed.append(list(cfgs))
        return sorted(((c, seconds[c]) for c in cfgs), key=lambda r: r[1])

    monkeypatch.setattr(tune, "_timed", fake_timed)
    assert tune._fastest(None, plain, descriptors=True, errors=[]) == (plain[1], 2.0)  # descriptors slower: kept plain
    leaders = [plain[1], plain[4], plain[2]]
    assert timed == [plain, [replace(c, descriptors=True) for c in leaders]]  # the 3 fastest tried again
    seconds[replace(plain[2], descriptors=True)] = 1.8  # third without, first with
    assert tune._fastest(None, plain, descriptors=True, errors=[]) == (replace(plain[2], descriptors=True), 1.8)
    timed.clear()
    assert tune._fastest(None, plain, descriptors=False, errors=[]) == (plain[1], 2.0)
    assert timed == [plain]
    assert tune._fastest(None, [], descriptors=True, errors=[]) is None
    entry = {**_entry(128), "down": {**_entry(128)["down"], "descriptors": True}}
    config = configs.LaunchConfig.from_json(entry)
    assert config.down.descriptors and not config.gate_up.descriptors
    assert configs.LaunchConfig.from_json(config.to_json()) == config


def test_w8a8_activations_are_quantised_before_sorted_gemms_whose_k_step_is_the_group():
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe.plan import QUANT_GROUP, Layer, quantise_first

    fp8 = Layer(configs.LayerShape(8, 256, 128, 2, "fp8-block"), granularity="block")
    assert quantise_first(fp8, QUANT_GROUP)
    assert not quantise_first(fp8, QUANT_GROUP // 2)  # a K step of half a group: quantised in the loop
    assert not quantise_first(Layer(configs.LayerShape(8, 256, 128, 2, "bf16")), QUANT_GROUP)


def test_lookup_takes_the_nearest_bucket_and_reports_untuned_shapes():
    table = {"GPU": {"E8-H256-I128-k2-bf16": {"1": _entry(16), "16": _entry(32), "1024": _entry(128)}}}
    shape = configs.LayerShape.of(SPEC)
    assert [configs.lookup(table, ("GPU",), shape, m)[0].block_m for m in (1, 3, 8, 100, 300, 9000)] == [
        16, 16, 32, 32, 128, 128]
    other = configs.LayerShape.of(mo.MoESpec(8, 512, 128, 2))
    config, tuned = configs.lookup(table, ("GPU",), other, 100)
    assert not tuned and config == configs.default_config(other, 100)
    assert configs.is_tuned(table, ("GPU",), shape) and not configs.is_tuned(table, ("Other GPU",), shape)


def test_blocks_of_three_row_tiles_are_split_and_others_refused(tmp_path):
    assert [configs.row_tiles(b) for b in (16, 64, 128, 48, 96, 192)] == [
        (16, 0), (64, 0), (128, 0), (32, 16), (64, 32), (128, 64)]
    assert [configs.down_tile(b) for b in (64, 192)] == [64, 64]
    for bad in (8, 24, 80, 100, 160):
        with pytest.raises(ValueError, match=f"block_m must be .* got {bad}"):
            configs.row_tiles(bad)
    path = _write(tmp_path / "odd.json", {"GPU": {"A": {"64": _entry(80)}}})
    with pytest.raises(ValueError, match=r"odd.json: entry GPU / A / 64 .*got 80"):
        configs.read_file(path)


def test_three_tile_blocks_are_tried_for_experts_they_hold_in_every_format(tmp_path, monkeypatch):
    kimi = configs.LayerShape.of(next(m.spec for m in MODELS if m.name == "Kimi-K3"))  # 146 routes per expert
    for weights in ("bf16", "fp8-block", "mxfp4"):
        assert block_m_candidates(replace(kimi, weights=weights), 8192) == [64, 128, 192]
    assert block_m_candidates(kimi, 16) == [16, 32]  # a route or two per expert: powers of two only
    pytest.importorskip("triton")
    from moe_overlay.backends.triton_moe import launch

    shapes = [configs.LayerShape(8, 256, 128, 2, w) for w in ("bf16", "fp8-block", "mxfp4")]
    monkeypatch.setenv(configs.USER_FILES_ENV, str(_write(tmp_path / "mine.json",
                                                           {"cpu": {s.key: {"512": _entry(192)} for s in shapes}})))
    assert [launch.launch_config(s, torch.device("cpu"), 512, INTERPRETER).block_m for s in shapes] == [192, 192, 192]


def test_bad_config_files_are_named(tmp_path):
    bad = _write(tmp_path / "bad.json", {"GPU": {"A": {"many": _entry(16)}}})
    with pytest.raises(ValueError, match=r"bad.json: entry GPU / A / many"):
        configs.read_file(bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match=r"broken.json is unreadable"):
        configs.read_file(tmp_path / "broken.json")


def _shipped_shapes() -> dict[str, configs.LayerShape]:
    """The shapes a shipped entry may be for, by key: the four models in each weight format,
    mxfp4 in each layout that keeps entries of its own too."""
    shapes = [configs.LayerShape.of(with_weights(m.spec, w)) for m in MODELS for w in WEIGHT_FORMATS]
    return {s.key: s for s in shapes + [replace(s, layout=layout) for s in shapes if s.weights == "mxfp4"
                                        for layout in MX_LAYOUTS]}


def test_shipped_config_files_load_and_cover_the_four_models():
    """An NVIDIA device's table covers the four models; an AMD architecture's table holds only
    shapes of the four models in some weight format (mxfp4 in some layout), each with every
    token bucket."""
    files = sorted(configs.SHIPPED_DIR.glob("*.json"))
    table = configs.load_table(files)
    assert files, "no shipped Triton launch configs"
    known = set(_shipped_shapes())
    for device, shapes in table.items():
        if device in AMD_TARGETS:
            assert set(shapes) <= known, f"{device}: no model has {set(shapes) - known}"
            for key, buckets in shapes.items():
                assert sorted(map(int, buckets)) == sorted(TOKEN_COUNTS), (device, key, sorted(buckets))
        else:
            keys = {configs.LayerShape.of(m.spec).key for m in MODELS}
            assert keys <= set(shapes), f"{device} lacks tuned entries for {keys - set(shapes)}"


H200_SHARED = replace(H200, shared_bytes=232448)  # shared_memory_per_block_optin of an H200 (227 KiB)


def test_shipped_h200_entries_already_fit_the_h200():
    """Tuned entries were tuned within the chip's shared memory: fitting them changes nothing."""
    for device, shapes in configs.load_table(sorted(configs.SHIPPED_DIR.glob("*.json"))).items():
        for key, buckets in shapes.items():
            shape = _shipped_shapes()[key]
            for bucket in buckets:
                config = configs._launch_config("", (device,), INTERPRETER, shape, int(bucket))
                assert configs.fit_shared(config, shape, int(bucket), H200_SHARED) == config, (device, key, bucket)


def test_launches_are_fitted_to_a_64_kib_gpu_by_fewer_stages():
    """gfx942's 64 KiB: the defaults (sized for 227 KiB) lose pipeline stages until their tiles
    fit (gfx942 keeps one stage of each in registers), down to one; nothing else changes.
    tests/test_triton_amd_compile.py and `make amd-report` compile them for gfx942 and check
    the LDS they really use."""
    lowered = 0
    for m in MODELS:
        for weights in ("bf16", "fp8-block", "mxfp4"):
            shape = configs.LayerShape.of(with_weights(m.spec, weights))
            for tokens in TOKEN_COUNTS:
                big = configs._launch_config("", ("no such device",), INTERPRETER, shape, tokens)
                small = configs._launch_config("", ("no such device",), GFX942, shape, tokens)
                assert replace(small, gate_up=replace(small.gate_up, num_stages=big.gate_up.num_stages),
                               down=replace(small.down, num_stages=big.down.num_stages)) == big
                tiny = configs.is_tiny(tokens, shape.top_k)
                for gemm, used in configs.shared_bytes(small, shape, tiny, GFX942).items():
                    cfg = getattr(small, gemm)
                    assert used <= GFX942.shared_bytes or cfg.num_stages == 1, (m.name, weights, tokens, cfg)
                lowered += small != big
    assert lowered >= 10


# -- the tuner's plan ---------------------------------------------------------------------------


def test_tune_is_a_cli_subcommand_and_plans_points():
    args = _parse(["tune", "--model", "Kimi-K3", "--shape", "16,512,256,4", "--weights", "bf16",
                   "--weights", "fp8-block", "--tokens", "1,128"])
    points = points_from_args(args)
    assert len(points) == 8
    assert {p.shape.key for p in points} >= {"E896-H3584-I384-k16-bf16", "E16-H512-I256-k4-fp8-block"}


def test_tuning_candidates_fit_the_chip_and_fp8_steps_one_scale_block():
    for point in points_from_args(_parse(["tune", "--weights", "bf16", "--weights", "fp8-block"])):
        for c in candidates(point, H200):
            assert c.gate_up and c.down
            rows = {"gate_up": c.block_m, "down": configs.down_tile(c.block_m)}
            tiny = configs.is_tiny(point.tokens, point.spec.top_k)
            for cfg, kind, tiles in [(g, "gate_up", 2) for g in c.gate_up] + [(d, "down", 1) for d in c.down]:
                assert tiles * rows[kind] * cfg.block_n // (32 * cfg.num_warps) <= REG_BUDGET or c.block_m == 16
                assert (cfg.block_k == 128 or not point.shape.fp8
                        or (cfg.gemv and cfg.block_k in configs.FP8_GEMV_STEPS)
                        or (tiny and kind == "down" and cfg.block_k in configs.FP8_TINY_DOWN_STEPS))
            if tiny and point.shape.fp8:  # whole groups, up to all of I: DeepSeek-V3's 256, Kimi-K3's 384 (512)
                widest = 1 << (point.spec.intermediate_size - 1).bit_length()
                assert {d.block_k for d in c.down} == {k for k in configs.FP8_TINY_DOWN_STEPS if k <= widest}
    assert block_m_candidates(configs.LayerShape.of(SPEC), 1) == [configs.TINY_ROUTES]


def test_compile_tasks_cover_every_candidate_once():
    points = points_from_args(_parse(["tune", "--model", "Maverick", "--tokens", "1,1024"]))
    plan = [(p, candidates(p, H200)) for p in points]
    tasks = compile_tasks(plan)
    assert all(0 < len(kernels) <= COMPILE_CHUNK for _, _, kernels in tasks)
    for point, cands in plan:
        for c in cands:
            compiled = [(kind, cfg) for p, block_m, kernels in tasks if (p, block_m) == (point, c.block_m)
                        for kind, cfg in kernels]
            assert sorted(compiled, key=repr) == sorted([("gate_up", g) for g in c.gate_up]
                                                        + [("down", d) for d in c.down], key=repr)
    tiny = plan[0][1][0].gate_up  # M=1 is tiny
    assert {g.split_k for g in tiny} == {1, 2, 4, 8, 16}
    assert {g.num_stages for g in tiny if g.num_warps == 4 and not g.gemv} == {3, 4, 6}


def test_sixteen_warps_only_for_wide_tiles_of_big_blocks_within_the_register_budget():
    bf16 = configs.LayerShape.of(SPEC)
    sixteen = {b: [c for c in gemm_candidates(b, bf16, 2, H200) if c.num_warps == 16] for b in (64, 128, 192)}
    assert not sixteen[64]
    assert {c.block_n for c in sixteen[128]} == {128, 256}
    assert {c.block_n for c in sixteen[192]} == {128}  # 192 x 2x256 fp32 would not fit 16 warps' registers
    for block_m, cfgs in sixteen.items():
        assert all(2 * block_m * c.block_n // (32 * 16) <= REG_BUDGET for c in cfgs)
        assert all(c.num_stages * (block_m + 2 * c.block_n) * c.block_k * 2 <= 227 * 1024 for c in cfgs)


def test_resident_downs_for_small_intermediates_fit_the_chip_and_other_quantised_downs_stream():
    def downs(name, weights="bf16", tokens=8192):
        args = ["tune", "--model", name, "--weights", weights, "--tokens", str(tokens)]
        return [(c.block_m, d) for c in candidates(points_from_args(_parse(args))[0], H200)
                for d in c.down]

    kimi = [(m, d) for m, d in downs("Kimi-K3") if d.n_split]
    assert kimi and {d.n_split for _, d in kimi} == {1, 2, 4} and all(d.block_k == 256 + 128 for _, d in kimi)
    assert all((configs.down_tile(m) + d.num_stages * d.block_n) * d.block_k * 2 <= 227 * 1024 for m, d in kimi)
    assert not any(d.n_split for _, d in downs("Mixtral"))  # I 1792: tiles already have enough K steps
    for name, weights in (("DeepSeek-V3", "fp8-block"), ("Kimi-K3", "mxfp4")):  # streamed: every tiled down split
        quantised = [(m, d) for m, d in downs(name, weights) if not d.gluon]  # Gluon's: their own test
        tiled = {(m, d) for m, d in quantised if not d.n_split}
        assert tiled and {(m, replace(d, n_split=0)) for m, d in quantised if d.n_split and not d.resident} == tiled
        assert {d.n_split for _, d in quantised if not d.resident} == {0, *STREAM_SPLITS}
    # block fp8 with I <= 512 also gets resident downs: K steps of 128, one byte a value in shared memory
    for name in ("DeepSeek-V3", "Kimi-K3"):
        inter = problems.model(name).spec.intermediate_size
        resident = [(m, d) for m, d in downs(name, "fp8-block") if d.resident]
        assert resident and {d.n_split for _, d in resident} == {1, 2} and all(d.block_k == 128 for _, d in resident)
        assert all((configs.down_tile(m) + d.num_stages * d.block_n) * -(-inter // 128) * 128 <= 227 * 1024
                   for m, d in resident)
        assert max(d.num_stages for m, d in resident if m == 64 and d.block_n == 128) == (4 if inter == 384 else 5)
    few_rows = [d for m, d in downs("DeepSeek-V3", "fp8-block", 1024) if d.resident and configs.down_tile(m) < 64]
    assert few_rows and any(d.weight_left for d in few_rows)  # 32-row tiles: the weight tile as wgmma's M
    for name, weights in (("Kimi-K3", "mxfp4"), ("Maverick", "fp8-channel-token"), ("Maverick", "fp8-block")):
        assert not any(d.resident for _, d in downs(name, weights))  # not block fp8, or I of 1024
    assert [configs.resident_k(i) for i in (256, 384, 72, 100)] == [(256, 0), (256, 128), (64, 16), (64, 64)]


# -- the benchmark's arithmetic and its peer ------------------------------------------------------


def test_random_routing_is_seeded_distinct_and_normalised():
    w, ids = random_routing(64, MODELS[1].spec, "cpu", seed=3)
    assert torch.equal(ids, random_routing(64, MODELS[1].spec, "cpu", seed=3)[1])
    assert all(len(set(row)) == 8 for row in ids.tolist())
    torch.testing.assert_close(w.sum(dim=1), torch.ones(64))


def test_floor_counts_distinct_experts_and_all_routes():
    spec = MODELS[0].spec  # Mixtral TP8: 3 * 4096 * 1792 bf16 per expert
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    floor = floor_for(spec, ids, bandwidth=4e12, matrix_rate=800e12)
    assert floor.weight_bytes == 3 * (3 * 4096 * 1792 * 2)
    assert floor.flops == 2 * 6 * 3 * 4096 * 1792
    assert floor.bound == "memory" and math.isclose(floor.seconds, floor.weight_bytes / 4e12)
    assert floor_for(spec, torch.zeros(8192, 2, dtype=torch.int32), 4e12, 800e12).bound == "compute"
    scales = 4 * math.ceil(2 * 1792 / 128) * math.ceil(4096 / 128) + 4 * math.ceil(4096 / 128) * math.ceil(1792 / 128)
    assert bytes_per_expert(with_weights(spec, "fp8-block")) == 3 * 4096 * 1792 + scales  # one byte, fp32 scales
    # mxfp4: half a byte per weight, one e8m0 byte per 32
    assert bytes_per_expert(with_weights(spec, "mxfp4")) == 3 * 4096 * 1792 // 2 + 3 * 4096 * 1792 // 32
    assert bytes_per_expert(with_weights(spec, "fp8-channel-token")) == 3 * 4096 * 1792 + 4 * (2 * 1792 + 4096)


@pytest.mark.parametrize("spec", [mo.MoESpec(8, 64, 32, 2), mo.MoESpec(8, 64, 32, 1, apply_router_weight_on_input=True),
                                  mo.MoESpec(16, 64, 32, 4, mo.Activation.situ())], ids=str)
def test_grouped_mm_peer_computes_the_layer(spec):
    t = random_weights(spec, "cpu", seed=0)
    w, ids = random_routing(37, spec, "cpu", seed=1)
    x = random_input(37, spec, "cpu", seed=2)
    out = grouped_mm_experts(spec, t["w13"].transpose(1, 2), t["w2"].transpose(1, 2), x, w, ids)
    ref = reference_moe(x, t["w13"], t["w2"], w, ids, spec.quant, spec.activation, spec.apply_router_weight_on_input)
    assert relative_error(out, ref) < 2e-2


def test_bench_floor_takes_the_faster_read_and_the_formats_matrix_rate():
    from moe_overlay.backends.triton_moe.bench import Bandwidth, Rates, Row, markdown

    rates = Rates(Bandwidth(read=4.45e12, copy=4.29e12), bf16=680e12, fp8=1230e12, peaks=(4.8e12, 989e12, 1979e12))
    kimi = MODELS[3].spec
    assert rates.floor_rates(with_weights(kimi, "mxfp4"), measured=True) == (4.45e12, 680e12)  # w4a16: 16-bit dots
    assert rates.floor_rates(with_weights(kimi, "fp8-block"), measured=True) == (4.45e12, 1230e12)
    assert rates.floor_rates(with_weights(kimi, "fp8-block"), measured=False) == (4.8e12, 1979e12)
    assert Rates(Bandwidth(4e12, 4.3e12), 680e12, None, None).floor_rates(kimi, measured=False) is None
    rows = [Row("Kimi-K3", 1, "memory", 10e-6, 9e-6, 20e-6, 40e-6, 0.1, 1e-3, None),
            Row("Kimi-K3", 128, "memory", 100e-6, 90e-6, 101e-6, 150e-6, 0.1, 1e-3, None)]
    table = markdown(rows, "mxfp4", "NVIDIA H200", rates, "target sm_90")
    assert "highest 99.0% (Kimi-K3 M=128)" in table and "lowest 50.0% (Kimi-K3 M=1)" in table
    assert "| bf16 triton (us) |" in table and "faster at 2 of 2 points" in table
    assert "read bandwidth 4.45 TB/s" in table and "4.29 TB/s read + written" in table
    assert "Floor beaten" not in table


def test_kernel_times_are_summed_a_call_by_kernel_most_first():
    from moe_overlay.backends.triton_moe.timing import per_call

    launches = [("gate_up_kernel", 40.0), ("down_kernel", 30.0), ("gate_up_kernel", 40.0), ("down_kernel", 30.0),
                ("sum_routes_kernel", 2.0)]
    split = per_call(launches, calls=2)
    assert list(split) == ["gate_up_kernel", "down_kernel", "sum_routes_kernel"]
    assert split == pytest.approx({"gate_up_kernel": 40e-6, "down_kernel": 30e-6, "sum_routes_kernel": 1e-6})


def test_bench_says_the_floor_is_wrong_where_a_layer_beats_it():
    from moe_overlay.backends.triton_moe.bench import Bandwidth, Rates, Row, floors_beaten, markdown

    rates = Rates(Bandwidth(read=4.36e12, copy=4.29e12), bf16=680e12, fp8=None, peaks=None)
    rows = [Row("Kimi-K3", 128, "memory", 1519.5e-6, None, 1508.9e-6, 2345.8e-6, 0.4, 3e-3, 4e-3),
            Row("Maverick", 128, "memory", 555.0e-6, 520.0e-6, 569.4e-6, 540.0e-6, 0.1, 3e-3, 4e-3),
            Row("Mixtral", 1, "memory", 19.8e-6, 18.4e-6, 29.2e-6, 99.0e-6, 0.1, 3e-3, 4e-3)]
    assert floors_beaten(rows, "_grouped_mm") == [
        "Kimi-K3 M=128: triton 1508.9 us under the floor of 1519.5 us",
        "Maverick M=128: _grouped_mm 540.0 us under the floor of 555.0 us"]
    assert "**Floor beaten by 2 layer(s)" in markdown(rows, "bf16", "NVIDIA H200", rates, "target sm_90")
    # a measured floor under the published peaks' one (rates above the datasheet's) is beaten there too
    fast = [Row("Mixtral", 1, "memory", 18.0e-6, 19.0e-6, 18.5e-6, 99.0e-6, 0.1, 3e-3, 4e-3)]
    assert floors_beaten(fast, "bf16 triton") == ["Mixtral M=1: triton 18.5 us under the floor of 19.0 us"]


def test_tune_imports_no_serving_module():
    """`moe-overlay tune` runs where the serving stack is absent (the GPU lane): the command line
    imports only the subcommand it runs."""
    import subprocess
    import sys

    code = ("import sys; from moe_overlay.cli import build_parser; "
            "build_parser(['tune', '--help-not-parsed']); "
            "print(sorted(m for m in sys.modules if m.startswith(('moe_overlay.serving', 'pydantic', 'vllm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_canonical_mxfp4_scales_past_what_the_kernels_multiply_by_are_refused_at_prepare():
    """The one-token gemv and the decode a program scale canonical mxfp4 by 2^(s - 113) in
    fp32: e8m0 240 (2^113) is the most; 241 is refused before anything runs, naming the tensor."""
    spec = with_weights(mo.MoESpec(8, 256, 128, 2, mo.Activation.situ(3.0, 9.0)), "mxfp4")
    tensors = random_weights(spec, "cpu", seed=0)
    tensors["w2_scale"][3, 5, 1] = 240
    mo.PreparedExperts(spec, tensors, mo.get_backend("triton")).prepare()
    tensors["w2_scale"][3, 5, 1] = 241
    with pytest.raises(mo.SpecError, match=r"w2_scale holds e8m0 241 \(2\^114\).* up to 2\^113"):
        mo.PreparedExperts(spec, tensors, mo.get_backend("triton")).prepare()
