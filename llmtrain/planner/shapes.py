"""The shape of a decoder-only model, as the planner needs it: every parameter tensor and FLOPs.

The training program builds Hugging Face Llama and GPT-2 models from named presets, whose
architectures are part of its contract (training_jobs/contract/presets.py: PRESETS), which the planner
reads. The program sizes the embedding to its tokenizer (rounded up to a multiple of 64); the planner
cannot read a tokenizer channel, so each preset carries the vocabulary of the published model it
is shaped after (`PRESET_VOCAB`), which `model_overrides` or `--vocab-size` replace.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtrain.core.errors import LlmtrainError
from training_jobs.contract.moe import MOE_MODEL_TYPES, expert_shape
from training_jobs.contract.presets import PRESETS, padded_vocab_size

FAMILIES = ("llama", "gpt2")
# Hugging Face model types whose attention normalises each head's queries and keys.
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
# Hugging Face model types whose decoder the planner models as Llama's (same blocks and names).
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# peft's "all-linear": every linear layer of the decoder blocks (never the output head).
ALL_LINEAR = "all-linear"


class ModelShapeError(LlmtrainError):
    """A model configuration the planner cannot read; the message says what to change."""


@dataclass(frozen=True)
class ParameterTensor:
    """One parameter: its name (as in the HF model), its shape, and what it is.

    kind: "embedding" (token or position rows), "linear" (a matmul weight), "norm" (a norm's scale
    or shift) or "bias". layer: the decoder block's index, or None outside the blocks.
    tp: how tensor parallelism splits it: "colwise" (output rows), "rowwise" (input columns) or None.
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    layer: int | None = None
    tp: str | None = None
    # A mixture of experts' stacked expert weights (experts x out x in, as torchtitan's grouped
    # experts): the experts it stacks, of which a token passes through `active` (its top-k); 0 for
    # every other tensor. Expert parallelism splits dim 0 (llmtrain.planner.sharding).
    experts: int = 0
    active: int = 0

    @property
    def active_numel(self) -> int:
        """Elements one token multiplies: its top-k experts' slices of a stacked expert tensor."""
        return self.numel * self.active // self.experts if self.experts else self.numel

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def module(self) -> str:
        """The short name of the module that owns it, e.g. q_proj (what LoRA targets match)."""
        parts = self.name.split(".")
        return parts[-2] if len(parts) >= 2 else parts[0]


