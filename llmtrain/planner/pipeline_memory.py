"""Memory of a pipeline rank: its stages' parameters and the micro-batches its schedule holds.

A pipeline rank holds its stages' weights, gradients and optimizer states, and the activations of
the micro-batches its schedule has in flight (llmtrain.planner.pipeline.rank_actions replays torch's
order), torch's receive buffers and the last stage's kept logits. The stages are split as the program
splits them (training_jobs.contract.stage_split). docs/planning.md, "The pipeline".
"""

from __future__ import annotations

from llmtrain.planner import pipeline
from llmtrain.planner.activation_memory import (
    BlockTrace,
    checkpointed_block_bytes,
    head_per_token,
    head_weight_copy,
    local_tokens,
    loss_working_bytes,
    rotary_bytes,
)
from llmtrain.planner.precision import FP32, Regime, gathered_bytes, regime
from llmtrain.planner.shapes import ParameterTensor
from llmtrain.planner.sharding import Tensors, parameter_tensors, tp_local_numel
from llmtrain.planner.workload import Layout, Workload
from training_jobs.contract.stage_split import balanced_split, stage_indices


def stage_layer_counts(work: Workload, layout: Layout) -> tuple[int, ...]:
    """Decoder layers per stage: pipeline_split, or the program's split balanced by compute (the
    head costs its parameters over one block's)."""
    if layout.split:
        return layout.split
    params = work.model.parameters()
    block = sum(p.numel for p in params if p.layer == 0)
    head = work.model.vocab_size * work.model.hidden_size
    return balanced_split(work.model.num_layers, layout.num_stages, head / block)


def pipeline_stages(work: Workload, layout: Layout) -> tuple[pipeline.Stage, ...]:
    return pipeline.stages_from_counts(stage_layer_counts(work, layout))


def rank_stages(work: Workload, layout: Layout, rank: int) -> list[pipeline.Stage]:
    stages = pipeline_stages(work, layout)
    return [stages[i] for i in stage_indices(rank, layout.pipeline, layout.stages_per_rank)]


def _holds(stage: pipeline.Stage, param: ParameterTensor) -> bool:
    """The embedding on the first stage, the final norm and head on the last (the others run an
    identity in place of the norm), each block on its stage."""
    if param.layer is not None:
        return param.layer in stage.layers
    return stage.first if param.kind == "embedding" else stage.last


def stage_tensors(work: Workload, stages: list[pipeline.Stage]) -> Tensors:
    held = tuple(p for p in parameter_tensors(work).trainable if any(_holds(s, p) for s in stages))
    return Tensors((), held)


def _stage_memory(work: Workload, layout: Layout, reg: Regime, stage: pipeline.Stage) -> pipeline.StageMemory:
    """What a stage saves per micro-batch: its blocks (as in a whole model), cos and sin, its
    output kept for backward (non-last stages) or the head and the loss (last); minus its input
    where the first block saves the very tensor it received (a receive buffer, counted apart):
    fp32 residuals, or a checkpointed first block. Autocast's weight copies are cached for the
    step, once per stage. The last stage's logits live from its forward until their gradient
    exists (the program frees them then, where torch would keep them for the step's result)."""
    tokens = local_tokens(work, layout)
    hidden = _boundary_bytes(work, layout, reg)
    trace = BlockTrace(work, reg, layout, input_requires_grad=True).trace()
    kept = checkpointed_block_bytes(work, layout, reg, tokens)
    per_mb = copies = 0.0
    uncheckpointed = False
    for layer in stage.layers:
        if kept is not None and layer % work.checkpoint_every == 0:
            per_mb += kept
        else:
            per_mb += sum(trace.per_token.values()) * tokens
            copies += trace.weight_copies
            uncheckpointed = True
    per_mb += rotary_bytes(work, layout, reg) if uncheckpointed else 0
    first_checkpointed = kept is not None and stage.first_layer % work.checkpoint_every == 0
    if not stage.first and (first_checkpointed or reg.residual == FP32):
        per_mb -= hidden
    if stage.last:
        # the logits the schedule keeps are the ones the loss saves: one storage
        per_mb += head_per_token(work, layout, reg) * tokens
        copies += head_weight_copy(work, layout, reg)
    else:
        per_mb += hidden
    between = after = 0.0
    if layout.schedule == "zero_bubble" and not stage.first:
        between = _weight_gradient_inputs(work, layout, reg, stage)
        after = _input_backward_only(work, layout, reg, stage)
    return pipeline.StageMemory(per_mb, between, after, copies)


