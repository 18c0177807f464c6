"""The general plugin in a fresh interpreter: idempotent, kill switch, what it installs;
and the adapter core never imports vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_OVERLAY_")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**full_env, **(env or {})})


INSPECT = """
    import json
    from moe_overlay.patches.plugin import register
    register(); register()
    from vllm import ModelRegistry
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.worker.worker_base import WorkerBase
    oot = op_registry_oot.get("RoutedExperts")
    print(json.dumps({
        "oot": None if oot is None else f"{oot.__module__}.{oot.__name__}",
        "rpc": hasattr(WorkerBase, "moe_overlay_describe"),
        "mixtral": str(ModelRegistry.models["MixtralForCausalLM"]),
    }))
"""


def test_register_is_idempotent_and_installs_the_hooks():
    result = _python(INSPECT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("plugin active") == 1
    state = json.loads(result.stdout.strip().splitlines()[-1])
    assert state["oot"] == "moe_overlay.models.moe_layer.OverlayRoutedExperts"
    assert state["rpc"] is True
    assert "moe_overlay.models.mixtral" in state["mixtral"] and "OverlayMixtralForCausalLM" in state["mixtral"]


def test_kill_switch_installs_nothing():
    result = _python(INSPECT, {"MOE_OVERLAY_DISABLE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("disabled by MOE_OVERLAY_DISABLE=1") == 1 and "plugin active" not in result.stderr
    state = json.loads(result.stdout.strip().splitlines()[-1])
    assert state["oot"] is None and state["rpc"] is False and "moe_overlay" not in state["mixtral"]


def test_vllm_plugins_allow_list_is_respected():
    code = """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    """
    assert "plugin active" in _python(code, {"VLLM_PLUGINS": "moe_overlay"}).stderr
    assert "plugin active" not in _python(code, {"VLLM_PLUGINS": "some_other_plugin"}).stderr


def test_core_imports_torch_only():
    result = _python("""
        import sys
        import moe_overlay, moe_overlay.routing, moe_overlay.quant, moe_overlay.activations
        from moe_overlay.backends import reference
        heavy = sorted(m for m in ("vllm", "yaml", "fastapi", "transformers", "aiter", "triton")
                       if m in sys.modules)
        print(heavy)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