@dataclass(frozen=True)
class ModelShape:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_embeddings: bool
    # GPT-2's learned positions (the program sets n_positions to seq_len); 0 for Llama (rotary).
    max_positions: int = 0
    attention_bias: bool = False
    # Qwen3's per-head RMS norms of the queries and keys (q_norm, k_norm).
    qk_norm: bool = False
    # A head width other than hidden / heads (Qwen3's 128 with 2048 / 32); 0: hidden / heads.
    head_size: int = 0
    # Mixture of experts (0 experts: dense): routed experts, experts per token (top-k), an expert's
    # FFN width, the shared experts' FFN width (every token passes through them), and the leading
    # layers whose MLP stays dense (`intermediate_size` wide; DeepSeek's first_k_dense_replace).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    dense_layers: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelShapeError(
                f"model family {self.family!r} is not one the planner models: {', '.join(FAMILIES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            if getattr(self, name) < 1:
                raise ModelShapeError(f"model {name} must be at least 1, got {getattr(self, name)}")
        if self.num_experts:
            _check_experts(self)
        if (self.hidden_size % self.num_heads and not self.head_size) or self.num_heads % self.num_kv_heads:
            raise ModelShapeError(
                f"hidden_size {self.hidden_size} must divide into num_attention_heads "
                f"{self.num_heads}, which num_key_value_heads {self.num_kv_heads} must divide"
            )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def attention_width(self) -> int:
        """Width of the query projection (and of the attention output)."""
        return self.num_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.moe else 0

    @property
    def token_intermediate_size(self) -> int:
        """The MLP width one token passes through in an average layer (a mixture of experts: its
        top-k experts' and the shared experts'): what its activations and elementwise work scale with."""
        if not self.moe:
            return self.intermediate_size
        routed = self.experts_per_token * self.expert_intermediate_size + self.shared_intermediate_size
        dense = self.intermediate_size * self.dense_layers
        return round((routed * self.moe_layers + dense) / self.num_layers)

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    def with_vocab(self, vocab_size: int) -> ModelShape:
        return dataclasses.replace(self, vocab_size=padded_vocab_size(vocab_size))

    def parameters(self) -> tuple[ParameterTensor, ...]:
        """Every parameter tensor once (a tied output head shares the embedding's)."""
        return _parameters(self)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel for p in self.parameters())

    @property
    def active_parameters(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to (= num_parameters
        for a dense model)."""
        return sum(p.active_numel for p in self.parameters())

    def matmul_parameters(self) -> int:
        """Weights that multiply every token: the blocks' linears (of a mixture of experts, the
        router and the token's top-k experts) and the output head (tied or not)."""
        blocks = sum(p.active_numel for p in self.parameters()
                     if p.kind in ("linear", "expert") and p.layer is not None)
        return blocks + self.vocab_size * self.hidden_size

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token, forward and backward, without recomputation: 6 per matmul
        weight plus the attention scores' 12 x layers x width x sequence (PaLM, appendix B), the
        convention of the training program's MFU and of torchtitan's."""
        return 6.0 * self.matmul_parameters() + 12.0 * self.num_layers * self.attention_width * seq_len


def _check_experts(shape: ModelShape) -> None:
    if shape.family != "llama":
        raise ModelShapeError(
            f"the planner models mixtures of experts with Llama-style blocks, not {shape.family}"
        )
    if not 1 <= shape.experts_per_token <= shape.num_experts:
        raise ModelShapeError(f"num_experts_per_tok {shape.experts_per_token} must be between 1 and the "
                              f"{shape.num_experts} experts")
    if shape.expert_intermediate_size < 1:
        raise ModelShapeError("a mixture of experts needs moe_intermediate_size (each expert's FFN width)")
    if not 0 <= shape.dense_layers < shape.num_layers:
        raise ModelShapeError(f"{shape.dense_layers} leading dense layers leave no expert layer of "
                              f"{shape.num_layers}")


@functools.lru_cache(maxsize=128)
def _parameters(shape: ModelShape) -> tuple[ParameterTensor, ...]:
    return _llama_parameters(shape) if shape.family == "llama" else _gpt2_parameters(shape)


def _llama_parameters(shape: ModelShape) -> tuple[ParameterTensor, ...]:
    h, i, kv, q = shape.hidden_size, shape.intermediate_size, shape.kv_size, shape.attention_width
    # The program splits the embedding and the head on the vocabulary (rows) under tensor parallel.
    params = [ParameterTensor("model.embed_tokens.weight", (shape.vocab_size, h), "embedding", tp="colwise")]
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        attention = (("q_proj", q, "colwise"), ("k_proj", kv, "colwise"), ("v_proj", kv, "colwise"))
        for name, rows, tp in attention:
            params.append(
                ParameterTensor(f"{prefix}.self_attn.{name}.weight", (rows, h), "linear", layer, tp)
            )
            if shape.attention_bias:
                params.append(ParameterTensor(f"{prefix}.self_attn.{name}.bias", (rows,), "bias", layer, tp))
        params.append(
            ParameterTensor(f"{prefix}.self_attn.o_proj.weight", (h, q), "linear", layer, "rowwise")
        )
        if shape.qk_norm:
            params += [ParameterTensor(f"{prefix}.self_attn.{name}.weight", (shape.head_dim,), "norm", layer)
                       for name in ("q_norm", "k_norm")]
        if shape.moe and layer >= shape.dense_layers:
            params += _expert_mlp(shape, prefix, layer)
        else:
            params += _dense_mlp(f"{prefix}.mlp", h, i, layer)
        params += [
            ParameterTensor(f"{prefix}.input_layernorm.weight", (h,), "norm", layer),
            ParameterTensor(f"{prefix}.post_attention_layernorm.weight", (h,), "norm", layer),
        ]
    params.append(ParameterTensor("model.norm.weight", (h,), "norm"))
    if not shape.tie_embeddings:
        params.append(ParameterTensor("lm_head.weight", (shape.vocab_size, h), "linear", tp="colwise"))
    return tuple(params)


def _dense_mlp(prefix: str, h: int, i: int, layer: int) -> list[ParameterTensor]:
    return [
        ParameterTensor(f"{prefix}.gate_proj.weight", (i, h), "linear", layer, "colwise"),
        ParameterTensor(f"{prefix}.up_proj.weight", (i, h), "linear", layer, "colwise"),
        ParameterTensor(f"{prefix}.down_proj.weight", (h, i), "linear", layer, "rowwise"),
    ]


def _expert_mlp(shape: ModelShape, prefix: str, layer: int) -> list[ParameterTensor]:
    """A mixture-of-experts layer: the router's (experts x hidden) gate, the routed experts stacked
    (gate and up fused, as Hugging Face's and the program's grouped experts hold them), and the
    shared experts' dense MLP."""
    h, e, k = shape.hidden_size, shape.num_experts, shape.experts_per_token
    ei = shape.expert_intermediate_size
    params = [
        ParameterTensor(f"{prefix}.mlp.gate.weight", (e, h), "linear", layer),
        ParameterTensor(f"{prefix}.mlp.experts.gate_up_proj", (e, 2 * ei, h), "expert", layer, None, e, k),
        ParameterTensor(f"{prefix}.mlp.experts.down_proj", (e, h, ei), "expert", layer, None, e, k),
    ]
    if shape.shared_intermediate_size:
        params += _dense_mlp(f"{prefix}.mlp.shared_experts", h, shape.shared_intermediate_size, layer)
    return params


def _gpt2_parameters(shape: ModelShape) -> tuple[ParameterTensor, ...]:
    h, i = shape.hidden_size, shape.intermediate_size
    params = [
        ParameterTensor("transformer.wte.weight", (shape.vocab_size, h), "embedding"),
        ParameterTensor("transformer.wpe.weight", (shape.max_positions, h), "embedding"),
    ]
    for layer in range(shape.num_layers):
        prefix = f"transformer.h.{layer}"
        # GPT-2's Conv1D stores weights as (in, out).
        for module, shape_in, shape_out in (
            ("attn.c_attn", h, 3 * h),
            ("attn.c_proj", h, h),
            ("mlp.c_fc", h, i),
            ("mlp.c_proj", i, h),
        ):
            params.append(
                ParameterTensor(f"{prefix}.{module}.weight", (shape_in, shape_out), "linear", layer)
            )
            params.append(ParameterTensor(f"{prefix}.{module}.bias", (shape_out,), "bias", layer))
        for norm in ("ln_1", "ln_2"):
            params.append(ParameterTensor(f"{prefix}.{norm}.weight", (h,), "norm", layer))
            params.append(ParameterTensor(f"{prefix}.{norm}.bias", (h,), "norm", layer))
    params += [
        ParameterTensor("transformer.ln_f.weight", (h,), "norm"),
        ParameterTensor("transformer.ln_f.bias", (h,), "norm"),
    ]
    return tuple(params)


# --- presets -------------------------------------------------------------------------------------

# The vocabulary of the published model each of the program's presets is shaped after (the
# planner's default, see the module docstring): the shipped tokenizer (training_jobs/assets/tokenizer)
# for the tiny presets; the published tokenizers for the others: Llama 3 (and the Llama-3.2-shaped
# 1B), Llama 2, GPT-2.
SHIPPED_TOKENIZER_VOCAB = 629
PRESET_VOCAB = {
    "llama-tiny": SHIPPED_TOKENIZER_VOCAB,
    "llama-20m": SHIPPED_TOKENIZER_VOCAB,
    "gpt2-tiny": SHIPPED_TOKENIZER_VOCAB,
    "qwen3-moe-tiny": SHIPPED_TOKENIZER_VOCAB,
    "mixtral-tiny": SHIPPED_TOKENIZER_VOCAB,
    "deepseek-moe-tiny": SHIPPED_TOKENIZER_VOCAB,
    "qwen3-30b-a3b": 151936,  # Qwen3's tokenizer: 151669 tokens, config vocab_size 151936
    "mixtral-8x7b": 32000,
    "llama-1b": 128256,
    "llama3-8b": 128256,
    "llama3-70b": 128256,
    "llama3-405b": 128256,
    "llama-70b": 128256,
    "llama-7b": 32000,
    "llama-13b": 32000,
    "gpt2-small": 50257,
    "gpt2-medium": 50257,
    "gpt2-large": 50257,
    "gpt2-xl": 50257,
}


def preset_shape(
    name: str, seq_len: int, overrides: Mapping[str, Any] | None = None, vocab_size: int | None = None
) -> ModelShape:
    """The shape the program builds for preset `name` at `seq_len`, with `model_overrides`."""
    if name not in PRESETS:
        raise ModelShapeError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    family, architecture = PRESETS[name]
    config = {**architecture, "vocab_size": padded_vocab_size(vocab_size or PRESET_VOCAB[name])}
    if family == "gpt2":
        config["n_positions"] = seq_len
    config.update(overrides or {})
    return shape_from_hf_config({"model_type": family, **config})


def shape_from_hf_config(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a Hugging Face decoder config (a config.json's content)."""
    model_type = config.get("model_type")
    try:
        if model_type in LLAMA_LIKE:
            return _llama_shape(config, model_type)
        if model_type == "gpt2":
            return _gpt2_shape(config)
    except (KeyError, TypeError) as error:
        raise ModelShapeError(
            f"the {model_type} config lacks or misstates {error}: the planner needs "
            "the layer count and the hidden, intermediate and head sizes"
        ) from error
    if model_type in MOE_MODEL_TYPES:
        raise ModelShapeError(
            f"the planner does not model {model_type}'s attention (multi-head latent attention); it models "
            f"the mixtures of experts {', '.join(t for t in LLAMA_LIKE if t in MOE_MODEL_TYPES)}"
        )
    raise ModelShapeError(
        f"model_type {model_type!r} is not one the planner models; it models "
        f"{', '.join(LLAMA_LIKE)} (as Llama) and gpt2"
    )


def _llama_shape(config: Mapping[str, Any], model_type: str) -> ModelShape:
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    hidden = int(config["hidden_size"])
    return ModelShape(
        **_expert_fields(config, model_type),
        qk_norm=model_type in QK_NORM_TYPES,
        head_size=int(head_dim) if head_dim is not None and int(head_dim) * heads != hidden else 0,
        family="llama",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
    )


def _expert_fields(config: Mapping[str, Any], model_type: str) -> dict[str, int]:
    """A mixture of experts' fields of a config, read as the training program reads them
    (training_jobs/contract/moe.py); none for a dense model."""
    experts = expert_shape(model_type, config)
    if experts is None:
        return {}
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if config.get("n_shared_experts"):
        shared = int(config["n_shared_experts"]) * int(config["moe_intermediate_size"])
    return {
        "num_experts": experts.num_experts,
        "experts_per_token": experts.top_k,
        # Mixtral's experts are intermediate_size wide (it has no other MLP)
        "expert_intermediate_size": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        "shared_intermediate_size": shared,
        "dense_layers": int(config.get("first_k_dense_replace") or 0),
    }


def _gpt2_shape(config: Mapping[str, Any]) -> ModelShape:
    hidden = int(config["n_embd"])
    heads = int(config["n_head"])
    return ModelShape(
        family="gpt2",
        vocab_size=int(config.get("vocab_size", 50257)),
        hidden_size=hidden,
        intermediate_size=int(config.get("n_inner") or 4 * hidden),
        num_layers=int(config["n_layer"]),
        num_heads=heads,
        num_kv_heads=heads,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        max_positions=int(config.get("n_positions", 1024)),
    )


def shape_from_file(path: Path) -> ModelShape:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ModelShapeError(f"cannot read {path} as a JSON model config: {error}") from error
    if not isinstance(data, dict):
        raise ModelShapeError(f"{path} must hold a JSON object (a Hugging Face config.json)")
    return shape_from_hf_config(data)
