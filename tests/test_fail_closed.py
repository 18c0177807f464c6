"""Fail closed: a backend asked for in strict mode that cannot run a layer stops the start-up with
one message naming the layer, what was asked and why it cannot run; upstream's layer built by
upstream's factory, and the served tiny Mixtral. (Auto fallback, said in the log and /v1/moe:
tests/test_served_requests.py; the rest of the map: docs/reliability.md.)"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

import moe_overlay as mo
from moe_overlay.models import moe_layer
from moe_overlay.models.moe_layer import OverlayRoutedExperts, adapter_scope
from moe_overlay.serving.builtin_models import ensure_builtin
from moe_overlay.serving.harness import free_port
from tests.e2e import ROOT
from tests.vllm_layers import build_moe, vllm_context

PREFIX = "model.layers.7.block_sparse_moe.experts"
AITER_ON_CPU = r"aiter: .*(ROCm|GPU|gfx)"  # AITER's own reason on this machine


@pytest.fixture
def strict_aiter(monkeypatch):
    monkeypatch.setattr(moe_layer, "SCOPES", [])
    monkeypatch.setenv("MOE_OVERLAY_BACKEND", "aiter")
    monkeypatch.setenv("MOE_OVERLAY_STRICT", "1")
    with vllm_context():
        yield


def test_strict_refusal_names_the_layer_the_backend_and_why(strict_aiter):
    with adapter_scope("MixtralForCausalLM"), pytest.raises(mo.BackendUnavailableError) as err:
        build_moe(num_experts=4, top_k=2, hidden_size=64, intermediate_size=64, quant_config=None,
                  routed_experts_cls=OverlayRoutedExperts, prefix=PREFIX)
    message = str(err.value)
    assert message.startswith(f"{PREFIX}: "), message
    assert "requested" in message
    assert re.search(AITER_ON_CPU, message), message


def test_served_strict_refusal_stops_the_start_with_that_line(tmp_path):
    ensure_builtin("tiny-mixtral")
    raw = yaml.safe_load((ROOT / "configs" / "tiny-mixtral.yaml").read_text())
    raw["moe"] = {"backend": "aiter", "strict": True}
    config = tmp_path / "strict-aiter.yaml"
    config.write_text(yaml.safe_dump(raw))
    result = subprocess.run([sys.executable, "-m", "moe_overlay.cli", "serve", str(config), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=400)
    log = result.stdout + result.stderr
    assert result.returncode != 0
    refusal = [line for line in log.splitlines() if "BackendUnavailableError: model.layers.0.block_sparse_moe" in line]
    assert refusal, log[-3000:]
    assert "requested" in refusal[0] and "aiter" in refusal[0]
