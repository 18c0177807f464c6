"""The mxfp4 kernels NVIDIA GPUs run, compiled on a machine without one.

On NVIDIA with bf16 activations, mxfp4 weights are recoded at prepare() into 32-bit words
(layout.mx_words) that the kernels decode with shifts and masks. Triton's CUDA backend ships in
the triton wheel (with ptxas), so every launch of that path is built here for sm_90 (Hopper)
through the real launcher, as tests/test_triton_amd_compile.py does for AMD: it shows that the
kernels compile, that the decoded weight tile stays in registers as wgmma's operand (no trip
through shared memory) and that 4-warp launches copy the words 16 bytes at a time.
Correctness and speed are `make test-gpu` and `make bench-gpu`'s.
"""

from __future__ import annotations

import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from triton.backends import backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

import moe_overlay as mo  # noqa: E402
from moe_overlay.backends.problems import random_input, random_routing, random_weights, with_weights  # noqa: E402
from moe_overlay.backends.triton_moe import kernels, launch  # noqa: E402
from moe_overlay.backends.triton_moe.configs import KernelConfig, LaunchConfig  # noqa: E402
from moe_overlay.backends.triton_moe.offline import AbsentGpu  # noqa: E402
from moe_overlay.layout import to_layout  # noqa: E402

pytestmark = pytest.mark.skipif("nvidia" not in backends, reason="this triton has no NVIDIA backend")

SPEC = with_weights(mo.MoESpec(8, 512, 256, 2, mo.Activation.situ(3.0, 9.0)), "mxfp4")
HOPPER = mo.Platform("cuda", "nvidia", "sm_90")
DEVICE = 2000  # compiled kernels kept apart from other tests' (Triton caches them per device index)


def _config(block_m: int, gate_up: dict, down: dict) -> LaunchConfig:
    base = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 1, "split_k": 1}
    return LaunchConfig(block_m, KernelConfig(**{**base, **gate_up}), KernelConfig(**{**base, **down}))


# (tokens, launch): sorted mode with the tiled and the streamed down, blocks of 128 rows and
# blocks of 96 (gate/up: row tiles of 64 and 32 sharing each decoded weight tile);
# tiny mode with the 16-row dot (narrow: mma v2, whose operands pass through shared memory)
# and with the gemv gate/up
LAUNCHES = {
    "sorted": (64, _config(16, {}, {"block_n": 128})),
    "sorted, streamed down": (64, _config(16, {}, {"block_n": 128, "block_k": 128, "n_split": 2})),
    "sorted, 128-row blocks": (1024, _config(128, {"num_warps": 8}, {"block_k": 128})),
    "sorted, blocks of three row tiles": (512, _config(96, {"num_warps": 8}, {"block_k": 128})),
    "one token": (1, _config(16, {"block_n": 16, "block_k": 128, "split_k": 2},
                             {"block_n": 16, "block_k": 128, "num_warps": 8, "num_stages": 1})),
    "one token, gemv gate/up": (1, _config(16, {"block_n": 16, "block_k": 256, "split_k": 2, "gemv": True,
                                                "num_stages": 1}, {"block_n": 32})),
}


