"""The image's own vLLM, not only the CPU lane's: the version docker/Dockerfile pins (BASE_TAG) is
read from its wheel's Python sources (downloaded from PyPI, never installed or imported as a
package of this environment), and with them on the path every config's every node parses and
every hook of the ledger holds. The sources are cached under var/cache/ between runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def pinned_version() -> str:
    match = re.search(r"^ARG BASE_TAG=v(\d+\.\d+\.\d+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, f"{DOCKERFILE}: no ARG BASE_TAG=vX.Y.Z"
    return match.group(1)


@pytest.fixture(scope="module")
def pinned_sources() -> Path:
    version = pinned_version()
    cache = ROOT / "var" / "cache" / f"vllm-{version}-sources"
    if not (cache / "vllm" / "__init__.py").exists():
        download = cache.with_name(cache.name + ".download")
        shutil.rmtree(download, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", str(download), f"vllm=={version}"],
                       check=True, timeout=900)
        [wheel] = download.glob("vllm-*.whl")
        partial = cache.with_name(cache.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(partial, [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")])
        shutil.rmtree(cache, ignore_errors=True)
        partial.rename(cache)
        shutil.rmtree(download)
    return cache


def _with(sources: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    # The CUDA wheel's sources on a machine without a GPU: vLLM's own switch picks its CPU platform.
    env = {**os.environ, "PYTHONPATH": str(sources), "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_every_config_parses_with_the_images_vllm(pinned_sources):
    version = pinned_version()
    run = _with(pinned_sources, ["-m", "moe_overlay.cli", "config", "check", *map(str, CONFIGS)])
    assert run.returncode == 0, run.stdout + run.stderr
    for config in CONFIGS:
        assert re.search(rf"^ok\s+.*{config.name} .*vLLM {re.escape(version)} parses every node", run.stdout,
                         re.MULTILINE), (config.name, run.stdout)


def test_every_ledger_hook_holds_on_the_images_vllm(pinned_sources):
    code = ("import vllm; from moe_overlay.patches import ledger; "
            "print(vllm.__version__, vllm.__file__); ledger.check()")
    run = _with(pinned_sources, ["-c", code])
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[:2] == [pinned_version(), str(pinned_sources / "vllm" / "__init__.py")]
