"""The final model in SM_MODEL_DIR, in Hugging Face safetensors format.

Full training: config.json, model*.safetensors (sharded with an index above 5 GB), generation
config and the tokenizer, loadable with `AutoModelForCausalLM.from_pretrained`. LoRA: the peft
adapter (adapter_config.json + adapter_model.safetensors) plus the tokenizer, or, with
merge_lora=true, the merged full model. Weights are gathered to rank 0, which writes everything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..contract.hyperparameters import TrainConfig
from . import lora as lora_module

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _cast(state: dict, dtype: torch.dtype) -> dict:
    return {key: value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}


def _save_full(config, state: dict, directory: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    config.dtype = dtype
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    skeleton.save_pretrained(str(directory), state_dict=_cast(state, dtype), safe_serialization=True,
                             max_shard_size="5GB")


def export_model(strategy, config: TrainConfig, tokenizer, directory: Path, is_main: bool) -> Path | None:
    """Gather and write the final model; every rank must call this (the gather is a collective)."""
    state = strategy.full_state_dict()
    hf_model = strategy.hf_model
    if not is_main:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    dtype = EXPORT_DTYPES[config.parallel.mixed_precision]
    base_config = _base_config(hf_model)
    if config.lora.lora_r and not config.lora.merge_lora:
        lora_module.save_adapter(base_config, config.lora, state, directory)
    elif config.lora.lora_r:
        merged = lora_module.merged_model(base_config, config.lora, state)
        _save_full(base_config, merged.state_dict(), directory, dtype)
    else:
        _save_full(base_config, state, directory, dtype)
    tokenizer.save_pretrained(str(directory))
    (directory / "training_args.json").write_text(json.dumps(config.flat(), indent=1, sort_keys=True))
    return directory


def _base_config(hf_model: nn.Module):
    """A copy of the transformers config (under any peft wrapper)."""
    import copy

    base = hf_model.get_base_model() if hasattr(hf_model, "get_base_model") else hf_model
    return copy.deepcopy(base.config)
