"""Selection of the AITER backend: its capability table gives the reason for every rejection;
AITER itself is imported lazily and guardedly."""

import importlib.metadata
import subprocess
import sys

import pytest
import torch

import moe_overlay as mo
from moe_overlay import backend as registry
from moe_overlay.backends.aiter import ops as aiter_ops
from moe_overlay.backends.aiter.backend import AiterBackend
from moe_overlay.backends.aiter.capability import PATHS
from tests.aiter_emulator import installed_contract
from tests.aiter_emulator.layers import FP8_BLOCK, FP8_TENSOR, FP8_TOKEN, MXFP4, emulated_backend

try:  # AITER's sources are read from the installed amd-aiter (`make test` installs it; a GPU machine may not)
    importlib.metadata.distribution(aiter_ops.AITER_DISTRIBUTION)
except importlib.metadata.PackageNotFoundError:
    pytest.skip("amd-aiter is not installed: these tests read AITER's own files (they run in `make test`)",
                allow_module_level=True)

GFX942 = mo.Platform("cuda", "amd", "gfx942")
GFX950 = mo.Platform("cuda", "amd", "gfx950")
KIMI = mo.MoESpec(8, 256, 128, 4, mo.Activation.situ(), quant=MXFP4)


def _reason(spec, arch="gfx942", contract="main", env=None):
    backend, _ = emulated_backend(arch, contract, env)
    return backend.unsupported_reason(spec, mo.Platform("cuda", "amd", arch))


def test_every_path_of_the_table_is_selectable_somewhere():
    specs = {
        "bf16": mo.MoESpec(8, 256, 128, 2),
        "fp8 per-tensor": mo.MoESpec(8, 256, 128, 2, quant=FP8_TENSOR),
        "fp8 per-token": mo.MoESpec(8, 256, 128, 1, apply_router_weight_on_input=True, quant=FP8_TOKEN),
        "fp8 block 128x128": mo.MoESpec(8, 256, 128, 8, quant=FP8_BLOCK),
        "mxfp4 a16w4": KIMI,
    }
    assert set(specs) == {p.name for p in PATHS}
    for name, spec in specs.items():
        path = next(p for p in PATHS if p.name == name)
        for arch in path.archs:
            assert _reason(spec, arch) is None, (name, arch)


def _layer(*args, **kwargs):
    return mo.MoESpec(8, *args, **kwargs)


SITU = mo.Activation.situ()
REJECTIONS = [  # (spec, arch, AITER contract, part of the reason)
    (_layer(256, 128, 2), "gfx90a", "main", "runs on gfx942 (MI300X/MI325X), gfx950 (MI350X/MI355X); this is gfx90a"),
    (_layer(256, 128, 2, dtype=torch.float32), "gfx942", "main", "bfloat16 or float16; this layer is torch.float32"),
    (_layer(256, 128, 2, has_bias=True), "gfx942", "main", "take no expert biases"),
    (_layer(256, 128, 2, mo.Activation.swiglu_clamped()), "gfx942", "main",
     "bf16 fused MoE runs silu, gelu; this layer uses swiglu_clamped(alpha=1.702, limit=7)"),
    (_layer(256, 128, 2, quant=mo.QuantSpec("fp8", "channel")), "gfx942", "main",
     "AITER has no fused MoE for fp8 e4m3fn per-channel; it runs: bf16 (unquantised); fp8 per-tensor"),
    (_layer(256, 128, 2, quant=mo.QuantSpec("fp8", "block", (64, 64), activations="fp8_block")), "gfx950", "main",
     "needs 128x128 blocks; this layer has 64x64"),
    (KIMI, "gfx942", "main", "mxfp4 a16w4 fused MoE needs gfx950 (MI350X/MI355X); this is gfx942"),
    (KIMI, "gfx950", "installed", f"the installed AITER {installed_contract().version} lacks ActivationType.Situv2, "
     "fused_moe(beta=), fused_moe(linear_beta=), FlyDSL, which its mxfp4 a16w4 situ needs"),
    (_layer(256, 128, 2, quant=MXFP4), "gfx950", "main", "mxfp4 a16w4 fused MoE runs situ; this layer uses silu"),
    (_layer(256, 128, 2, mo.Activation.situ(4.0, None), quant=MXFP4), "gfx950", "main",
     "AITER's Situv2 clips up with linear_beta; this layer leaves up unclipped (linear_beta unset)"),
    (_layer(256, 128, 1, SITU, True, quant=MXFP4), "gfx950", "main", "cannot apply the router weight to the input"),
    (_layer(256, 128, 2, SITU, expert_map=(0, 1, 2, 3, -1, -1, -1, -1), quant=MXFP4), "gfx950", "main",
     "mxfp4 a16w4 fused MoE has no expert parallelism"),
    (mo.MoESpec(4, 256, 128, 2, expert_map=(1, 0, -1, -1)), "gfx942", "main",
     "numbers a rank's experts in global order"),
    (_layer(200, 128, 2), "gfx942", "main", "needs a hidden size divisible by 32; got 200"),
    (_layer(256, 40, 2, quant=FP8_TOKEN), "gfx942", "main", "needs an intermediate size divisible by 32; got 40"),
    (_layer(256, 192, 2, quant=FP8_BLOCK), "gfx942", "main", "divisible by 128; got 192"),
    (_layer(256, 128, 2, quant=mo.QuantSpec("fp8", "tensor", fp8_format="e4m3fnuz", activations="fp8_tensor")),
     "gfx950", "main", "e4m3fnuz weights cannot run on gfx950, which computes in e4m3fn"),
]


