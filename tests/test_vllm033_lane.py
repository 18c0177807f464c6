"""vLLM 0.33, the release the issue's deployments are read against, from its wheel's Python sources
(tests/lanes.py): every config's every node parses, its MoE layers' quant method is the one the CPU
lane names and is mapped, and every hook of the ledger holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lanes import ROOT, assert_config_check, run_with, wheel_sources

VERSION = "0.33.0"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def sources() -> Path:
    return wheel_sources(VERSION)


def test_config_check_names_every_configs_moe_quant_method(sources):
    run = run_with(sources, ["-m", "moe_overlay.cli", "config", "check", *map(str, CONFIGS)])
    assert run.returncode == 0, run.stdout + run.stderr
    assert_config_check(run.stdout, CONFIGS, VERSION)


def test_every_ledger_hook_holds(sources):
    run = run_with(sources, ["-c", "import vllm; from moe_overlay.patches import ledger; "
                                   "print(vllm.__version__); ledger.check()"])
    assert run.returncode == 0 and run.stdout.split()[:1] == [VERSION], run.stdout + run.stderr
