"""The model: a Hugging Face causal LM from a size preset or from the `model` channel.

Only model definition lives here; how the model is spread over devices is parallel.py's job. The
tokenizer comes from the `tokenizer` channel, else from the `model` channel, else the tiny one
shipped in training_jobs/assets/tokenizer. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..contract import token_data
from ..contract.hyperparameters import ConfigError, ModelConfig
from ..contract.presets import PRESETS, padded_vocab_size
from .errors import ContainerError
from .moe import families as moe_families

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2].joinpath(*token_data.SHIPPED_TOKENIZER)

# Pretraining from scratch: no dropout (the modern recipe, and exactly reproducible).
_GPT2_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@dataclass(frozen=True)
class PresetFamily:
    """How a preset family's HF config takes the context length, and what it adds to a preset."""

    positions_field: str
    fixed: dict[str, Any]


# The presets' families (contract/presets.py), by HF model_type.
PRESET_FAMILIES: dict[str, PresetFamily] = {
    "llama": PresetFamily("max_position_embeddings", {}),
    "gpt2": PresetFamily("n_positions", _GPT2_NO_DROPOUT),
    "qwen3_moe": PresetFamily("max_position_embeddings", {}),
    "mixtral": PresetFamily("max_position_embeddings", {}),
    "deepseek_v3": PresetFamily("max_position_embeddings", {}),
}


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: a preset (random init) or a pretrained folder."""

    config: Any  # transformers.PretrainedConfig
    pretrained_dir: Path | None
    description: str
    attention: str = "sdpa"  # the HF attn_implementation


def attention_implementation(choice: str, *, compiled: bool, device_type: str) -> str:
    """The HF attention implementation for the `attention` hyperparameter.

    auto: on a CPU under torch.compile, the eager attention (inductor fuses its mask and softmax
    around two batched matmuls) trains faster than the CPU flash kernel, whose backward dominates a
    step (bench/results/latest.json, docs/benchmarks.md); everywhere else PyTorch's SDPA kernels.
    """
    if choice != "auto":
        return choice
    return "eager" if compiled and device_type == "cpu" else "sdpa"


def _is_model_dir(path: Path | None) -> bool:
    return path is not None and (path / "config.json").is_file()


def load_tokenizer(tokenizer_channel: Path | None, model_channel: Path | None):
    """The tokenizer: the tokenizer channel, else the model channel, else the shipped one."""
    from transformers import AutoTokenizer

    candidates = [tokenizer_channel, model_channel if _has_tokenizer(model_channel) else None,
                  SHIPPED_TOKENIZER]
    path = next(p for p in candidates if p is not None)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True), path
    except (OSError, ValueError) as error:
        raise ContainerError(f"cannot load a tokenizer from {path}: {error}") from error


def _has_tokenizer(path: Path | None) -> bool:
    return path is not None and any((path / name).is_file() for name in
                                    ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def preset_config(model: ModelConfig, tokenizer, seq_len: int):
    """The HF config of a preset, sized to the tokenizer and the sequence length."""
    from transformers import AutoConfig

    family, architecture = PRESETS[model.model_preset]
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    form = PRESET_FAMILIES[family]
    values = {**architecture, **form.fixed, "vocab_size": padded_vocab_size(len(tokenizer)),
              form.positions_field: seq_len, **special}
    config = AutoConfig.for_model(family, **values)
    _apply_overrides(config, model.model_overrides)
    return config


def _apply_overrides(config, overrides: dict[str, Any]) -> None:
    # A family's aliases (attribute_map: Qwen3-MoE's num_experts is num_local_experts) name fields too.
    known = set(config.to_dict()) | set(config.attribute_map)
    for key, value in overrides.items():
        if key not in known:
            raise ConfigError(f"invalid hyperparameter 'model_overrides': {key!r} is not a field of "
                              f"{type(config).__name__}")
        setattr(config, key, value)


def model_source(model: ModelConfig, model_channel: Path | None, tokenizer, seq_len: int,
                 attention: str = "sdpa") -> ModelSource:
    """Decide where the model comes from and build its config (no weights yet)."""
    from transformers import AutoConfig

    if _is_model_dir(model_channel):
        config = AutoConfig.from_pretrained(str(model_channel), local_files_only=True)
        _apply_overrides(config, model.model_overrides)
        _check_context_length(config, seq_len)
        _check_tokenizer_fits(config, tokenizer, model_channel)
        return ModelSource(config, model_channel, f"pretrained from {model_channel}", attention)
    if model_channel is not None:
        raise ContainerError(f"the model channel {model_channel} holds no config.json: it must be an "
                             "HF model folder (config.json + *.safetensors)")
    if not model.model_preset:
        raise ConfigError("invalid hyperparameter 'model_preset': set it (e.g. llama-1b) or provide a "
                          "`model` channel holding a pretrained checkpoint")
    return ModelSource(preset_config(model, tokenizer, seq_len), None, f"preset {model.model_preset}",
                       attention)


def _check_context_length(config, seq_len: int) -> None:
    """A checkpoint was trained up to its context length; longer samples would train positions it
    never saw (learned positions cannot exist at all, rotary ones degrade silently)."""
    limit = config.to_dict().get("n_positions") or config.to_dict().get("max_position_embeddings")
    if limit is not None and seq_len > limit:
        raise ConfigError(f"invalid hyperparameter 'seq_len': {seq_len} exceeds the checkpoint's context "
                          f"length of {limit} positions; set seq_len <= {limit}, or extend the context on "
                          "purpose with model_overrides (e.g. max_position_embeddings and rope_scaling)")


def _check_tokenizer_fits(config, tokenizer, model_channel: Path) -> None:
    """Every id the tokenizer can produce needs a row in the checkpoint's embedding, else the
    model fails with an index error later (at inference) instead of now."""
    embedding_rows = config.to_dict().get("vocab_size")
    if embedding_rows is not None and len(tokenizer) > embedding_rows:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the checkpoint in {model_channel} "
                          f"embeds only {embedding_rows}: train with the checkpoint's own tokenizer (drop "
                          "the tokenizer channel, or give one whose size fits the embedding)")


def build_model(source: ModelSource, *, materialize: bool, seed: int, load_weights: bool = True,
                quantization=None) -> nn.Module:
    """The causal LM in fp32: real weights when `materialize`, else on the meta device.

    Only rank 0 needs to read pretrained weights (`load_weights`); the other ranks receive them
    after the model is sharded or replicated, so a large model is read once per job.
    """
    model = _hf_model(source, materialize=materialize, seed=seed, load_weights=load_weights,
                      quantization=quantization)
    moe_families.install(model)  # a mixture of experts trains with the program's MoE blocks
    return model


def _hf_model(source: ModelSource, *, materialize: bool, seed: int, load_weights: bool,
              quantization) -> nn.Module:
    from transformers import AutoModelForCausalLM

    attention = {"attn_implementation": source.attention}
    if not materialize:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(source.config, dtype=torch.float32, **attention)
    torch.manual_seed(seed)
    if source.pretrained_dir is not None and (load_weights or quantization is not None):
        return AutoModelForCausalLM.from_pretrained(
            str(source.pretrained_dir), config=source.config, local_files_only=True,
            dtype=torch.bfloat16 if quantization is not None else torch.float32,
            quantization_config=quantization, **attention)
    return AutoModelForCausalLM.from_config(source.config, dtype=torch.float32, **attention)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of transformer blocks (found by the class names HF keeps unsplit)."""
    names = set(getattr(_base_hf_model(model), "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and \
                type(_unwrap(module[0])).__name__ in names:
            return module
    raise ContainerError(f"cannot find the decoder layers of {type(model).__name__}")


def _unwrap(module: nn.Module) -> nn.Module:
    """The layer inside activation-checkpoint and FSDP1 (SMP v2) wrappers."""
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or \
            getattr(module, "_fsdp_wrapped_module", None)
        if inner is None:
            return module
        module = inner


def _base_hf_model(model: nn.Module) -> nn.Module:
    """The transformers model under any peft wrapper."""
    with contextlib.suppress(AttributeError):
        return model.get_base_model()
    return model


def non_embedding_parameters(model: nn.Module) -> int:
    """Parameters outside the token and position embeddings that each token meets (for FLOPs per
    token): of a mixture of experts' routed experts, only its top-k's share (k of E experts)."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    share = {id(p): block.gate.top_k / block.num_experts
             for block in moe_families.moe_blocks(model) for p in block.experts.parameters()}
    return round(sum(parameter_count(p) * share.get(id(p), 1.0)
                     for p in model.parameters() if id(p) not in embeddings))


def parameter_count(param: torch.Tensor) -> int:
    """Elements of the whole parameter, also when sharded (DTensor reports the global shape;
    DeepSpeed ZeRO-3 keeps it in ds_numel)."""
    return getattr(param, "ds_numel", None) or param.numel()


def forward_logits(model: nn.Module, inputs: torch.Tensor,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of `inputs`; `positions` when the tokens are not the sequence's first ones in order
    (a context-parallel rank's chunks)."""
    return model(input_ids=inputs, position_ids=positions, use_cache=False).logits
