"""The model presets: each named size's architecture, in its Hugging Face config's names.

The training program builds its model from these (training_jobs/trainer/models.py: the vocabulary
comes from the tokenizer, the context length from `seq_len`); the run planner sizes the same
parameters without torch (llmtrain/planner/shapes.py).
"""

from __future__ import annotations

from typing import Any

# The program rounds its embedding rows up to this multiple of the tokenizer's size: faster
# matmuls, and the unused rows are harmless.
VOCAB_MULTIPLE = 64

_LLAMA = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
_ROPE_500K = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
_LLAMA_70B = {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, **_ROPE_500K}
# Mixtures of experts (training_jobs/trainer/moe/): Qwen3-MoE, Mixtral and DeepSeek-V3 layouts.
_QWEN3_MOE = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
_MIXTRAL = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
_DEEPSEEK_V3 = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "norm_topk_prob": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# name -> (family, architecture): family is the Hugging Face model_type whose config the program
# builds ("llama", "gpt2", "qwen3_moe", "mixtral", "deepseek_v3").
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("llama", {**_LLAMA, "hidden_size": 64, "intermediate_size": 176,
                             "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2}),
    "llama-20m": ("llama", {**_LLAMA, "hidden_size": 512, "intermediate_size": 1408,
                            "num_hidden_layers": 6, "num_attention_heads": 8,
                            "num_key_value_heads": 8}),
    "llama-1b": ("llama", {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192,
                           "num_hidden_layers": 16, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "tie_word_embeddings": True, **_ROPE_500K}),
    "llama-7b": ("llama", {**_LLAMA, "hidden_size": 4096, "intermediate_size": 11008,
                           "num_hidden_layers": 32, "num_attention_heads": 32,
                           "num_key_value_heads": 32}),
    "llama-13b": ("llama", {**_LLAMA, "hidden_size": 5120, "intermediate_size": 13824,
                            "num_hidden_layers": 40, "num_attention_heads": 40,
                            "num_key_value_heads": 40}),
    "llama-70b": ("llama", _LLAMA_70B),
    # The published Llama 3 shapes (Meta's Llama 3.1 8B, 70B and 405B configs).
    "llama3-8b": ("llama", {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336,
                            "num_hidden_layers": 32, "num_attention_heads": 32,
                            "num_key_value_heads": 8, **_ROPE_500K}),
    "llama3-70b": ("llama", _LLAMA_70B),
    "llama3-405b": ("llama", {**_LLAMA, "hidden_size": 16384, "intermediate_size": 53248,
                              "num_hidden_layers": 126, "num_attention_heads": 128,
                              "num_key_value_heads": 8, **_ROPE_500K}),
    "qwen3-moe-tiny": ("qwen3_moe", {**_QWEN3_MOE, "hidden_size": 64, "intermediate_size": 176,
                                     "moe_intermediate_size": 32, "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                     "num_experts": 8, "num_experts_per_tok": 2}),
    # Qwen/Qwen3-30B-A3B's config.json: 128 experts, 8 active, 3.3B of 30.5B parameters per token.
    "qwen3-30b-a3b": ("qwen3_moe", {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144,
                                    "moe_intermediate_size": 768, "num_hidden_layers": 48,
                                    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                                    "num_experts": 128, "num_experts_per_tok": 8}),
    "mixtral-tiny": ("mixtral", {**_MIXTRAL, "hidden_size": 64, "intermediate_size": 96,
                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "num_local_experts": 4,
                                 "num_experts_per_tok": 2}),
    # mistralai/Mixtral-8x7B-v0.1's config.json: 8 experts, 2 active.
    "mixtral-8x7b": ("mixtral", {**_MIXTRAL, "hidden_size": 4096, "intermediate_size": 14336,
                                 "num_hidden_layers": 32, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "num_local_experts": 8,
                                 "num_experts_per_tok": 2}),
    # DeepSeek-V3's layout (multi-head latent attention, a shared expert, leading dense layers,
    # sigmoid routing over expert groups) at test size.
    "deepseek-moe-tiny": ("deepseek_v3", {**_DEEPSEEK_V3, "hidden_size": 64, "intermediate_size": 128,
                                          "moe_intermediate_size": 32, "num_hidden_layers": 3,
                                          "num_attention_heads": 4, "num_key_value_heads": 4,
                                          "n_shared_experts": 1, "n_routed_experts": 8,
                                          "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                          "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                                          "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                                          "qk_nope_head_dim": 8, "v_head_dim": 16}),
    "gpt2-tiny": ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4}),
    "gpt2-small": ("gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12}),
    "gpt2-medium": ("gpt2", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "gpt2-large": ("gpt2", {"n_embd": 1280, "n_layer": 36, "n_head": 20}),
    "gpt2-xl": ("gpt2", {"n_embd": 1600, "n_layer": 48, "n_head": 25}),
}
MODEL_PRESETS = tuple(PRESETS)


def padded_vocab_size(tokenizer_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The embedding rows for a tokenizer of this size: rounded up to a multiple of 64."""
    return -(-tokenizer_size // multiple) * multiple
