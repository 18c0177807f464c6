"""tiny-mixtral: a Mixtral-architecture model small enough for CI, big enough to be non-trivial."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..tiny import Recipe, Tokens, register


@dataclass(frozen=True)
class TinyMixtralRecipe(Recipe):
    architecture: str = "MixtralForCausalLM"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4  # head_dim 32: vLLM's CPU attention rejects smaller
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 1024
    initializer_range: float = 0.08  # wide enough that greedy choices are not near-ties
    seed: int = 20261129

    def write(self, out: Path, tokens: Tokens) -> str:
        import torch
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=tokens.vocab_size,  # no ids the tokenizer cannot decode
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            num_local_experts=self.num_local_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            bos_token_id=tokens.bos_token_id,
            eos_token_id=tokens.eos_token_id,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        torch.manual_seed(self.seed)
        model = MixtralForCausalLM(config).eval()
        model.save_pretrained(out, safe_serialization=True)
        n_params = sum(p.numel() for p in model.parameters())
        return f"{n_params / 1e6:.2f} M parameters, {self.num_local_experts} experts"


register("tiny-mixtral", TinyMixtralRecipe())