def _compile(launches: dict[str, tuple[int, LaunchConfig]], arch: int, device: int,
             spec: mo.MoESpec = SPEC) -> dict[str, list[dict]]:
    """Every kernel the launches of `spec`'s layer (mxfp4 by default) compiled for sm_<arch>
    (its `asm`: TTGIR, PTX, ... and `launch_pdl`, Triton's launch option), by kernel name."""
    layout = mo.get_backend("triton").layout_for(spec, HOPPER)
    tensors = to_layout(random_weights(spec, "cpu", seed=0), spec, layout)
    x1 = random_input(1, spec, "cpu", seed=1)
    layer = launch.Layer.of(x1, tensors["w13"], tensors["w2"],
                            spec.top_k, spec.activation.kind, list(spec.activation.params),
                            False, spec.quant.granularity)
    assert layer.mx_words == (spec.quant.weights == "mxfp4")
    driver.set_active(AbsentGpu(GPUTarget("cuda", arch, 32), device))
    try:
        for m, config in launches.values():
            weights, ids = random_routing(m, spec, "cpu", seed=2)
            with launch.compile_only():
                launch.fused_experts(layer, random_input(m, spec, "cpu", seed=3), tensors["w13"], tensors["w2"],
                                     tensors.get("w13_scale"), tensors.get("w2_scale"), weights, ids, None, config)
    finally:
        driver.set_active(None)
    compiled: dict[str, list[dict]] = {}
    for name in ("gate_up_kernel", "gate_up_gemv_kernel", "down_kernel", "down_resident_kernel", "down_tiny_kernel"):
        fn = getattr(kernels, name)
        compiled[name] = [{**k.asm, "launch_pdl": k.metadata.launch_pdl}
                          for k in fn.device_caches.get(device, ({},))[0].values()]
    return compiled


def test_mx_words_launches_compile_for_hopper_with_the_decoded_tile_in_registers():
    compiled = {name: [k["ttgir"] for k in ks] for name, ks in _compile(LAUNCHES, 90, DEVICE).items()}
    assert {name: len(irs) for name, irs in compiled.items()} == {
        "gate_up_kernel": 4, "gate_up_gemv_kernel": 1, "down_kernel": 4, "down_resident_kernel": 0,
        "down_tiny_kernel": 2}
    # the gemv decodes the words itself, on the mxfp4 path: nothing of the fp8 one (activations quantised to fp8)
    assert not any("f8E4M3" in ir for ir in compiled["gate_up_gemv_kernel"])
    for name in ("gate_up_kernel", "down_kernel"):
        wgmma = [ir for ir in compiled[name] if "warp_group_dot" in ir]
        # the sorted launches (64-row weight tiles at least): wgmma, the decoded weights its
        # register operand; nothing computed in registers is stored to shared memory
        assert len(wgmma) == (3 if name == "gate_up_kernel" else 4)
        for ir in wgmma:
            assert re.search(r"warp_group_dot %\S+, %\S+, %\S+.*: tensor<\d+x\d+xbf16, #ttg\.dot_op<\{opIdx = 0", ir)
            assert not re.search(r"ttg\.local_alloc %", ir), f"{name}: a register tile goes through shared memory"
            # the words' pipelined copies are 16 bytes (4 words) where a program has 4 warps, as every
            # shipped mxfp4 launch does (with the K mask compared against cols // 8 Triton proved
            # only 2 words constant: 8-byte copies; the 8-warp launches here still copy 8 bytes)
            if re.search(r'"ttg\.num-warps" = 4 ', ir):
                copies = [line for line in re.findall(r"async_copy_global_to_local[^\n]*", ir) if "ptr<i32>" in line]
                assert copies and all("contiguity = 4 " in line for line in copies), f"{name}: {copies}"


PDL_LAUNCHES = {  # one token, the down started by programmatic dependent launch, after either gate/up
    "dot": (1, _config(16, {"block_n": 16, "block_k": 128, "split_k": 2}, {"block_n": 16, "pdl": True})),
    "gemv": (1, _config(16, {"block_n": 16, "block_k": 256, "split_k": 2, "gemv": True, "num_stages": 1},
                        {"block_n": 32, "block_k": 128, "pdl": True})),
}


