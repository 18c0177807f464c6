"""Selection: a reason for the choice and for every backend passed over; strict mode raises."""

import importlib.metadata

import pytest
import torch

import moe_overlay as mo
from moe_overlay import backend as registry
from tests.backends_for_tests import RelayoutBackend

SPEC = mo.MoESpec(8, 64, 32, 2)
CPU = mo.Platform("cpu", "cpu")


@pytest.fixture
def fake_backends(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    mo.register_backend(RelayoutBackend(mo.CANONICAL, "fastest", "needs gfx950", priority=1000))
    mo.register_backend(RelayoutBackend(mo.CANONICAL, "fast", None, priority=900))


def test_auto_picks_first_supported_and_explains(fake_backends):
    sel = mo.select_backend(SPEC, CPU)
    assert sel.backend.name == "fast"
    assert sel.rejected == {"fastest": "needs gfx950"}
    assert "auto order" in sel.reason
    assert mo.backend_names()[:2] == ["fastest", "fast"] and mo.backend_names()[-1] == "torch"


def test_requested_backend_wins_when_it_fits(fake_backends):
    sel = mo.select_backend(SPEC, CPU, "torch")
    assert sel.backend.name == "torch" and "requested" in sel.reason


def test_requested_unfit_falls_back_with_reasons(fake_backends):
    sel = mo.select_backend(SPEC, CPU, ["fastest"])
    assert sel.backend.name == "fast"
    assert sel.rejected["fastest"] == "needs gfx950"
    assert "fell back" in sel.reason


def test_strict_raises_naming_the_reason(fake_backends):
    with pytest.raises(mo.BackendUnavailableError, match=r"fastest: needs gfx950"):
        mo.select_backend(SPEC, CPU, "fastest", strict=True)


def test_unknown_backend_is_named():
    with pytest.raises(mo.BackendUnavailableError, match=r"no backend named 'cuda-magic'; known backends"):
        mo.select_backend(SPEC, CPU, "cuda-magic")


def test_reference_is_always_available_on_cpu():
    sel = mo.select_backend(SPEC, mo.Platform.of(torch.device("cpu")))
    assert sel.backend.name in mo.backend_names()
    prepared = mo.PreparedExperts(
        SPEC, {"w13": torch.zeros(8, 64, 64, dtype=torch.bfloat16), "w2": torch.zeros(8, 64, 32, dtype=torch.bfloat16)},
        sel)
    assert prepared.describe()["reason"] == sel.reason


KIMI_MXFP4 = mo.MoESpec(896, 3584, 384, 16, mo.Activation.situ(), quant=mo.QuantSpec("mxfp4"))


@pytest.fixture
def emulated_aiter(monkeypatch):
    """AITER's backend on an emulated GPU (its main branch's contract, read with the installed
    amd-aiter's files), and triton importable."""
    from moe_overlay.backends.aiter.ops import AITER_DISTRIBUTION
    from moe_overlay.backends.triton_moe import backend as triton_backend
    from tests.aiter_emulator.layers import emulated_backend

    try:
        importlib.metadata.distribution(AITER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("amd-aiter is not installed: the AITER emulator reads its files (`make test` installs it)")

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(triton_backend, "triton_installed", lambda: True)

    def on(arch):
        mo.register_backend(emulated_backend(arch, "main")[0])
        return mo.Platform("cuda", "amd", arch)

    return on


def test_kimi_mxfp4_on_gfx942_runs_on_triton_and_says_why_not_aiter(emulated_aiter):
    sel = mo.select_backend(KIMI_MXFP4, emulated_aiter("gfx942"))
    assert sel.backend.name == "triton"
    assert sel.rejected["aiter"].startswith("AITER's mxfp4 a16w4 fused MoE needs gfx950")
    assert f"passed over: aiter: {sel.rejected['aiter']}" in sel.reason


def test_kimi_mxfp4_on_gfx950_still_prefers_aiter(emulated_aiter):
    sel = mo.select_backend(KIMI_MXFP4, emulated_aiter("gfx950"))
    assert sel.backend.name == "aiter" and sel.rejected == {} and "passed over" not in sel.reason
    assert mo.select_backend(KIMI_MXFP4, mo.Platform("cuda", "amd", "gfx950"), "triton").backend.name == "triton"


def test_kimi_mxfp4_on_nvidia_runs_on_triton(monkeypatch):
    from moe_overlay.backends.triton_moe import backend as triton_backend

    monkeypatch.setattr(triton_backend, "triton_installed", lambda: True)
    sel = mo.select_backend(KIMI_MXFP4, mo.Platform("cuda", "nvidia", "sm_90"))
    assert sel.backend.name == "triton" and "aiter: needs ROCm" in sel.reason


def test_situ_with_up_unclipped_is_not_offered_to_triton(monkeypatch):
    """Its kernel computes linear_beta * tanh(up / linear_beta) (NaN for an unset, infinite linear_beta)."""
    from moe_overlay.backends.triton_moe import backend as triton_backend

    monkeypatch.setattr(triton_backend, "triton_installed", lambda: True)
    spec = mo.MoESpec(8, 256, 128, 2, mo.Activation.situ(4.0, None), quant=mo.QuantSpec("mxfp4"))
    why = triton_backend.TritonBackend().unsupported_reason(spec, mo.Platform("cuda", "nvidia", "sm_90"))
    assert why == "situ with up unclipped (linear_beta unset) is not implemented"