def _weight_gradient_inputs(work: Workload, layout: Layout, reg: Regime, stage: pipeline.Stage) -> float:
    """Zero bubble's input backward keeps, for the weight backward, the gradient of every output
    a weight produced: each linear's output (compute dtype) and each norm's scaled output (its
    input's dtype), per block; the head's logits and the final norm's output on the last stage."""
    m, t, tokens = work.model, layout.tensor, local_tokens(work, layout)
    h, i, kv = m.hidden_size, m.intermediate_size, m.kv_size
    linears = (h + 2 * kv + 2 * i) / t + 2 * h
    norm_dtype = FP32 if reg.autocast else reg.residual
    per_token = stage.num_layers * (reg.compute * linears + 2 * norm_dtype * h)
    if stage.last:
        per_token += reg.compute * m.vocab_size + norm_dtype * h
    return per_token * tokens


def _input_backward_only(work: Workload, layout: Layout, reg: Regime, stage: pipeline.Stage) -> float:
    """What zero bubble's weight backward leaves of a micro-batch until the step ends, as measured
    here (bench/workers/plan_memory.py, torch 2.13): what only the input gradient needs. Per block:
    SDPA's q, k, v, output and log-sum-exp, both norms' fp32 inputs and 1/rms, and the MLP's gate,
    SiLU and up outputs unless the block ends a stage that is not the last; on the last stage the
    log-softmax and the final norm's input; cos and sin. The stage's first norm input is the
    received activation when it is fp32 (a receive buffer, counted apart)."""
    m, t, tokens = work.model, layout.tensor, local_tokens(work, layout)
    h, kv, i = m.hidden_size, m.kv_size, m.intermediate_size
    per_block = reg.compute * (2 * h + 2 * kv) / t + FP32 * m.num_heads / t + 2 * (FP32 * h + FP32)
    mlp = 3 * reg.compute * i / t
    per_token = stage.num_layers * (per_block + mlp) - (0 if stage.last else mlp)
    per_token -= FP32 * h if reg.residual == FP32 else 0
    if stage.last:
        per_token += FP32 * m.vocab_size + FP32 * h + FP32
    return per_token * tokens + rotary_bytes(work, layout, reg)


def _boundary_bytes(work: Workload, layout: Layout, reg: Regime) -> float:
    """The activation one micro-batch passes between stages on one rank: its tokens' residual
    stream (its sequence shard under sequence parallel)."""
    return reg.residual * work.model.hidden_size * local_tokens(work, layout) / layout.sequence_shards


def receive_buffer_bytes(work: Workload, layout: Layout, stage: pipeline.Stage) -> float:
    """torch allocates, once, a buffer per micro-batch for the activation a non-first stage
    receives and for the gradient a non-last stage receives; zero bubble's input backward also
    leaves each received activation's gradient on its buffer until the next step."""
    hidden = _boundary_bytes(work, layout, regime(work, layout))
    count = (not stage.first) + (not stage.last)
    count += layout.schedule == "zero_bubble" and not stage.first
    return count * work.grad_accum_steps * hidden


def pipeline_activation_bytes(work: Workload, layout: Layout, rank: int) -> tuple[int, dict[str, int]]:
    """The most pipeline rank `rank` holds for backward while its schedule runs (its actions
    replayed), plus the token ids and targets of the step (their storage is the step's whole
    batch) and the receive buffers."""
    reg = regime(work, layout)
    held = rank_stages(work, layout, rank)
    memories = {stage.index: _stage_memory(work, layout, reg, stage) for stage in held}
    actions = pipeline.rank_actions(
        layout.schedule, layout.pipeline, layout.stages_per_rank, work.grad_accum_steps, rank
    )
    peak = pipeline.peak_held(actions, memories)
    step_tokens = local_tokens(work, layout) * work.grad_accum_steps
    ids = 8 * step_tokens * sum(stage.first + stage.last for stage in held)
    buffers = sum(receive_buffer_bytes(work, layout, stage) for stage in held)
    details = {
        "pipeline_rank": rank,
        "pipeline_stages": len(held),
        "pipeline_layers": sum(stage.num_layers for stage in held),
        "pipeline_micro_batches_in_flight": peak.in_flight,
        "pipeline_receive_buffer_bytes": int(buffers),
    }
    return int(peak.bytes + ids + buffers), details


def pipeline_working_bytes(
    work: Workload, layout: Layout, tensors: Tensors, held: list[pipeline.Stage]
) -> int:
    """As for a whole model, on the rank's stages: the loss's working buffers on the last stage (the
    compute-dtype logits are kept, with the activations), one checkpointed block recomputed, FSDP's
    next block gathered and its unsharded gradients in flight."""
    reg = regime(work, layout)
    tokens = local_tokens(work, layout)
    last = any(stage.last for stage in held)
    logits = loss_working_bytes(work, layout, reg, tokens) if last else 0
    recompute = 0
    if work.activation_checkpointing != "none":
        recompute = int(BlockTrace(work, reg, layout, input_requires_grad=True).trace().bytes(tokens))
    block = [p for p in tensors.all if p.layer == held[0].first_layer]
    gathered = 0
    if layout.fsdp_wrapped:
        gathered = sum((gathered_bytes(work, layout, reg, p) + FP32) * tp_local_numel(p, layout.tensor)
                       for p in block)
    return int(logits + recompute + gathered)
