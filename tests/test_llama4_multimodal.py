"""Both Llama-4 architecture names resolve to overlay subclasses of upstream's classes.

`Llama4ForConditionalGeneration` lives in upstream's `mllama4`, whose import pulls transformers'
Llama-4 image processor, which imports torchvision unconditionally; the CPU lane has no
torchvision that imports. In a fresh interpreter, after transformers has found torchvision
absent, empty stand-in modules satisfy that import (the image code is never run), so the check
runs against upstream's real class.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="the registrations point at the installed vLLM's classes")

RESOLVE = """
    import importlib, importlib.abc, importlib.machinery, json, sys, types

    import transformers.image_utils  # noqa: F401  (transformers decides torchvision is absent)
    from vllm.model_executor.models.llama4 import Llama4ForCausalLM

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


def test_both_architectures_resolve_to_overlay_subclasses_of_upstreams_classes():
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(RESOLVE)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for arch in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"):
        assert out[arch] == {"class": f"moe_overlay.models.llama4.Overlay{arch}", "direct_subclass": True,
                             "own_init": True, "same_object_again": True}, arch
    assert "has no attribute 'Llama4ForNothing'" in out["unknown"]


def test_the_text_only_class_needs_no_torchvision():
    code = """
        import sys
        from moe_overlay.models.llama4 import OverlayLlama4ForCausalLM  # noqa: F401
        print(any(m == "vllm.model_executor.models.mllama4" or m.split(".")[0] == "torchvision" for m in sys.modules))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