@pytest.mark.parametrize(("arch", "device"), [(90, DEVICE + 1), (80, DEVICE + 2)], ids=["sm_90", "sm_80"])
def test_one_token_pdl_entries_chain_their_launches_from_hopper_on(arch, device):
    """Hopper: each gate/up program lets the down start (griddepcontrol.launch_dependents), the
    down is launched so (Triton's launch_pdl) and waits before it reads the activation
    (griddepcontrol.wait), its first weight tile asked for before; Ampere has no PDL: the same
    entries compile to plain launches."""
    compiled = _compile(PDL_LAUNCHES, arch, device)
    gate_ups = compiled["gate_up_kernel"] + compiled["gate_up_gemv_kernel"]
    assert len(gate_ups) == 2 and len(compiled["down_tiny_kernel"]) == 2
    hopper = arch >= 90
    for k in gate_ups:
        assert ("griddepcontrol.launch_dependents" in k["ptx"]) == hopper and not k["launch_pdl"]
    for k in compiled["down_tiny_kernel"]:
        assert k["launch_pdl"] == hopper and ("griddepcontrol.wait" in k["ptx"]) == hopper
        if hopper:
            # the words' load (`[rows, groups, 4]` int32) is ordered before the wait, and the PTX loads
            # words there: 16 bytes at a time with Triton 3.9, 4 with Triton 3.6 (the lent H200's; a
            # version that loads 16 there was slower: docs/performance.md, 2026-12-04)
            wait = re.search(r"griddepcontrol\.wait|tt\.grid_dependency_wait", k["ttgir"])  # Triton 3.6 | 3.9
            assert wait, "no wait in the down's TTGIR"
            words = r"tt\.load [^\n]*: tensor<\d+x\d+x4x!tt\.ptr<i32>"
            assert re.search(words, k["ttgir"][: wait.start()]), "the words' load comes after the wait"
            assert re.search(r"ld\.global(\.v\d)?\.b32", k["ptx"].split("griddepcontrol.wait")[0])


FP8_SPEC = with_weights(mo.MoESpec(8, 512, 256, 2), "fp8-block")
FP8_GEMV_LAUNCHES = {f"one token, gemv gate/up, {block_k}-wide steps": (1, _config(
    16, {"block_n": block_n, "block_k": block_k, "split_k": 4, "gemv": True, "num_stages": 1},
    {"block_n": 16, "pdl": True})) for block_n, block_k in ((32, 128), (16, 256))}


@pytest.mark.parametrize(("weights", "device"), [("fp8-block", DEVICE + 9), ("fp8-channel-token", DEVICE + 10)])
def test_fp8_gemv_gate_up_compiles_for_hopper_without_tensor_cores(weights, device):
    """One token's fp8 gate/up as matrix-vector products (an H200 entry may ask for it): no
    dot and nothing staged in shared memory; its fp8 weight rows load 16 bytes at a time and
    convert in registers, pairs at once; it lets the down start early (PDL). With K steps of
    one 128-wide group or two."""
    spec = with_weights(FP8_SPEC, weights)
    kernels = _compile(FP8_GEMV_LAUNCHES, 90, device, spec)["gate_up_gemv_kernel"]
    assert len(kernels) == 2
    for kernel in kernels:
        assert not re.search(r"tt\.dot|warp_group_dot|local_alloc", kernel["ttgir"])
        assert "ld.global.v4.b32" in kernel["ptx"] and "cvt.rn.f16x2.e4m3x2" in kernel["ptx"]
        assert "griddepcontrol.launch_dependents" in kernel["ptx"]
# fp8 row tiles under wgmma's 64 rows: sorted blocks of 16, 32 and 48 (three row tiles), one token's 16-row dot
WEIGHT_LEFT_LAUNCHES = {
    f"{name}, weight left {left}": (m, _config(block_m, {"block_k": 128, "split_k": split, "weight_left": left},
                                               {"block_n": 128, "block_k": 128, "weight_left": left}))
    for name, m, block_m, split in (("sorted 16", 16, 16, 1), ("sorted 32", 64, 32, 1), ("one token", 1, 16, 2),
                                    ("sorted 48: row tiles of 32 and 16", 96, 48, 1))
    for left in (False, True)
}


