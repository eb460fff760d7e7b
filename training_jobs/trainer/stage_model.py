"""One pipeline stage's slice of a Hugging Face causal LM: some decoder layers, plus the embedding
on the first stage and the final norm and head on the last.

The slice keeps the model's own modules and runs the model's own forward (the decoder computes
rotary embeddings and the causal mask itself, and skips the embedding when it receives hidden
states), so a stage computes exactly what those layers compute in the whole model. Parameter names
stay those of the whole model (`model.layers.17.mlp.up_proj.weight`, `lm_head.weight`), so a
stage's checkpoint shards and exported weights line up with an ordinary checkpoint. No
communication here: trainer/strategies/pipeline.py connects the stages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .errors import ConfigError

# Model types with the Llama layout: model.embed_tokens, model.layers, model.norm, lm_head, rotary
# positions (nothing added to the hidden states the first layer receives). tests/training/
# test_pipeline_parts.py checks that two stages of each compute what the whole model computes.
SPLITTABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class KeptLayers(nn.ModuleList):
    """A ModuleList that keeps its layers' original indices as names: the stage holding layers 4-7
    of a model has parameters `layers.4...` to `layers.7...`. Positions (0, 1, ...) still index it,
    as the decoder's loop and the activation-checkpoint wrapper expect."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def _name(self, position: int) -> str:
        return list(self._modules)[position]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return nn.ModuleList(list(self._modules.values())[index])
        return self._modules[self._name(index)]

    def __setitem__(self, index: int, module: nn.Module) -> None:
        self._modules[self._name(index)] = module


def check_splittable(causal_lm: nn.Module) -> None:
    """Refuse models whose layout the stages do not know, and tied input/output embeddings (they
    would live on two stages)."""
    if causal_lm.config.model_type not in SPLITTABLE_MODEL_TYPES:
        raise ConfigError(f"invalid hyperparameter 'pipeline_parallel_degree': "
                          f"{causal_lm.config.model_type} models cannot be split into pipeline "
                          f"stages (these can: {', '.join(SPLITTABLE_MODEL_TYPES)}); use "
                          "pipeline_parallel_degree=1")
    if causal_lm.config.tie_word_embeddings:
        raise ConfigError("invalid hyperparameter 'pipeline_parallel_degree': this model ties its input "
                          "and output embeddings, which would sit on the first and the last stage; set "
                          'model_overrides {"tie_word_embeddings": false} or pipeline_parallel_degree=1')


class CausalLMStage(nn.Module):
    """Decoder layers `layers` of `causal_lm` (which this takes apart), with the embedding when
    `first` and the final norm and head when `last`. Input: token ids (first) or hidden states;
    output: logits (last) or hidden states. `positions`: the tokens' position ids where they are not
    the sequence's first ones in order (a context-parallel rank's chunks)."""

    def __init__(self, causal_lm: nn.Module, layers: Sequence[int], *, first: bool, last: bool,
                 positions: torch.Tensor | None = None) -> None:
        super().__init__()
        check_splittable(causal_lm)
        base = causal_lm.model
        base.layers = KeptLayers({index: base.layers[index] for index in layers})
        if not first:
            base.embed_tokens = None  # the decoder only embeds when it is given token ids
        if not last:
            base.norm = nn.Identity()
        self.model = base
        self.lm_head = causal_lm.lm_head if last else None
        self.config = causal_lm.config
        self._no_split_modules = causal_lm._no_split_modules  # how decoder_layers finds the layers
        self.first, self.last = first, last
        self.positions = positions  # position ids of the tokens, when not 0, 1, ... (context parallel)

    @property
    def base_model(self) -> nn.Module:
        """The decoder, whose module names the tensor-parallel plan uses (as HF's base_model)."""
        return self.model

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids" if self.first else "inputs_embeds": tokens_or_hidden}
        hidden = self.model(**inputs, position_ids=self.positions, use_cache=False).last_hidden_state
        return self.lm_head(hidden) if self.last else hidden


def stage_of_parameter(name: str, layer_stages: Sequence[int]) -> int:
    """The stage holding the parameter `name` of the whole model, given each decoder layer's stage:
    the embedding on the first stage, the final norm and head on the last."""
    parts = name.split(".")
    if parts[:2] == ["model", "embed_tokens"]:
        return 0
    if parts[:2] == ["model", "layers"]:
        return layer_stages[int(parts[2])]
    return layer_stages[-1]
