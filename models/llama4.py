"""Llama-4 (Maverick) with its routed experts on the adapter.

Upstream's `Llama4MoE` keeps its router (top-1 on the logits, weight = sigmoid of the chosen
logit, applied to the experts' input) and its shared expert (a plain `LlamaMLP` that the MoE
runner adds to the routed output); only the `RoutedExperts` of its MoE layers (every
`interleave_moe_layer_step`-th layer) reach the adapter. Dense layers, attention and the
vision tower build no `RoutedExperts`, so they stay upstream's.

`Llama4ForConditionalGeneration` builds its language model from upstream's `Llama4ForCausalLM`
inside its own `__init__`, so the scope of the overlay class covers those MoE layers too. Its
module imports torchvision (through transformers' Llama-4 image processor), which the CPU lane
cannot import: that class is built on first access, so the text-only class never needs it.
"""

from vllm.model_executor.models.llama4 import Llama4ForCausalLM

from .moe_layer import overlay_architecture

OverlayLlama4ForCausalLM = overlay_architecture(Llama4ForCausalLM, __name__)


def __getattr__(name: str) -> type:
    if name != "OverlayLlama4ForConditionalGeneration":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.model_executor.models.mllama4 import Llama4ForConditionalGeneration

    overlay = overlay_architecture(Llama4ForConditionalGeneration, __name__)
    globals()[name] = overlay  # built once
    return overlay
