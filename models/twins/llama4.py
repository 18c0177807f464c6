"""tiny-llama4-maverick and tiny-llama4-maverick-fp8: Llama-4 Maverick's text model at tiny sizes.

The text-only `Llama4ForCausalLM` with the keys of Maverick's `text_config`: top-1 routing over
`num_local_experts` with the sigmoid weight applied to the experts' input, one shared expert
beside the routed ones, MoE in every `interleave_moe_layer_step`-th layer (dense MLPs of
`intermediate_size_mlp` between), chunked local attention on RoPE layers and a NoPE layer every
fourth (`no_rope_layers`). The CPU lane needs `attention_chunk_size` to be a multiple of its
KV block size (128 unless `block-size` is set) and `head_dim >= 32`; the multimodal
`Llama4ForConditionalGeneration` wrapper needs torchvision, which the CPU lane cannot import.

bf16 twin: the experts fused per layer as the bf16 checkpoint stores them
(`feed_forward.experts.gate_up_proj [E, H, 2I]`, gate columns first, and `down_proj [E, I, H]`).
fp8 twin: the same weights with the routed experts stored as the FP8 checkpoint stores them:
one tensor per expert and projection (`feed_forward.experts.<e>.gate_proj.weight`,
float8_e4m3fn) with a per-output-channel `weight_scale [N, 1]`, under a compressed-tensors
`float-quantized` config (weights per channel, activations dynamic per token); everything else
(attention, router, shared expert, dense MLPs, lm_head) is in `ignore` and stays bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tiny import Recipe, Tokens, register, write_checkpoint

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_quantization_config(ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors `float-quantized`: fp8 weights per output channel (static scales),
    fp8 activations quantised per token at run time; `ignore` lists the unquantised modules.

    What the published FP8 Maverick uses, from upstream's tests and trackers (its config.json
    itself was not reachable here): vLLM's reduced-Maverick test writes per-expert
    `weight_scale [N, 1]` and no scales for attention, router or shared expert
    (tests/models/multimodal/generation/test_maverick.py); vllm#16537 enabled per-channel
    weights with per-token activations in CompressedTensorsW8A8Fp8MoEMethod for Llama-4 FP8;
    sglang#5134 loads it through a compressed-tensors scheme; TensorRT-LLM#3554 calls it "row-wise".
    """
    common = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
              "block_structure": None, "actorder": None, "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**common, "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {**common, "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None,
        }},
        "ignore": ignore,
    }


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [N, K]` -> (float8_e4m3fn `[N, K]`, bf16 `scale [N, 1]`) with weight ~ q * scale."""
    import torch

    scale = (weight.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12).to(torch.bfloat16)
    q = (weight.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


@dataclass(frozen=True)
class TinyLlama4Recipe(Recipe):
    architecture: str = "Llama4ForCausalLM"
    hidden_size: int = 128
    intermediate_size: int = 128  # each routed expert and the shared expert (Maverick: 8192)
    intermediate_size_mlp: int = 256  # the dense layers (Maverick: 16384)
    num_hidden_layers: int = 4
    interleave_moe_layer_step: int = 2  # layers 1 and 3 are MoE
    no_rope_layers: tuple[int, ...] = (1, 1, 1, 0)  # 0 = NoPE (global attention), every 4th as Maverick
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention rejects smaller
    num_local_experts: int = 8
    num_experts_per_tok: int = 1
    attention_chunk_size: int = 128  # a multiple of the CPU lane's default KV block size (128)
    max_position_embeddings: int = 1048576
    rope_theta: float = 500000.0
    weight_std: float = 0.08  # wide enough that greedy choices are not near-ties
    fp8: bool = False
    seed: int = 20261201

    def moe_layers(self) -> list[int]:
        step = self.interleave_moe_layer_step
        return [i for i in range(self.num_hidden_layers) if step > 0 and (i + 1) % step == 0]

    def config(self, tokens: Tokens) -> dict[str, Any]:
        """config.json: Maverick's `text_config` keys, as a text-only checkpoint has them."""
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "llama4_text",
            "attention_bias": False,
            "attention_chunk_size": self.attention_chunk_size,
            "attention_dropout": 0.0,
            "attn_scale": 0.1,
            "attn_temperature_tuning": True,
            "bos_token_id": tokens.bos_token_id,
            "eos_token_id": tokens.eos_token_id,
            "floor_scale": 8192,
            "for_llm_compressor": False,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.weight_std,
            "interleave_moe_layer_step": self.interleave_moe_layer_step,
            "intermediate_size": self.intermediate_size,
            "intermediate_size_mlp": self.intermediate_size_mlp,
            "max_position_embeddings": self.max_position_embeddings,
            "no_rope_layers": list(self.no_rope_layers),
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_local_experts": self.num_local_experts,
            "output_router_logits": False,
            "pad_token_id": tokens.eos_token_id,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_qk_norm": False,
            "vocab_size": tokens.vocab_size,
        }
        if self.fp8:
            config["quantization_config"] = fp8_quantization_config(self.unquantized_modules())
        return config

    def unquantized_modules(self) -> list[str]:
        """Every Linear of the checkpoint except the routed experts' projections."""
        names = []
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            names += [f"{p}.self_attn.{proj}" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")]
            mlp = f"{p}.feed_forward.shared_expert" if i in self.moe_layers() else f"{p}.feed_forward"
            names += [f"{mlp}.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")]
            if i in self.moe_layers():
                names.append(f"{p}.feed_forward.router")
        return [*names, "lm_head"]

    def tensors(self, tokens: Tokens) -> dict[str, torch.Tensor]:
        import torch

        gen = torch.Generator().manual_seed(self.seed)

        def normal(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * self.weight_std).to(torch.bfloat16)

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(self.hidden_size, generator=gen)).to(torch.bfloat16)

        h, i_moe, e = self.hidden_size, self.intermediate_size, self.num_local_experts
        q_out, kv_out = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        out = {"model.embed_tokens.weight": normal(tokens.vocab_size, h)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}"
            out.update({
                f"{p}.input_layernorm.weight": norm(),
                f"{p}.post_attention_layernorm.weight": norm(),
                f"{p}.self_attn.q_proj.weight": normal(q_out, h),
                f"{p}.self_attn.k_proj.weight": normal(kv_out, h),
                f"{p}.self_attn.v_proj.weight": normal(kv_out, h),
                f"{p}.self_attn.o_proj.weight": normal(h, q_out),
            })
            if layer not in self.moe_layers():
                i_mlp = self.intermediate_size_mlp
                out.update({f"{p}.feed_forward.gate_proj.weight": normal(i_mlp, h),
                            f"{p}.feed_forward.up_proj.weight": normal(i_mlp, h),
                            f"{p}.feed_forward.down_proj.weight": normal(h, i_mlp)})
                continue
            ff = f"{p}.feed_forward"
            out.update({f"{ff}.router.weight": normal(e, h),
                        f"{ff}.shared_expert.gate_proj.weight": normal(i_moe, h),
                        f"{ff}.shared_expert.up_proj.weight": normal(i_moe, h),
                        f"{ff}.shared_expert.down_proj.weight": normal(h, i_moe)})
            gate_up, down = normal(e, h, 2 * i_moe), normal(e, i_moe, h)  # [E, in, out] as bf16 Maverick
            out.update(self._experts(ff, gate_up, down))
        out["model.norm.weight"] = norm()
        out["lm_head.weight"] = normal(tokens.vocab_size, h)
        return out

    def _experts(self, ff: str, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.fp8:
            return {f"{ff}.experts.gate_up_proj": gate_up, f"{ff}.experts.down_proj": down}
        out = {}
        i_moe = self.intermediate_size
        for e in range(self.num_local_experts):
            projections = {"gate_proj": gate_up[e, :, :i_moe].T, "up_proj": gate_up[e, :, i_moe:].T,
                           "down_proj": down[e].T}  # [out, in] as nn.Linear stores them
            for name, weight in projections.items():
                q, scale = quantize_fp8_per_channel(weight)
                out[f"{ff}.experts.{e}.{name}.weight"] = q
                out[f"{ff}.experts.{e}.{name}.weight_scale"] = scale
        return out

    def write(self, out: Path, tokens: Tokens) -> str:
        n_params = write_checkpoint(out, self.config(tokens), self.tensors(tokens))
        fmt = "fp8 per-channel experts (compressed-tensors)" if self.fp8 else "bf16"
        return (f"{n_params / 1e6:.2f} M parameters, {self.num_local_experts} experts top-1, "
                f"MoE layers {self.moe_layers()}, {fmt}")


register("tiny-llama4-maverick", TinyLlama4Recipe())
register("tiny-llama4-maverick-fp8", TinyLlama4Recipe(fp8=True))
