"""Kimi-K3 (and standalone Kimi-Linear) with its routed experts on the adapter.

Upstream's package `vllm.models.kimi_k3` picks its nvidia or amd half for the platform.
Its `KimiMoE` builds the MoE layer through `FusedMoEFactory` with upstream's own
`LatentMoERunner`: the gate, the down projection into the latent (outside the runner), the
sigmoid + correction-bias routing, the two shared experts on the full width, the latent
RMSNorm and the up projection (the runner's routed-output transform) all stay upstream's.
Only the `RoutedExperts` inside it reaches the adapter, which runs the experts in the latent
with SiTU(beta, linear beta) from the config. `KimiK3ForConditionalGeneration` builds its text
model through the registry under `KimiLinearForCausalLM`, so both names are overlaid. Its MTP
draft (`KimiK3MTPModel`, speculative method `mtp`) builds each MTP layer as a `KimiDecoderLayer`
with the same `KimiMoE`, so the draft is overlaid too.
"""

from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration, KimiK3MTP, KimiLinearForCausalLM

from .moe_layer import overlay_architecture

OverlayKimiK3ForConditionalGeneration = overlay_architecture(KimiK3ForConditionalGeneration, __name__)
OverlayKimiLinearForCausalLM = overlay_architecture(KimiLinearForCausalLM, __name__)
OverlayKimiK3MTP = overlay_architecture(KimiK3MTP, __name__)