@pytest.mark.parametrize(("arch", "device"), [(90, DEVICE + 3), (89, DEVICE + 4)], ids=["sm_90", "sm_89"])
def test_fp8_weight_left_entries_take_wgmma_from_hopper_on(arch, device):
    """fp8 dots of 16 or 32 rows: as written Triton makes them mma.sync dots of fp16, both tiles
    converted in registers; with the entry's weight_left on Hopper the weight tile is
    wgmma's left operand, fp8 from shared memory, and nothing is converted to fp16. Ada
    (sm_89) has no wgmma but fp8 mma.sync: both entries compile to that, as written."""
    compiled = _compile(WEIGHT_LEFT_LAUNCHES, arch, device, FP8_SPEC)
    irs = [k["ttgir"] for name in ("gate_up_kernel", "down_kernel") for k in compiled[name]]
    left = [ir for ir in irs if "warp_group_dot" in ir]
    # 4 gate/ups and 3 sorted downs (one token's down has no dot), each with and without; on Ada
    # both entries compile one kernel
    assert len(irs) == (14 if arch >= 90 else 7)
    assert len(left) == (7 if arch >= 90 else 0)
    for ir in left:
        assert re.search(r"warp_group_dot %\S+, %\S+, %\S+.*: !ttg\.memdesc<(64|128)x128xf8E4M3FN", ir)
        assert not re.search(r"tensor<\d+x\d+xf16, #ttg\.dot_op", ir)
    operands = "f16" if arch >= 90 else "f8E4M3FN"  # Ada's mma.sync takes fp8 as it is
    for ir in set(irs) - set(left):
        assert re.search(rf"tt\.dot %\S+.*tensor<\d+x\d+x{operands}, #ttg\.dot_op", ir)


GLUON_LAUNCHES = {  # block-fp8 sorted gate/up in blocks of 64 rows, through gluon_kernels where the entry asks
    f"gluon {gluon}, {block_n} columns": (300, _config(64, {"block_n": block_n, "block_k": 128, "num_stages": 4,
                                                            "gluon": gluon}, {"block_n": 128, "block_k": 128}))
    for gluon, block_n in ((False, 64), (True, 64), (True, 32))
}


@pytest.mark.parametrize(("arch", "device"), [(90, DEVICE + 5), (89, DEVICE + 6)], ids=["sm_90", "sm_89"])
def test_gluon_gate_up_overlaps_each_rescale_with_the_next_dot_from_hopper_on(arch, device):
    """Hopper: the entry's gate/up is gluon_kernels' kernel, and in its SASS a K step's wgmma is
    waited for with one still in flight (`WARPGROUP.DEPBAR.LE gsb0, 0x1`: the rescale runs
    while the next dot does; ptxas serialising the wgmmas would leave only waits for none).
    The same layer without the entry's flag, and Ada with it, run kernels.gate_up_kernel."""
    from triton import knobs

    from moe_overlay.backends.triton_moe import gluon_kernels

    spec = with_weights(mo.MoESpec(8, 512, 256, 2, mo.Activation.situ(3.0, 9.0)), "fp8-block")
    compiled = _compile(GLUON_LAUNCHES, arch, device, spec)
    gluon = list(gluon_kernels.gate_up_block_fp8_kernel.device_caches.get(device, ({},))[0].values())
    assert len(gluon) == (2 if arch >= 90 else 0)  # N tiles of 64 and 32
    assert len(compiled["gate_up_kernel"]) == (1 if arch >= 90 else 2)  # the entry without the flag; Ada: all
    for kernel in gluon:
        cubin = kernel.asm["cubin"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                                  check=True).stdout
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d)", sass)
        assert "0x1" in waits and sass.count("GMMA") >= 2, waits


GLUON_MX_LAUNCHES = {  # mx_words sorted gate/ups, through gluon_kernels where the entry asks
    f"{block_m} rows, {block_n} columns, K steps of {block_k}": (300, _config(
        block_m, {"block_n": block_n, "block_k": block_k, "gluon": True}, {"block_n": 128}))
    for block_m, block_n, block_k in ((16, 64, 64), (32, 128, 64), (64, 64, 128))
}


