"""The benchmark model: our program's own preset, so every peer trains the identical network.

The architecture comes from training_jobs' preset table and the vocabulary from the tokenizer our
program falls back to (the one it ships), exactly as `training_jobs/train.py` builds it.
"""

from __future__ import annotations

from functools import cache


@cache
def _tokenizer():
    from training_jobs.trainer.models import load_tokenizer

    tokenizer, _ = load_tokenizer(None, None)
    return tokenizer


def tokenizer_vocab_size() -> int:
    """Token ids the data may hold (the model's embedding may be padded beyond this)."""
    return len(_tokenizer())


def model_config(preset: str, seq_len: int, overrides: dict | None = None):
    """The HF config our program builds for `preset` with `model_overrides`."""
    from training_jobs.contract.hyperparameters import ModelConfig
    from training_jobs.trainer.models import preset_config

    return preset_config(ModelConfig(model_preset=preset, model_overrides=overrides or {}), _tokenizer(),
                         seq_len)


def build_causal_lm(preset: str, seq_len: int, overrides: dict | None = None):
    """The fp32 model with fresh weights (seed it first): transformers' own implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_config(preset, seq_len, overrides), dtype=torch.float32)
