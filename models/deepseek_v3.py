"""DeepSeek-V3 (and Kimi-K2, which names the same class) with its routed experts on the adapter.

Upstream's `DeepseekV2MoE` keeps its gate, grouped sigmoid routing with the correction bias,
shared experts and routed scaling; only the `RoutedExperts` of its MoE layers (from
`first_k_dense_replace` on, every `moe_layer_freq`-th) reach the adapter. The dense MLPs and
the attention are no `RoutedExperts`, so they stay upstream's.
"""

from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

from .moe_layer import overlay_architecture

OverlayDeepseekV3ForCausalLM = overlay_architecture(DeepseekV3ForCausalLM, __name__)