@pytest.mark.parametrize(("arch", "device"), [(90, DEVICE + 11), (89, DEVICE + 12)], ids=["sm_90", "sm_89"])
def test_gluon_mx_words_gate_up_decodes_into_the_wgmma_operand_from_hopper_on(arch, device):
    """Hopper: the entry's mx_words gate/up is gluon_kernels' kernel (blocks of 16, 32 and 64
    rows, N tiles of one and two wgmmas, K steps of one and two word chunks). The words load
    from shared memory straight into the layout their decode leaves as wgmma's register operand
    (the kernel asserts, when traced, that the conversion moves no data); the e8m0 scales load
    into theirs (kernels.gate_up_kernel converts its 1-byte scale tiles, through shared memory);
    nothing computed is stored to shared memory; a K step's gate and up wgmmas are both issued
    before its one wait (the `tl` kernel waits for each). Ada runs kernels.gate_up_kernel."""
    from moe_overlay.backends.triton_moe import gluon_kernels

    compiled = _compile(GLUON_MX_LAUNCHES, arch, device)
    gluon = list(gluon_kernels.gate_up_mx_words_kernel.device_caches.get(device, ({},))[0].values())
    assert len(gluon) == (3 if arch >= 90 else 0)
    assert len(compiled["gate_up_kernel"]) == (0 if arch >= 90 else 3)
    for kernel in gluon:
        _assert_two_decoded_dots_a_step(kernel)


def _assert_two_decoded_dots_a_step(kernel) -> None:
    """A compiled mx_words Gluon kernel: each K step's two word tiles load from shared memory
    into the decode's layout, no 1-byte tile is converted, nothing computed is stored to shared
    memory, both decoded tiles are wgmma's register operand, and one wait covers the step."""
    from triton import knobs

    ir = kernel.asm["ttgir"]
    assert len(re.findall(r"ttg\.local_load [^\n]*-> tensor<\d+x\d+x4xi32, #linear", ir)) == 2
    assert not re.search(r"ttg\.convert_layout [^\n]*xi8,", ir)
    assert not re.search(r"ttg\.local_alloc %", ir)
    assert len(re.findall(r"warp_group_dot %\S+, %\S+, %\S+.*: tensor<\d+x\d+xbf16, #ttg\.dot_op<\{opIdx = 0",
                          ir)) == 2
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    assert re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x\d", sass) == ["WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert sass.count("HGMMA") >= 8


GLUON_MX_DOWNS = {  # mx_words streamed downs, through gluon_kernels where the entry asks
    f"{block_m} rows, {block_n} columns, K steps of {block_k}": (300, _config(
        block_m, {"gluon": True}, {"block_n": block_n, "block_k": block_k, "n_split": 2, "gluon": True}))
    for block_m, block_n, block_k in ((16, 256, 64), (64, 128, 128))
}


@pytest.mark.parametrize(("arch", "device"), [(90, DEVICE + 13), (89, DEVICE + 14)], ids=["sm_90", "sm_89"])
def test_gluon_mx_words_down_decodes_into_the_wgmma_operand_from_hopper_on(arch, device):
    """Hopper: the entry's streamed mx_words down is gluon_kernels' kernel (blocks of 16 and 64
    rows, N tiles of two halves of one and two wgmmas, K steps of one and two word chunks), its
    halves decoded as the gate/up's gate and up tiles are. Ada runs kernels.down_kernel."""
    from moe_overlay.backends.triton_moe import gluon_kernels

    compiled = _compile(GLUON_MX_DOWNS, arch, device)
    gluon = list(gluon_kernels.down_mx_words_kernel.device_caches.get(device, ({},))[0].values())
    assert len(gluon) == (2 if arch >= 90 else 0)
    assert len(compiled["down_kernel"]) == (0 if arch >= 90 else 2)
    for kernel in gluon:
        _assert_two_decoded_dots_a_step(kernel)


