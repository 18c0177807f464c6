"""Mixtral with its MoE layers on the prepared-MoE adapter."""

from vllm.model_executor.models.mixtral import MixtralForCausalLM

from .moe_layer import overlay_architecture

OverlayMixtralForCausalLM = overlay_architecture(MixtralForCausalLM, __name__)
