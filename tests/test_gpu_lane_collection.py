"""`make test-gpu` collects on a machine without the serving stack (tests/conftest.py), and
nowhere else does an import error turn into a skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _pytest(folder: Path, gpu_lane: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MOE_OVERLAY_GPU_LANE"}
    if gpu_lane:
        env["MOE_OVERLAY_GPU_LANE"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_kernel.py").write_text("def test_kernel():\n    assert 1 + 1 == 2\n")
    # yaml made unimportable the way a machine without it fails: ModuleNotFoundError naming it
    (tmp_path / "test_serving.py").write_text(
        "import sys\nsys.modules['yaml'] = None\nimport yaml\n\ndef test_serving():\n    pass\n")
    return tmp_path


def test_on_the_gpu_lane_a_missing_serving_package_skips_its_module(suite):
    run = _pytest(suite, gpu_lane=True)
    assert run.returncode == 0, run.stdout
    assert "1 passed, 1 skipped" in run.stdout
    assert "test_serving.py needs yaml (the serving stack" in run.stdout


def test_elsewhere_the_same_import_error_fails(suite):
    run = _pytest(suite, gpu_lane=False)
    assert run.returncode != 0 and "ModuleNotFoundError" in run.stdout


def test_on_the_gpu_lane_any_other_missing_module_still_fails(suite):
    (suite / "test_typo.py").write_text("import moe_overlay_no_such_module\n")
    run = _pytest(suite, gpu_lane=True)
    assert run.returncode != 0 and "moe_overlay_no_such_module" in run.stdout
