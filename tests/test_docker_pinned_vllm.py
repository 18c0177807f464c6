"""The image's own vLLM, not only the CPU lane's: the version docker/Dockerfile pins (BASE_TAG) is
read from its wheel's Python sources (tests/lanes.py), and with them on the path every config's every
node parses, its MoE layers' quant method is mapped, and every hook of the ledger holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lanes import CONFIGS, assert_config_check, config_check, pinned_version, run_with, wheel_sources


@pytest.fixture(scope="module")
def pinned_sources() -> Path:
    return wheel_sources(pinned_version())


def test_every_config_parses_with_the_images_vllm():
    run = config_check(pinned_version())
    assert run.returncode == 0, run.stdout + run.stderr
    assert_config_check(run.stdout, CONFIGS, pinned_version())


def test_every_ledger_hook_holds_on_the_images_vllm(pinned_sources):
    code = ("import vllm; from moe_overlay.patches import ledger; "
            "print(vllm.__version__, vllm.__file__); ledger.check()")
    run = run_with(pinned_sources, ["-c", code])
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[:2] == [pinned_version(), str(pinned_sources / "vllm" / "__init__.py")]
