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
from training_jobs.contract.presets import PRESETS, padded_vocab_size

FAMILIES = ("llama", "gpt2")
# Hugging Face model types whose decoder the planner models as Llama's (same blocks and names).
LLAMA_LIKE = ("llama", "mistral", "qwen2")
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
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ModelShapeError(
                f"hidden_size {self.hidden_size} must divide into num_attention_heads "
                f"{self.num_heads}, which num_key_value_heads {self.num_kv_heads} must divide"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

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

    def matmul_parameters(self) -> int:
        """Weights that multiply every token: the blocks' linears and the output head (tied or not)."""
        blocks = sum(p.numel for p in self.parameters() if p.kind == "linear" and p.layer is not None)
        return blocks + self.vocab_size * self.hidden_size

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token, forward and backward, without recomputation: 6 per matmul
        weight plus the attention scores' 12 x layers x hidden x sequence (PaLM, appendix B), the
        convention of the training program's MFU and of torchtitan's."""
        return 6.0 * self.matmul_parameters() + 12.0 * self.num_layers * self.hidden_size * seq_len


@functools.lru_cache(maxsize=128)
def _parameters(shape: ModelShape) -> tuple[ParameterTensor, ...]:
    return _llama_parameters(shape) if shape.family == "llama" else _gpt2_parameters(shape)


def _llama_parameters(shape: ModelShape) -> tuple[ParameterTensor, ...]:
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.kv_size
    # The program splits the embedding and the head on the vocabulary (rows) under tensor parallel.
    params = [ParameterTensor("model.embed_tokens.weight", (shape.vocab_size, h), "embedding", tp="colwise")]
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        attention = (("q_proj", h, "colwise"), ("k_proj", kv, "colwise"), ("v_proj", kv, "colwise"))
        for name, rows, tp in attention:
            params.append(
                ParameterTensor(f"{prefix}.self_attn.{name}.weight", (rows, h), "linear", layer, tp)
            )
            if shape.attention_bias:
                params.append(ParameterTensor(f"{prefix}.self_attn.{name}.bias", (rows,), "bias", layer, tp))
        params.append(
            ParameterTensor(f"{prefix}.self_attn.o_proj.weight", (h, h), "linear", layer, "rowwise")
        )
        params += [
            ParameterTensor(f"{prefix}.mlp.gate_proj.weight", (i, h), "linear", layer, "colwise"),
            ParameterTensor(f"{prefix}.mlp.up_proj.weight", (i, h), "linear", layer, "colwise"),
            ParameterTensor(f"{prefix}.mlp.down_proj.weight", (h, i), "linear", layer, "rowwise"),
            ParameterTensor(f"{prefix}.input_layernorm.weight", (h,), "norm", layer),
            ParameterTensor(f"{prefix}.post_attention_layernorm.weight", (h,), "norm", layer),
        ]
    params.append(ParameterTensor("model.norm.weight", (h,), "norm"))
    if not shape.tie_embeddings:
        params.append(ParameterTensor("lm_head.weight", (shape.vocab_size, h), "linear", tp="colwise"))
    return tuple(params)


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
    "qwen3-30b-a3b": 151936,
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
    raise ModelShapeError(
        f"model_type {model_type!r} is not one the planner models; it models "
        f"{', '.join(LLAMA_LIKE)} (as Llama) and gpt2"
    )


def _llama_shape(config: Mapping[str, Any], model_type: str) -> ModelShape:
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim")
    hidden = int(config["hidden_size"])
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ModelShapeError(
            f"head_dim {head_dim} x num_attention_heads {heads} differs from "
            f"hidden_size {hidden}: the planner models head_dim = hidden / heads"
        )
    return ModelShape(
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