@pytest.mark.parametrize("spec,arch,contract,reason", REJECTIONS)
def test_rejections_name_their_reason(spec, arch, contract, reason):
    why = _reason(spec, arch, contract)
    assert why is not None and reason in why


def test_situ_activation_switches_are_refused():
    why = _reason(KIMI, "gfx950", env={"AITER_SITUV2_A4W4": "1"})
    assert why == ("AITER_SITUV2_A4W4=1 makes AITER quantise SiTU activations, which this weight-only layer does "
                   "not describe; unset it (vLLM sets it unless VLLM_ROCM_USE_AITER_MOE_SITUV2=a16w4)")
    assert _reason(KIMI, "gfx950", env={"AITER_SITUV2_A4W4": "0"}) is None


def test_the_backend_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("AITER_SITUV2_A8W4", "1")
    backend = AiterBackend(emulated_backend("gfx950")[1])
    assert backend.unsupported_reason(KIMI, GFX950).startswith("AITER_SITUV2_A8W4=1 makes AITER quantise")


def test_other_platforms_are_told_why():
    backend, _ = emulated_backend("gfx950")
    spec = mo.MoESpec(8, 256, 128, 2)
    assert backend.unsupported_reason(spec, mo.Platform("cuda", "nvidia", "sm_90")) == (
        "needs ROCm (AMD GPU); this is nvidia:sm_90")
    assert backend.unsupported_reason(spec, GFX942) == "this AITER runs on gfx950; this layer is on gfx942"
    assert mo.get_backend("aiter").unsupported_reason(spec, mo.Platform("cpu", "cpu")) == (
        "needs ROCm (AMD GPU); this is cpu")


@pytest.fixture
def aiter_on_gfx942(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    backend, _ = emulated_backend("gfx942", "installed")
    mo.register_backend(backend)


def test_kimi_on_gfx942_falls_back_with_the_reason(aiter_on_gfx942):
    sel = mo.select_backend(KIMI, GFX942, "aiter")
    assert sel.backend.name != "aiter" and "fell back" in sel.reason
    assert sel.rejected["aiter"].startswith("AITER's mxfp4 a16w4 fused MoE needs gfx950")
    with pytest.raises(mo.BackendUnavailableError, match=r"aiter: AITER's mxfp4 a16w4 fused MoE needs gfx950"):
        mo.select_backend(KIMI, GFX942, "aiter", strict=True)


def test_aiter_is_first_in_auto_order_where_it_fits(aiter_on_gfx942):
    assert mo.backend_names()[0] == "aiter"
    sel = mo.select_backend(mo.MoESpec(8, 256, 128, 2, quant=FP8_TOKEN), GFX942)
    assert sel.backend.name == "aiter" and sel.rejected == {}
    fp8 = torch.float8_e4m3fn
    experts = mo.PreparedExperts(mo.MoESpec(8, 256, 128, 2, quant=FP8_TOKEN), {
        "w13": torch.zeros(8, 256, 256, dtype=fp8), "w2": torch.zeros(8, 256, 128, dtype=fp8),
        "w13_scale": torch.ones(8, 256), "w2_scale": torch.ones(8, 256)}, sel)
    experts.prepare()
    info = experts.describe()
    assert info["kernel"] == "aiter.fused_moe(per_Token, Silu) [fp8 per-token]"
    assert info["layout"] == "aiter/e4m3fnuz/shuffle16x16" and info["prepared"] is True


def test_a_failing_aiter_import_is_a_reason_not_a_crash(monkeypatch):
    def no_rocm(name):
        raise SystemExit("hipcc not found")  # what AITER does without ROCm

    monkeypatch.setattr(aiter_ops.importlib, "import_module", no_rocm)
    with pytest.raises(mo.BackendUnavailableError, match=r"cannot be imported here \(SystemExit: hipcc not found\)"):
        aiter_ops.import_aiter()


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.strip()


def test_importing_the_package_leaves_aiter_alone_and_the_real_import_is_guarded():
    """In a fresh interpreter (a failed `import aiter` leaves modules and sys.path behind):
    the package registers the backend and its custom ops without importing aiter; asking the
    real backend about an AMD GPU imports the installed amd-aiter, which fails without ROCm,
    and the failure becomes the rejection reason, once."""
    out = _python(
        "import sys, torch, moe_overlay as mo\n"
        "def aiter_loaded(): return any(m.split('.')[0] == 'aiter' for m in sys.modules)\n"
        "print(aiter_loaded(), hasattr(torch.ops.moe_overlay, 'aiter_fused_moe'))\n"
        "b = mo.get_backend('aiter'); spec = mo.MoESpec(8, 256, 128, 2)\n"
        "gpu = mo.Platform('cuda', 'amd', 'gfx942')\n"
        "print(b.unsupported_reason(spec, gpu)); print(b.unsupported_reason(spec, gpu) is not None)\n"
        "print(aiter_loaded())\n"
    )
    lines = out.splitlines()
    assert lines[0] == "False True"
    assert lines[1].startswith("AITER cannot be imported here (") and "amd-aiter package" in lines[1]
    assert lines[2:] == ["True", "True"]  # the real package was tried
