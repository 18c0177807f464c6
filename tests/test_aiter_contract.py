"""Every AITER function the backend calls, and every keyword it passes, against AITER's own
signatures: parsed (never imported) from the installed amd-aiter, and from a newer ROCm/aiter
main recorded in tests/aiter_emulator/aiter_main_contract.json (see record_main.py)."""

import re
import tomllib
from pathlib import Path

import pytest
import torch

import moe_overlay as mo
from moe_overlay.backends.aiter import kernels as aiter_kernels
from moe_overlay.backends.aiter.capability import ACTIVATIONS, PATHS
from moe_overlay.backends.aiter.ops import AITER_FUNCTIONS
from tests.aiter_emulator.layers import CONTRACTS, FP8_TOKEN, PATH_CASES, emulated_backend, random_batch, random_layer
from tests.aiter_emulator.sources import installed_version, main_record

# fused_moe keywords the backend leaves to AITER's default, and the default it relies on
RELIED_ON_DEFAULTS = {
    "a1_scale": "None", "a2_scale": "None",  # dynamic activation quantisation
    "block_size_M": "None", "dtype": "None",  # AITER's tuning; output in the input's dtype
    "hidden_pad": "0", "intermediate_pad": "0", "bias1": "None", "bias2": "None",
    "gate_mode": "GateMode.SEPARATED.value",  # w13 rows: gate, then up
}


def _calls(arch: str, contract: str) -> list[tuple[str, dict]]:
    """Every call the backend makes on `arch` against AITER `contract`: all paths it runs there,
    with expert parallelism, and both routing ops."""
    backend, emulator = emulated_backend(arch, contract)
    cases = [c.spec for c in PATH_CASES if arch in c.archs and (contract == "main" or c.contract == "installed")]
    cases.append(mo.MoESpec(10, 256, 128, 2, expert_map=(-1, 0, -1, 1, 2, -1, -1, 3, -1, -1), quant=FP8_TOKEN))
    for spec in cases:
        experts = mo.PreparedExperts(spec, random_layer(spec), backend)
        experts.prepare()
        experts.apply(*random_batch(spec, m=3))
    logits = torch.randn(5, 16)
    aiter_kernels.softmax_topk(logits, 2, ops_key=backend.ops_key)
    aiter_kernels.biased_grouped_topk(logits, 2, 4, 2, torch.zeros(16), ops_key=backend.ops_key)
    return emulator.calls


@pytest.mark.parametrize("contract", ["installed", "main"])
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_every_call_fits_aiters_signature(arch, contract):
    signatures = CONTRACTS[contract]().functions
    calls = _calls(arch, contract)  # (the emulator also refuses a call that does not fit, as AITER would)
    assert {name for name, _ in calls} == set(AITER_FUNCTIONS)  # each function is exercised
    for name, kwargs in calls:
        unknown, missing = CONTRACTS[contract]().keyword_problems(name, kwargs)
        assert not unknown, f"AITER {contract} {name}() has no keyword {unknown}"
        assert not missing, f"AITER {contract} {name}() needs {missing}"
    passed = {k for name, kwargs in calls if name == "fused_moe" for k in kwargs}
    for keyword, default in RELIED_ON_DEFAULTS.items():
        if keyword in signatures["fused_moe"]:
            assert keyword not in passed and signatures["fused_moe"][keyword] == default, keyword


@pytest.mark.parametrize("contract", ["installed", "main"])
def test_the_enum_members_used_exist(contract):
    enums = CONTRACTS[contract]().enums
    assert {p.quant_type for p in PATHS} <= set(enums["QuantType"])
    members = {aiter for aiter, _ in ACTIVATIONS.values()}
    present = members & set(enums["ActivationType"])
    # SiTU's member is newer than the installed AITER: the capability table asks for it as a feature
    assert present == members if contract == "main" else members - present == {"Situv2"}


def test_the_main_record_covers_every_function_the_real_ops_import():
    # the installed contract is parsed from where the real ops import each function; the main
    # one is a recording, which has to be redone when the backend starts calling another
    assert set(CONTRACTS["main"]().functions) == set(AITER_FUNCTIONS)
    assert all(CONTRACTS["main"]().functions[name] for name in AITER_FUNCTIONS)


def test_versions_checked_are_recorded():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pins = [r for r in pyproject["project"]["optional-dependencies"]["test"] if r.startswith("amd-aiter")]
    assert pins == [f"amd-aiter=={installed_version()}"]
    record = main_record()
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"])
    assert record["version"] == f"main@{record['commit'][:8]}"
