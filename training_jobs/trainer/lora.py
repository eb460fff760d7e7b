"""LoRA adapters with peft, and the QLoRA (4-bit NF4 base) guard.

The base weights are frozen; only the adapters train. QLoRA needs bitsandbytes' CUDA kernels, so on
a host without a GPU it stops at once with a message rather than failing deep inside a library.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..contract.hyperparameters import QUANTIZED_PARALLELISMS, LoraConfig
from .errors import ConfigError, ExportError


def peft_config(lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    targets = lora.lora_target_modules
    return PeftLoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                          target_modules="all-linear" if targets == ["all-linear"] else targets,
                          task_type=TaskType.CAUSAL_LM, bias="none")


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Wrap the model in peft LoRA adapters (base frozen); a no-op when lora_r is 0."""
    if lora.lora_r == 0:
        return model
    from peft import get_peft_model

    try:
        return get_peft_model(model, peft_config(lora))
    except ValueError as error:  # peft names the modules it could not find
        raise ConfigError(f"invalid hyperparameter 'lora_target_modules': {error}") from error


def check_quantization(lora: LoraConfig, parallelism: str, *, has_checkpoint: bool) -> None:
    """QLoRA quantizes a checkpoint from the model channel with bitsandbytes (CUDA, or its slower
    CPU path), on one process or with DDP."""
    if lora.quantization == "none":
        return
    if parallelism not in QUANTIZED_PARALLELISMS:
        raise ConfigError(f"invalid hyperparameter 'quantization': nf4 runs with parallelism single or "
                          f"ddp, not {parallelism}")
    if not has_checkpoint:
        # transformers quantizes while loading a checkpoint; a preset would silently stay unquantized
        raise ConfigError("invalid hyperparameter 'quantization': nf4 quantizes the checkpoint in the "
                          "model channel and this job has none; provide one or use quantization=none")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ConfigError("invalid hyperparameter 'quantization': nf4 needs the bitsandbytes package in "
                          "the container (add it to requirements.txt)") from error


def quantization_config(lora: LoraConfig):
    """transformers' 4-bit NF4 loading config for QLoRA, or None."""
    if lora.quantization != "nf4":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)


def _peft_skeleton(config, lora: LoraConfig) -> nn.Module:
    """The peft model of `config` on the meta device, with plain module names.

    The trained model's module names carry whatever wraps its layers (activation checkpointing's
    `_checkpoint_wrapped_module`, torch.compile's `_orig_mod`), while the gathered state dict's keys
    are clean; peft matches adapter weights by module name, so it must see an unwrapped model."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return get_peft_model(AutoModelForCausalLM.from_config(config), peft_config(lora))


def merged_model(config, lora: LoraConfig, full_state: dict) -> nn.Module:
    """A plain transformers model with the adapters folded into the base weights."""
    skeleton = _peft_skeleton(config, lora)
    skeleton.load_state_dict(full_state, assign=True, strict=True)
    return skeleton.merge_and_unload()


def save_adapter(config, lora: LoraConfig, full_state: dict, directory: Path) -> int:
    """Write the adapter (adapter_config.json + adapter_model.safetensors) out of the full state
    dict of the trained peft model; returns how many tensors it holds. Refuses to write an adapter
    that lacks any of the trained LoRA weights: an empty adapter loads without error and silently
    gives back the base model."""
    from peft import get_peft_model_state_dict

    skeleton = _peft_skeleton(config, lora)
    adapter = get_peft_model_state_dict(skeleton, state_dict=full_state)
    trained = [key for key in full_state if ".lora_A." in key or ".lora_B." in key]
    if not trained or len(adapter) != len(trained):
        raise ExportError(f"the LoRA adapter holds {len(adapter)} of the {len(trained)} trained adapter "
                          "tensors; nothing was exported (the checkpoints still hold the trained state)")
    skeleton.save_pretrained(str(directory), state_dict=full_state, safe_serialization=True)
    return len(adapter)
