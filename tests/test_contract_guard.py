"""The contract guard against the installed vLLM: passes as installed, refuses drift by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="these tests check the glue against the installed vLLM")
import vllm
from vllm.model_executor.custom_op import PluggableLayer
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from moe_overlay.patches import ledger, plugin
from moe_overlay.patches.contract import ContractDriftError, Expect

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-mixtral.yaml"


def test_installed_vllm_matches_every_hook():
    assert ledger.problems() == []
    assert all(hook.why and hook.upstream_issue and hook.remove_when and hook.expects for hook in ledger.LEDGER)


def test_missing_parameter_is_named(monkeypatch):
    def drifted(self, prefix, quant_config):  # upstream dropped moe_config
        raise AssertionError("never called")

    monkeypatch.setattr(RoutedExperts, "_get_quant_method", drifted)
    with pytest.raises(ContractDriftError) as err:
        ledger.check()
    message = str(err.value)
    assert "RoutedExperts._get_quant_method: expected parameters (self, prefix, quant_config, moe_config), " \
           "found (self, prefix, quant_config)" in message
    assert f"vLLM {vllm.__version__}" in message and "Refusing to start" in message


def test_missing_symbol_is_named(monkeypatch):
    monkeypatch.delattr(PluggableLayer, "register_oot")
    with pytest.raises(ContractDriftError, match=r"PluggableLayer\.register_oot: expected to exist, found "
                                                 r"'register_oot' is missing"):
        ledger.check()


def test_expect_tolerates_new_optional_parameters_only():
    def grown(a, b, c=1):
        return a

    def stricter(a, b, c):
        return a

    here = f"{__name__}:"
    globals().update(grown=grown, stricter=stricter)
    assert Expect(here + "grown", ("a", "b")).problem() is None
    assert "expected parameters (a, b), found (a, b, c)" in Expect(here + "stricter", ("a", "b")).problem()
    assert "cannot be imported" in Expect("no_such_module_xyz:thing").problem()
    assert Expect(here + "grown", mentions=("return a",)).problem() is None
    assert "expected its source to use ['c * 2']" in Expect(here + "grown", mentions=("return a", "c * 2")).problem()


def test_a_quant_method_the_table_reads_is_guarded(monkeypatch):
    """A class of the quant-method table that moved, or a parameter name it no longer registers,
    refuses to start by name."""
    import vllm.model_executor.layers.quantization.fp8 as fp8

    from moe_overlay.models import quant_methods

    assert {e.symbol for e in next(h for h in ledger.LEDGER if h.name == "quant-method-table").expects} >= set(
        quant_methods.QUANT_METHODS)
    monkeypatch.delattr(fp8, "Fp8MoEMethod")
    with pytest.raises(ContractDriftError, match=r"quantization\.fp8:Fp8MoEMethod: expected to exist"):
        ledger.check()
    monkeypatch.undo()
    renamed = next(h for h in ledger.LEDGER if h.name == "quant-method-table").expects[1]
    drifted = Expect(renamed.symbol, mentions=(*renamed.mentions, '"w13_weight_packed_v2"'))
    assert "expected its source to use ['\"w13_weight_packed_v2\"']" in drifted.problem()


def test_plugin_refuses_to_install_on_drift(monkeypatch):
    monkeypatch.setattr(RoutedExperts, "forward_modular", lambda self, x: x)
    monkeypatch.setattr(plugin, "_installed_in_pid", None)
    monkeypatch.delenv("MOE_OVERLAY_DISABLE", raising=False)
    with pytest.raises(ContractDriftError, match=r"RoutedExperts\.forward_modular: expected parameters"):
        plugin.register()


def test_serve_refuses_drift_with_one_line(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        def weight_loader(self, param, loaded_weight, weight_name, shard_id):  # expert_id gone
            pass
        RoutedExperts.weight_loader = weight_loader
        from moe_overlay.cli import main
        sys.exit(main(["serve", {str(CONFIG)!r}, "--port", "0"]))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("moe-overlay serve")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "RoutedExperts.weight_loader: expected parameters (self, param, loaded_weight, weight_name, " \
           "shard_id, expert_id, return_success), found (self, param, loaded_weight, weight_name, shard_id)" in lines[0]


def test_every_overlay_architecture_subclasses_the_class_upstream_registers_for_it():
    """Under each architecture name the overlay registers a subclass of the very class upstream's
    registry names for it (a draft's name differs from its class: DeepSeekMTPModel is DeepSeekMTP),
    whose constructor takes what the overlay passes."""
    import importlib

    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS, _VLLM_MODELS

    for arch, target in plugin.ARCHITECTURES.items():
        module, name = target.split(":")
        if arch == "Llama4ForConditionalGeneration":
            continue  # its upstream module imports torchvision, absent on the CPU lane (tests/test_llama4_*)
        overlay = getattr(importlib.import_module(module), name)
        base = overlay.__mro__[1]
        upstream_module, upstream_class = (_VLLM_MODELS | _SPECULATIVE_DECODING_MODELS)[arch]
        assert base.__name__ == upstream_class and base.__module__.startswith("vllm.")
        assert base.__module__.endswith(upstream_module) or base.__module__.startswith(upstream_module + ".")
        ledger.check_architecture(base)  # passes as installed


class Drifted:
    """An upstream model class that renamed vllm_config."""

    def __init__(self, *, config, prefix: str = "") -> None:
        raise AssertionError("never called")


def test_an_architecture_whose_constructor_drifted_is_refused_by_name():
    from moe_overlay.models.moe_layer import overlay_architecture

    with pytest.raises(ContractDriftError, match=r"Drifted\.__init__: expected parameters \(self, vllm_config, "
                                                 r"prefix\), found \(self, config, prefix\).*Refusing to start"):
        overlay_architecture(Drifted, __name__)
