"""tiny-kimi-k3: Kimi-K3's checkpoint layout (KimiK3ForConditionalGeneration, text model
kimi_linear) at tiny sizes, in its published compressed-tensors `mxfp4-pack-quantized` format.

Every feature of the real MoE block is there: a dense layer 0, the latent projection
(`routed_expert_down_proj` / `routed_expert_norm` / `routed_expert_up_proj`), sigmoid
routing with a correction bias, two shared experts on the full width, SiTU with both betas,
and KDA + gated NoPE MLA layers as the config lists them (1-based). The config keys and the
quantization_config are the published ones (nested in text_config); tensor names are the
checkpoint's (`language_model.model.layers.N...`). As in the published shards, only the
routed experts are packed (`experts.E.w1|w2|w3.weight_packed`: e2m1 nibbles, low nibble = even
column; `.weight_scale`: e8m0 per 32 columns); the latent projections, shared experts, gate,
attention and dense MLP are dense `.weight`. The vision tower's weights are not written: serve
it text-only.

After the last decoder layer comes one multi-token-prediction (MTP) layer, the draft of vLLM's
speculative method `mtp` (`KimiK3MTPModel`; the main model's loader skips its weights), named as
upstream's draft loader reads it: a decoder layer at index `num_hidden_layers` (gated NoPE MLA, as
the draft picks for an index outside `kda_layers`, and the same latent MoE with packed routed
experts) without the main layers' attention-residual weights, which the draft does not build, plus
`enorm`, `hnorm`, `eh_proj` and `shared_head.norm`, with copies of the embedding and of lm_head as
`embed_tokens` and `shared_head.head`. Its tensors are drawn after every other, so the rest of the
checkpoint is the same with or without it. Whether the published checkpoint carries MTP layers is
not known here (README's support matrix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tiny import Recipe, Tokens, register, write_checkpoint

if TYPE_CHECKING:
    import torch


def mxfp4_quantization_config() -> dict[str, Any]:
    """Kimi-K3's published compressed-tensors block, key for key: MXFP4 weights (group 32, e8m0
    scales, activations unquantised). Its ignore list does not name the latent projections, but
    the published shards store them dense (see the module docstring)."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
               "observer_kwargs": {}, "scale_dtype": "torch.uint8", "zp_dtype": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "mxfp4-pack-quantized"}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


