"""The GPU lane (`make test-gpu`) runs on a machine with torch and triton only.

There, and only there (`MOE_OVERLAY_GPU_LANE=1`, set by that target), a test module that cannot
be imported because the serving stack (vLLM, pydantic, lm-eval, YAML, ...) is absent is skipped
with that reason instead of stopping the collection; `make test` installs the stack and runs
those modules. Anywhere else an import error stays an error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

GPU_LANE_ENV = "MOE_OVERLAY_GPU_LANE"
SERVING_STACK = frozenset({
    "vllm", "pydantic", "lm_eval", "yaml", "starlette", "fastapi", "httpx", "requests", "transformers",
    "tokenizers", "safetensors", "compressed_tensors", "aiter",
})


class GpuLaneModule(pytest.Module):
    def _getobj(self):
        try:
            return super()._getobj()
        except self.CollectError as err:
            cause = err.__cause__
            missing = (getattr(cause, "name", None) or "").split(".")[0]
            if isinstance(cause, ModuleNotFoundError) and missing in SERVING_STACK:
                raise pytest.skip.Exception(
                    f"{self.path.name} needs {missing} (the serving stack, installed by `make test`), "
                    "absent on this GPU lane",
                    allow_module_level=True) from None
            raise


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if os.environ.get(GPU_LANE_ENV) == "1":
        return GpuLaneModule.from_parent(parent, path=module_path)
    return None
