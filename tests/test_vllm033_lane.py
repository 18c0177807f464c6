"""vLLM 0.33, the release the issue's deployments are read against, from its wheel's Python sources
(tests/lanes.py): every config's every node parses, its MoE layers' quant method is the one the CPU
lane names and is mapped, and every hook of the ledger holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lanes import CONFIGS, NEWEST, assert_config_check, config_check, run_with, wheel_sources


@pytest.fixture(scope="module")
def sources() -> Path:
    return wheel_sources(NEWEST)


def test_config_check_names_every_configs_moe_quant_method():
    run = config_check(NEWEST)
    assert run.returncode == 0, run.stdout + run.stderr
    assert_config_check(run.stdout, CONFIGS, NEWEST)


def test_every_ledger_hook_holds(sources):
    run = run_with(sources, ["-c", "import vllm; from moe_overlay.patches import ledger; "
                                   "print(vllm.__version__); ledger.check()"])
    assert run.returncode == 0 and run.stdout.split()[:1] == [NEWEST], run.stdout + run.stderr
