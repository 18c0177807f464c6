"""The image's own vLLM, not only the CPU lane's: the version docker/Dockerfile pins (BASE_TAG) is
read from its wheel's Python sources (tests/lanes.py), and with them on the path every config's every
node parses, its MoE layers' quant method is mapped, and every hook of the ledger holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.lanes import ROOT, assert_config_check, run_with, wheel_sources

DOCKERFILE = ROOT / "docker" / "Dockerfile"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def pinned_version() -> str:
    match = re.search(r"^ARG BASE_TAG=v(\d+\.\d+\.\d+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, f"{DOCKERFILE}: no ARG BASE_TAG=vX.Y.Z"
    return match.group(1)


@pytest.fixture(scope="module")
def pinned_sources() -> Path:
    return wheel_sources(pinned_version())


def test_every_config_parses_with_the_images_vllm(pinned_sources):
    run = run_with(pinned_sources, ["-m", "moe_overlay.cli", "config", "check", *map(str, CONFIGS)])
    assert run.returncode == 0, run.stdout + run.stderr
    assert_config_check(run.stdout, CONFIGS, pinned_version())


def test_every_ledger_hook_holds_on_the_images_vllm(pinned_sources):
    code = ("import vllm; from moe_overlay.patches import ledger; "
            "print(vllm.__version__, vllm.__file__); ledger.check()")
    run = run_with(pinned_sources, ["-c", code])
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[:2] == [pinned_version(), str(pinned_sources / "vllm" / "__init__.py")]