GLUON_MX_TINY = {  # tiny mode's mx_words gate/ups through gluon_kernels: one token with PDL, 8 routes unchained
    "one token, K split 4, PDL": (1, _config(16, {"block_n": 64, "block_k": 64, "split_k": 4, "gluon": True},
                                             {"block_n": 16, "block_k": 128, "num_stages": 1, "pdl": True})),
    "four tokens, N tiles of two wgmmas, K split 2": (4, _config(
        16, {"block_n": 128, "block_k": 128, "split_k": 2, "gluon": True}, {"block_n": 16, "num_stages": 1})),
}


@pytest.mark.parametrize(("arch", "device"), [(90, DEVICE + 15), (89, DEVICE + 16)], ids=["sm_90", "sm_89"])
def test_gluon_mx_words_tiny_gate_up_decodes_into_the_wgmma_operand_from_hopper_on(arch, device):
    """Hopper: tiny mode's mx_words gate/up is gluon_kernels' tiny kernel where the entry asks,
    its K steps as the sorted kernel's (two decoded wgmma operands, one wait); each program
    counts itself in on its tile (an atomic add) and, where the down's entry asks for PDL, lets
    the down start. Ada runs kernels.gate_up_kernel."""
    from moe_overlay.backends.triton_moe import gluon_kernels

    compiled = _compile(GLUON_MX_TINY, arch, device)
    gluon = list(gluon_kernels.gate_up_mx_words_tiny_kernel.device_caches.get(device, ({},))[0].values())
    assert len(gluon) == (2 if arch >= 90 else 0)
    assert len(compiled["gate_up_kernel"]) == (0 if arch >= 90 else 2)
    assert sorted("griddepcontrol.launch_dependents" in k.asm["ptx"] for k in gluon) == ([False, True] if gluon else [])
    for kernel in gluon:
        _assert_two_decoded_dots_a_step(kernel)
        assert re.search(r"atom\.[^\n]*add", kernel.asm["ptx"])


GLUON_MX_TINY_DOWNS = {  # tiny mode's mx_words downs through gluon_kernels: one token with PDL, four unchained
    "one token, a route a program, PDL": (1, _config(16, {"block_n": 64, "split_k": 2, "gluon": True}, {
        "block_n": 128, "block_k": 128, "num_stages": 2, "split_k": 2, "pdl": True, "gluon": True})),
    "four tokens, 256-row tiles, K steps of 64": (4, _config(16, {"block_n": 64, "split_k": 2}, {
        "block_n": 256, "block_k": 64, "num_stages": 3, "split_k": 1, "gluon": True})),
}


@pytest.mark.parametrize(("arch", "device"), [(90, DEVICE + 17), (89, DEVICE + 18)], ids=["sm_90", "sm_89"])
def test_gluon_mx_words_tiny_down_copies_weights_before_its_pdl_wait_from_hopper_on(arch, device):
    """Hopper: tiny mode's mx_words down is gluon_kernels' one-token down where the entry asks,
    each K step two decoded wgmma operands (8 columns: a route each) and one wait; with PDL
    it is launched so, and its first word copies are issued before it waits for the gate/up
    and its activation loads after. Ada runs kernels.down_tiny_kernel."""
    from moe_overlay.backends.triton_moe import gluon_kernels

    compiled = _compile(GLUON_MX_TINY_DOWNS, arch, device)
    gluon = list(gluon_kernels.down_mx_words_tiny_kernel.device_caches.get(device, ({},))[0].values())
    assert len(gluon) == (2 if arch >= 90 else 0)
    assert len(compiled["down_tiny_kernel"]) == (0 if arch >= 90 else 2)
    assert sorted(k.metadata.launch_pdl for k in gluon) == ([False, True] if gluon else [])
    for kernel in gluon:
        _assert_two_decoded_dots_a_step(kernel)
        ir = kernel.asm["ttgir"]
        assert re.search(r"warp_group_dot [^\n]*-> tensor<\d+x8xf32", ir)
        wait = re.search(r"tt\.grid_dependency_wait|griddepcontrol\.wait", ir)
        if kernel.metadata.launch_pdl:
            assert wait, "no PDL wait"
            before, after = ir[: wait.start()], ir[wait.start():]
            assert "async_copy_global_to_local" in before, "no word copy before the wait"
            assert re.search(r"tt\.load [^\n]*ptr<f32>", after) and not re.search(r"tt\.load [^\n]*ptr<f32>", before)


