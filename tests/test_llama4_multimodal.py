"""`Llama4ForConditionalGeneration` (the class the published Maverick checkpoints name) and the
text-only `Llama4ForCausalLM` resolve to overlay subclasses of upstream's classes, and the
multimodal one puts its language model's MoE layers on the adapter.

The multimodal class lives in upstream's `mllama4`, whose import pulls transformers' Llama-4
image processor, which imports torchvision unconditionally; the CPU lane has no torchvision that
imports. So these checks run in a fresh interpreter where, after transformers has found
torchvision absent, empty stand-in modules satisfy that import (no image code runs): the classes
checked are upstream's real ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.e2e import ROOT

pytest.importorskip("vllm", reason="the registrations point at the installed vLLM's classes")

STAND_INS = """
    import importlib, importlib.abc, importlib.machinery, sys, types

    import transformers.image_utils  # noqa: F401  (transformers decides torchvision is absent)

    class _Anything(type):
        def __getattr__(cls, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return cls

    class _Empty(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Anything(attr, (), {})

    class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torchvision":
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            return _Empty(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    sys.meta_path.insert(0, _StandIns())
"""

RESOLVE = """
    import json

    from vllm.model_executor.models.llama4 import Llama4ForCausalLM
    from vllm.model_executor.models.mllama4 import Llama4ForConditionalGeneration

    from moe_overlay.models import llama4
    from moe_overlay.patches.plugin import ARCHITECTURES

    out = {}
    for arch, upstream in (("Llama4ForCausalLM", Llama4ForCausalLM),
                           ("Llama4ForConditionalGeneration", Llama4ForConditionalGeneration)):
        module, name = ARCHITECTURES[arch].split(":")
        cls = getattr(importlib.import_module(module), name)
        out[arch] = {"class": f"{cls.__module__}.{cls.__qualname__}",
                     "direct_subclass": cls.__bases__ == (upstream,),
                     "own_init": "__init__" in vars(cls),
                     "same_object_again": getattr(llama4, name) is cls}
    try:
        llama4.Llama4ForNothing
    except AttributeError as err:
        out["unknown"] = str(err)
    print(json.dumps(out))
"""

# The bf16 twin as the published bf16 checkpoint is laid out: config.json with `text_config` and
# `vision_config` (a one-layer vision tower), tensors under `language_model.` (no vision weights:
# only the language model is checked). Built by upstream's class, loaded by its own
# `load_weights`, each MoE block compared with the published maths of tests/test_llama4_moe.py.
MULTIMODAL = """
    import json, shutil, tempfile
    from pathlib import Path

    import torch
    import vllm.model_executor.models.registry as registry
    from safetensors.torch import load_file, save_file
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from moe_overlay.models.llama4 import OverlayLlama4ForConditionalGeneration
    from moe_overlay.models.moe_layer import OverlayMoEMethod
    from moe_overlay.models.tiny import RECIPES
    from moe_overlay.serving.builtin_models import ensure_builtin
    from tests.test_llama4_moe import MOE_LAYERS, Built, _assert_published_maths, _overlay
    from tests.vllm_layers import vllm_context

    registry._run_in_subprocess = lambda inspect: inspect()  # inspect here, where the stand-ins are
    twin = ensure_builtin("tiny-llama4-maverick")
    folder = Path(tempfile.mkdtemp(prefix="tiny-llama4-multimodal-"))
    for f in twin.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, folder / f.name)
    text = json.loads((twin / "config.json").read_text())
    text.pop("architectures")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "intermediate_size": 128, "image_size": 56, "patch_size": 14,
                          "vision_output_dim": 64, "projector_input_dim": 64, "projector_output_dim": 64,
                          "pixel_shuffle_ratio": 0.5, "rope_theta": 10000},
        "boi_token_index": 200080, "eoi_token_index": 200081, "image_token_index": 200092,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    checkpoint = load_file(str(twin / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in checkpoint.items()}, str(folder / "model.safetensors"))

    model_config = ModelConfig(model=str(folder), dtype=torch.float32, max_model_len=512, enforce_eager=True)
    config = VllmConfig(model_config=model_config)
    with vllm_context(), set_current_vllm_config(config), _overlay(True):
        with set_default_torch_dtype(torch.float32), torch.device("cpu"):
            model = initialize_model(vllm_config=config, model_class=OverlayLlama4ForConditionalGeneration)
        model.load_weights((f"language_model.{k}", v) for k, v in checkpoint.items())
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    on_adapter = sorted(n for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None),
                                                                           OverlayMoEMethod))
    assert on_adapter == [f"language_model.model.layers.{i}.feed_forward.experts.routed_experts"
                          for i in MOE_LAYERS], on_adapter
    built = Built(model.language_model, config, checkpoint, RECIPES["tiny-llama4-maverick"], torch.float32)
    for layer in MOE_LAYERS:
        _assert_published_maths(built, layer)
    shutil.rmtree(folder)
    print("ok", on_adapter)
"""


def _python(*parts: str) -> str:
    code = "".join(textwrap.dedent(p) for p in parts)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.strip().splitlines()[-1]


def test_both_architectures_resolve_to_overlay_subclasses_of_upstreams_classes():
    out = json.loads(_python(STAND_INS, RESOLVE))
    for arch in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"):
        assert out[arch] == {"class": f"moe_overlay.models.llama4.Overlay{arch}", "direct_subclass": True,
                             "own_init": True, "same_object_again": True}, arch
    assert "has no attribute 'Llama4ForNothing'" in out["unknown"]


def test_multimodal_class_runs_its_language_models_moe_layers_on_the_adapter():
    assert _python(STAND_INS, MULTIMODAL).startswith("ok ")


def test_the_text_only_class_needs_no_torchvision():
    code = """
        import sys
        from moe_overlay.models.llama4 import OverlayLlama4ForCausalLM  # noqa: F401
        print(any(m == "vllm.model_executor.models.mllama4" or m.split(".")[0] == "torchvision" for m in sys.modules))
    """
    assert _python(code) == "False"