MEDIA_PROC_CFG = {"patch_size": 14, "merge_kernel_size": 2, "temporal_merge_kernel_size": 4,
                  "in_patch_limit": 16384, "in_patch_limit_each_frame": 4096, "patch_limit_on_one_side": 512,
                  "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


@dataclass(frozen=True)
class TinyKimiK3Recipe(Recipe):
    architecture: str = "KimiK3ForConditionalGeneration"
    hidden_size: int = 128
    routed_expert_hidden_size: int = 64  # the latent the routed experts run in (real: 7168 -> 3584)
    intermediate_size: int = 256  # dense layer 0
    moe_intermediate_size: int = 64
    num_experts: int = 32
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    routed_scaling_factor: float = 2.0  # real: 1.0; not 1 here so a lost or doubled scaling shows
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 1  # one MTP layer (MoE, MLA) after the last, the `mtp` draft
    full_attn_layers: tuple[int, ...] = (4,)  # 1-based, as the config has them; the others are KDA
    num_attention_heads: int = 2
    q_lora_rank: int = 64
    kv_lora_rank: int = 512  # + qk_rope_head_dim = 576: a latent head vLLM's CPU MLA accepts
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 64
    v_head_dim: int = 32
    kda_num_heads: int = 2
    kda_head_dim: int = 32
    short_conv_kernel_size: int = 4
    attn_res_block_size: int = 2
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1024
    initializer_range: float = 0.08
    seed: int = 20261201

    def text_config(self, tokens: Tokens) -> dict[str, Any]:
        layers = range(1, self.num_hidden_layers + 1)
        return {
            "model_type": "kimi_linear",
            "vocab_size": tokens.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "hidden_act": "situ",
            "activation_situ_beta": self.activation_situ_beta,
            "activation_situ_linear_beta": self.activation_situ_linear_beta,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "bos_token_id": tokens.bos_token_id,
            "eos_token_id": tokens.eos_token_id,
            "pad_token_id": tokens.eos_token_id,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": 1,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": True,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "attn_res_block_size": self.attn_res_block_size,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "linear_attn_config": {
                "kda_layers": [n for n in layers if n not in self.full_attn_layers],
                "full_attn_layers": list(self.full_attn_layers),
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "gate_lower_bound": -5.0,
                "use_full_rank_gate": True,
            },
            "quantization_config": mxfp4_quantization_config(),
            "architectures": ["KimiLinearForCausalLM"],
            "dtype": "float32",
        }

    def config(self, tokens: Tokens) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": "kimi_k3",
            "text_config": self.text_config(tokens),
            "vision_config": {"model_type": "kimi_k3_vision", "patch_size": 14, "vt_hidden_size": 64,
                              "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
                              "vt_intermediate_size": 128, "merge_kernel_size": [2, 2],
                              "text_hidden_size": self.hidden_size},
            "media_placeholder_token_id": tokens.vocab_size - 1,
            "image_placeholder": "<|kimi_image_placeholder|>",
            "ignore_index": -100,
            "bos_token_id": tokens.bos_token_id,
            "eos_token_id": tokens.eos_token_id,
            "pad_token_id": tokens.eos_token_id,
            "tie_word_embeddings": False,
            "dtype": "float32",
        }

    def tensors(self, vocab_size: int) -> dict[str, torch.Tensor]:
        import torch

        from moe_overlay.quant import quantize_mxfp4

        gen = torch.Generator().manual_seed(self.seed)
        h, lat, moe_i = self.hidden_size, self.routed_expert_hidden_size, self.moe_intermediate_size

        def rand(*shape: int, std: float = self.initializer_range) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        def norm(n: int) -> torch.Tensor:
            return 1.0 + rand(n, std=0.1)

        out = {
            "language_model.model.embed_tokens.weight": rand(vocab_size, h, std=1.0),
            "language_model.lm_head.weight": rand(vocab_size, h),
            "language_model.model.norm.weight": norm(h),
            "language_model.model.output_attn_res_norm.weight": norm(h),
            "language_model.model.output_attn_res_proj.weight": rand(1, h),
        }

        def decoder_layer(i: int, attn_res: bool = True) -> dict[str, torch.Tensor]:
            p = f"language_model.model.layers.{i}."
            layer: dict[str, torch.Tensor] = {}
            norms = ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm")
            for name in norms if attn_res else norms[:2]:
                layer[f"{p}{name}.weight"] = norm(h)
            if attn_res:
                layer[f"{p}self_attention_res_proj.weight"] = rand(1, h)
                layer[f"{p}mlp_res_proj.weight"] = rand(1, h)
            attn = self._mla(rand, norm) if not self.is_kda_layer(i) else self._kda(rand, norm)
            layer.update({f"{p}self_attn.{k}": v for k, v in attn.items()})
            if i < self.first_k_dense_replace:
                layer[f"{p}mlp.gate_proj.weight"] = rand(self.intermediate_size, h)
                layer[f"{p}mlp.up_proj.weight"] = rand(self.intermediate_size, h)
                layer[f"{p}mlp.down_proj.weight"] = rand(h, self.intermediate_size)
                return layer
            m = f"{p}block_sparse_moe."
            shared = moe_i * self.num_shared_experts
            layer[f"{m}gate.weight"] = rand(self.num_experts, h)
            layer[f"{m}gate.e_score_correction_bias"] = rand(self.num_experts, std=0.1)
            layer[f"{m}shared_experts.gate_proj.weight"] = rand(shared, h)
            layer[f"{m}shared_experts.up_proj.weight"] = rand(shared, h)
            layer[f"{m}shared_experts.down_proj.weight"] = rand(h, shared)
            layer[f"{m}routed_expert_down_proj.weight"] = rand(lat, h, std=1.0 / h**0.5)
            layer[f"{m}routed_expert_norm.weight"] = norm(lat)
            layer[f"{m}routed_expert_up_proj.weight"] = rand(h, lat)
            for w, full in (("w1", rand(self.num_experts, moe_i, lat, std=0.5)),
                            ("w3", rand(self.num_experts, moe_i, lat, std=0.5)),
                            ("w2", rand(self.num_experts, lat, moe_i, std=0.5))):
                packed, scale = quantize_mxfp4(full)
                for e in range(self.num_experts):
                    layer[f"{m}experts.{e}.{w}.weight_packed"] = packed[e]
                    layer[f"{m}experts.{e}.{w}.weight_scale"] = scale[e]
            return layer

        for i in range(self.num_hidden_layers):
            out |= decoder_layer(i)
        # The MTP layers, drawn last: the decoder layer the draft builds (no attention residuals) and
        # what joins the token's embedding to the target's hidden state, with the shared embedding and head.
        for i in self.mtp_layers():
            p = f"language_model.model.layers.{i}."
            out |= decoder_layer(i, attn_res=False) | {
                f"{p}embed_tokens.weight": out["language_model.model.embed_tokens.weight"].clone(),
                f"{p}enorm.weight": norm(h), f"{p}hnorm.weight": norm(h),
                f"{p}eh_proj.weight": rand(h, 2 * h),
                f"{p}shared_head.norm.weight": norm(h),
                f"{p}shared_head.head.weight": out["language_model.lm_head.weight"].clone(),
            }
        return out

    def is_kda_layer(self, i: int) -> bool:
        """As upstream's KimiLinearConfig.is_kda_layer: 0-based `i`, 1-based lists; MTP layers are MLA."""
        return i < self.num_hidden_layers and i + 1 not in self.full_attn_layers

    def mtp_layers(self) -> range:
        return range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers)

    def _kda(self, rand, norm) -> dict[str, torch.Tensor]:
        import torch

        h, d, heads = self.hidden_size, self.kda_head_dim, self.kda_num_heads
        proj = d * heads
        out = {f"{n}_proj.weight": rand(proj, h) for n in ("q", "k", "v", "g")}
        out.update({f"{n}_conv1d.weight": rand(proj, 1, self.short_conv_kernel_size, std=0.5) for n in "qkv"})
        out.update({
            "f_a_proj.weight": rand(d, h),
            "f_b_proj.weight": rand(proj, d),
            "b_proj.weight": rand(heads, h),
            "dt_bias": rand(proj),
            "A_log": torch.log(torch.linspace(1.0, 16.0, heads)).view(1, 1, heads, 1),
            "o_norm.weight": norm(d),
            "o_proj.weight": rand(h, proj),
        })
        return out

    def _mla(self, rand, norm) -> dict[str, torch.Tensor]:
        h, heads = self.hidden_size, self.num_attention_heads
        return {
            "q_a_proj.weight": rand(self.q_lora_rank, h),
            "q_a_layernorm.weight": norm(self.q_lora_rank),
            "q_b_proj.weight": rand(heads * (self.qk_nope_head_dim + self.qk_rope_head_dim), self.q_lora_rank),
            "kv_a_proj_with_mqa.weight": rand(self.kv_lora_rank + self.qk_rope_head_dim, h),
            "kv_a_layernorm.weight": norm(self.kv_lora_rank),
            "kv_b_proj.weight": rand(heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            "o_proj.weight": rand(h, heads * self.v_head_dim),
            "g_proj.weight": rand(heads * self.v_head_dim, h),
        }

    def write(self, out: Path, tokens: Tokens) -> str:
        n_params = write_checkpoint(out, self.config(tokens), self.tensors(tokens.vocab_size))
        (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=1))
        moe_layers = self.num_hidden_layers - self.first_k_dense_replace
        return (f"{n_params / 1e6:.2f} M stored values, {moe_layers} latent MoE layers of {self.num_experts} "
                f"mxfp4 experts (top-{self.num_experts_per_token}, {self.num_shared_experts} shared), "
                f"{self.num_nextn_predict_layers} MTP layer(s) after them")


register("tiny-kimi-k3", TinyKimiK3Recipe())
