"""DeepSeek-V3 (and Kimi-K2, which names the same class) with its routed experts on the adapter,
and its multi-token-prediction (MTP) draft.

Upstream's `DeepseekV2MoE` keeps its gate, grouped sigmoid routing with the correction bias,
shared experts and routed scaling; only the `RoutedExperts` of its MoE layers (from
`first_k_dense_replace` on, every `moe_layer_freq`-th) reach the adapter. The dense MLPs and
the attention are no `RoutedExperts`, so they stay upstream's.

The MTP draft (vLLM's speculative method `mtp`, formerly `deepseek_mtp`) is its own architecture,
`DeepSeekMTPModel`, built by vLLM's drafter beside the target: each MTP layer is a
`DeepseekV2DecoderLayer` whose MLP is the same `DeepseekV2MoE`, so its routed experts reach the
adapter the same way, under the draft's own name in `/v1/moe`.
"""

from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP
from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

from .moe_layer import overlay_architecture

OverlayDeepseekV3ForCausalLM = overlay_architecture(DeepseekV3ForCausalLM, __name__)
OverlayDeepSeekMTP = overlay_architecture(DeepSeekMTP, __name__)