RESIDENT_SPEC = with_weights(mo.MoESpec(8, 512, 384, 2), "fp8-block")  # I of three K steps
RESIDENT_LAUNCHES = {  # block-fp8 resident downs: 64-row tiles through descriptors or plain loads; 32-row weight-left
    "64 rows, descriptors": (300, _config(64, {"block_k": 128}, {"block_k": 128, "n_split": 1, "resident": True,
                                                                 "descriptors": True})),
    "64 rows, plain loads": (300, _config(64, {"block_k": 128}, {"block_k": 128, "n_split": 2, "resident": True})),
    "32 rows, weight left": (100, _config(32, {"block_k": 128}, {"block_k": 128, "n_split": 2, "resident": True,
                                                                 "weight_left": True})),
}


@pytest.mark.parametrize(("arch", "device"), [(90, DEVICE + 7), (89, DEVICE + 8)], ids=["sm_90", "sm_89"])
def test_block_fp8_resident_down_loads_its_activation_once_from_hopper_on(arch, device):
    """The resident down loads its fp8 activation tile, one load per K step, before the loop
    over N tiles, which then streams weight tiles only (no activation load in it). On Hopper
    three wgmmas a tile, fp8 operands from shared memory (nothing converted to fp16); a
    64-row tile is staged there once, before the loop (the 32-row weight-left one is wgmma's
    right operand, staged from registers each tile). Ada compiles them to fp8 mma.sync."""
    compiled = _compile(RESIDENT_LAUNCHES, arch, device, RESIDENT_SPEC)
    irs = [k["ttgir"] for k in compiled["down_resident_kernel"]]
    assert len(irs) == 3 and not compiled["down_kernel"]
    activation_load = r"tt\.load %[^\n]*: tensor<(\d+)x128x!tt\.ptr<f8E4M3FN>"
    for ir in irs:
        before, loop = ir.split("scf.for", 1)
        rows = re.findall(activation_load, before)
        assert len(rows) == 3 and not re.search(activation_load, loop), rows
        if arch >= 90:
            assert len(re.findall(r"warp_group_dot %", loop)) == 3
            assert not re.search(r"tensor<\d+x\d+xf16, #ttg\.dot_op", ir)
            staged = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<64x128xf8E4M3FN", before)
            assert len(staged) == (3 if rows[0] == "64" else 0)
        else:
            assert len(re.findall(r"tt\.dot %\S+.*tensor<\d+x\d+xf8E4M3FN, #ttg\.dot_op", loop)) == 3


def test_the_floors_dot_read_streams_its_tiles_through_asynchronous_copies():
    """bench's read through a dot times weight tiles read as the GEMMs stream them on Hopper:
    each shape's loads compile to asynchronous copies into shared memory, num_stages - 1 tiles
    in flight (16-byte aligned pointers, as torch allocates)."""
    import torch

    from moe_overlay.backends.triton_moe import bench

    src = torch.empty(2**16, dtype=torch.int8)
    out = torch.empty(2**10, dtype=torch.int32)
    driver.set_active(AbsentGpu(GPUTarget("cuda", 90, 32), DEVICE + 1))
    try:
        for rows, cols, iters, warps, stages in bench.READ_DOT_SHAPES:
            kernel = bench._read_dot_kernel.warmup(src, out, ROWS=rows, COLS=cols, ITERS=iters, num_warps=warps,
                                                   num_stages=stages, grid=(1,))
            assert "cp.async" in kernel.asm["ptx"], (rows, cols, stages)
            assert kernel.metadata.shared >= (stages - 1) * rows * cols, (rows, cols, stages)
    finally:
        driver.set_active(None)
