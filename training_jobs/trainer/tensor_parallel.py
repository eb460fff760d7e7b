"""Tensor parallelism of Llama-layout models, with sequence parallelism and loss parallelism
(Megatron-LM's layout, as torchtitan applies it with PyTorch's parallel styles).

Per decoder layer: q, k, v, gate and up projections are split by output columns (each rank holds
heads / tp attention heads and intermediate / tp MLP columns), o and down projections by input rows.
With sequence parallel (`sequence_parallel`, the default) the residual stream between the regions
is sharded on the sequence dimension: the norms run on S / tp tokens, an all-gather of the norm's
output opens each tensor-parallel region and a reduce-scatter of the row-split projection's
partial sums closes it (the same bytes as the all-reduce it replaces, and activations / tp between
the regions). Without it the residual stream is replicated and each region ends in an all-reduce.

The embedding is split by vocabulary rows (its partial sums reduce-scattered, or all-reduced without
sequence parallel), and the output head by vocabulary columns: every rank computes the logits of
its vocabulary shard only, and trainer/loss.py computes the cross-entropy on the shards (loss
parallel), so no rank ever holds the whole vocabulary's logits. A tied head shares the embedding's
rows (both are split on the vocabulary dimension, dimension 0 of the shared weight).

Pipeline stages: a stage hands its neighbour its local sequence shard (S / tp tokens), and the next
stage takes it back as a shard of the sequence.

FP8 (tensorwise): torchao's float8 versions of the styles cast before the collectives, so the
all-gathers of the tensor-parallel regions travel in FP8.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .errors import ConfigError

# Model types whose modules the plan names (stage_model.SPLITTABLE_MODEL_TYPES has the same layout).
TENSOR_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class Styles:
    """PyTorch's parallel styles, or torchao's float8 ones."""

    colwise: type
    rowwise: type
    prepare_input: type


def _styles(float8: bool) -> Styles:
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Styles(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return Styles(ColwiseParallel, RowwiseParallel, PrepareModuleInput)


def check_supported(model: nn.Module, degree: int) -> None:
    """Refuse models the plan does not know, and degrees that do not divide their dimensions."""
    config = model.config
    if config.model_type not in TENSOR_PARALLEL_MODEL_TYPES:
        raise ConfigError(f"invalid hyperparameter 'tensor_parallel_degree': {config.model_type} models "
                          "have no supported tensor-parallel plan (these do: "
                          f"{', '.join(TENSOR_PARALLEL_MODEL_TYPES)}); use tensor_parallel_degree=1")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, name, None)
        if value is not None and value % degree:
            raise ConfigError(f"invalid hyperparameter 'tensor_parallel_degree': {degree} does not "
                              f"divide the model's {name} ({value})")


def layer_plan(sequence_parallel: bool, float8: bool) -> dict[str, object]:
    """The parallel styles of one decoder layer's modules."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    styles = _styles(float8)
    columns = {name: styles.colwise() for name in ("self_attn.q_proj", "self_attn.k_proj",
                                                    "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    if not sequence_parallel:
        return {**columns, "self_attn.o_proj": styles.rowwise(), "mlp.down_proj": styles.rowwise()}
    closing = {"output_layouts": Shard(1), "use_local_output": False}  # the residual stays a DTensor
    return {
        **columns,
        "input_layernorm": SequenceParallel(),
        "self_attn": styles.prepare_input(input_kwarg_layouts={"hidden_states": Shard(1)},
                                          desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                          use_local_output=True),
        "self_attn.o_proj": styles.rowwise(**closing),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": styles.prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True),
        "mlp.down_proj": styles.rowwise(**closing),
    }


def outer_plan(causal_lm: nn.Module, sequence_parallel: bool) -> dict[str, object]:
    """The styles of the embedding, the final norm and the head, of those `causal_lm` holds (a
    pipeline stage may hold none)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    decoder, head = causal_lm.model, causal_lm.lm_head
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {}
    if decoder.embed_tokens is not None:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                                     use_local_output=not sequence_parallel)
    elif sequence_parallel:  # a later stage receives its sequence shard as a local tensor
        plan["model"] = PrepareModuleInput(input_kwarg_layouts={"inputs_embeds": Shard(1)},
                                           desired_input_kwarg_layouts={"inputs_embeds": Shard(1)})
    if head is not None:
        if sequence_parallel:
            plan["model.norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1),
                                          use_local_output=True)
    elif sequence_parallel:  # an earlier stage sends its sequence shard (its norm is an Identity)
        plan["model.norm"] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1),
                                                 use_local_output=True)
    return plan


def apply_tensor_parallel(causal_lm: nn.Module, tp_mesh, *, sequence_parallel: bool, float8: bool) -> None:
    """Split `causal_lm` (a whole model or a pipeline stage, Llama layout) over `tp_mesh`."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_supported(causal_lm, tp_mesh.size())
    from .models import decoder_layers

    plan = layer_plan(sequence_parallel, float8)
    for layer in decoder_layers(causal_lm):
        parallelize_module(layer, tp_mesh, plan)
    parallelize_module(causal_lm, tp_mesh, outer_plan(causal_lm, sequence_parallel))
    _retie(causal_lm)


def _retie(causal_lm: nn.Module) -> None:
    """parallelize_module gives the embedding and the head new parameters; a tied model gets its one
    shared weight back (both are split on the vocabulary, so the shards line up)."""
    embedding, head = causal_lm.model.embed_tokens, causal_lm.lm_head
    if causal_lm.config.tie_word_embeddings and embedding is not None and head is not None:
        head.weight = embedding.weight
