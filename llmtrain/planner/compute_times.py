"""Compute of one micro-batch on one rank: matmuls, attention and memory-bound work.

Each kind of work runs at the rate its GPU runs it (docs/planning.md, "Speed"):

- matmuls: 2 FLOPs per weight and token forward, 2 for the input gradient and 2 for the weight
  gradient, plus what activation checkpointing recomputes, over the tensor-parallel ranks; at the
  GPU's dense bf16 peak (FP8 peak for the layers FP8 converts) times `matmul_efficiency`;
- attention: the causal half of the scores' 4 x hidden x sequence FLOPs per token and layer forward
  and 2.5 times that backward (the kernel recomputes the scores), at the GPU's FlashAttention-2
  efficiency (`GpuModel.attention_efficiency`, measured by the same count);
- the rest (norms, rotary embeddings, activations, residual adds, casts, the loss): bytes moved
  through the GPU's memory at its bandwidth, per element of the activations those operations touch;
  and, where FSDP2 keeps gradients unsharded between micro-batches, adding each micro-batch's into
  them (`ACCUMULATE_BYTES_PER_ELEMENT`).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.core.instances import GpuModel
from llmtrain.planner.activation_memory import local_tokens
from llmtrain.planner.pipeline import Stage
from llmtrain.planner.sharding import Tensors, tp_local_numel
from llmtrain.planner.speed_calibration import CALIBRATION, Calibration
from llmtrain.planner.workload import Layout, Workload

# FlashAttention's backward recomputes the attention scores (Q K^T) and computes dV, dP, dQ and dK:
# 5 matmuls of the forward's size to its 2, 2.5 times the forward's FLOPs. The attention
# efficiencies (GpuModel.attention_efficiency) are rates measured by that count (FlashAttention-2's
# and -3's benchmarks: forward + backward = 3.5 x the forward's FLOPs), so the time counts it too.
ATTENTION_BACKWARD_PASSES = 2.5


def block_matmul_weights(m) -> float:
    """Weights one token multiplies in an average decoder block (a mixture of experts: its router,
    shared experts and top-k routed experts)."""
    return dense_block_weights(m) + expert_block_weights(m)


def dense_block_weights(m) -> float:
    return sum(p.numel for p in m.parameters() if p.kind == "linear" and p.layer is not None) / m.num_layers


def expert_block_weights(m) -> float:
    """The routed experts' share of block_matmul_weights: grouped matmuls."""
    return sum(p.active_numel for p in m.parameters() if p.kind == "expert") / m.num_layers


def selective_recompute(work: Workload) -> float:
    """The share of a block's matmul FLOPs the code's selective policy recomputes: torchtitan's
    op-level one (this program) every second matmul, of q, k, v, o, gate, up, down the k, o and up
    projections (GPT-2: c_proj and the MLP's c_proj of c_attn, c_proj, c_fc, c_proj); older code's,
    which kept every matmul's output, none."""
    if work.behaviour.selective_policy == "every_matmul":
        return 0.0
    m = work.model
    h, i, kv = m.hidden_size, m.token_intermediate_size, m.kv_size
    if m.family != "llama":
        return (h * h + i * h) / (3 * h * h + h * h + 2 * i * h)
    return (kv * h + h * h + i * h) / (2 * h * h + 2 * kv * h + 3 * i * h)


def recompute_flops_per_token(work: Workload) -> float:
    """Forward FLOPs activation checkpointing repeats in backward, per token (whole model, one
    rank without tensor parallel): the whole forward of a fully checkpointed block (its attention
    at the model-FLOPs convention, 4 x hidden x sequence); under selective checkpointing the
    matmuls the policy recomputes."""
    m = work.model
    blocks = work.checkpointed_layers
    block = block_matmul_weights(m)
    if work.activation_checkpointing == "full":
        return blocks * (2 * block + 4 * m.hidden_size * work.seq_len)
    if work.activation_checkpointing == "selective":
        return blocks * 2 * block * selective_recompute(work)
    return 0.0


@dataclass(frozen=True)
class StageTimes:
    """Seconds of one micro-batch on one rank's layers (a whole model or a pipeline stage): forward,
    the input-gradient part of backward (with what checkpointing recomputes) and the
    weight-gradient part; `parts` splits their sum into matmuls, attention and memory-bound work."""

    forward: float
    backward_input: float
    backward_weight: float
    parts: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def total(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


@dataclass(frozen=True)
class Rates:
    """The GPU's rates for one run: FLOP/s of bf16 and FP8 matmuls and of attention, bytes/s of its
    memory."""

    matmul: float
    fp8_matmul: float
    attention: float
    memory: float

    @classmethod
    def of(cls, work: Workload, gpu: GpuModel, calibration: Calibration) -> Rates:
        precision = calibration.fp32_peak_fraction if work.precision == "fp32" else 1.0
        efficiency = calibration.matmul_efficiency(gpu)
        matmul = gpu.peak_flops * precision * efficiency
        fp8 = gpu.fp8_peak_flops * efficiency if work.fp8 and gpu.has_fp8 else matmul
        attention = gpu.peak_flops * precision * gpu.attention_efficiency
        return cls(matmul, fp8, attention, gpu.memory_bytes_per_second)


def _elementwise_elements(work: Workload, layout: Layout) -> float:
    """Activation elements per token a decoder layer's non-matmul operations touch on one rank:
    the residual stream's four (two norms, two adds) on 1 / tp of the tokens with sequence
    parallel, and inside the tensor-parallel regions (split by heads and columns) q and k's rotary
    embedding, v, and the MLP's three intermediates (GPT-2: q, k, v and the GELU's input)."""
    m, t = work.model, layout.tensor
    h, i, kv = m.hidden_size, m.token_intermediate_size, m.kv_size
    region = (3 * h + i) if m.family != "llama" else (h + 2 * kv + 3 * i)
    return 4 * h / layout.sequence_shards + region / t


def _fp8_cast_elements(work: Workload, layout: Layout) -> float:
    """Elements per token FP8 casts per decoder layer: each converted linear's input and output
    (gradient), on one rank (q, k, v and gate, up each cast the region's input themselves)."""
    if not work.fp8:
        return 0.0
    m, t = work.model, layout.tensor
    h, i, kv = m.hidden_size, m.token_intermediate_size, m.kv_size
    inputs = 5 * h + h / t + i / t
    outputs = (h + 2 * kv + 2 * i) / t + 2 * h
    return inputs + outputs


def layer_times(
    work: Workload,
    layout: Layout,
    gpu: GpuModel,
    calibration: Calibration,
    layers: list[int],
    head: bool,
) -> StageTimes:
    """One micro-batch of `layers` (decoder layer indices) and, with `head`, the output head and the
    loss, on one rank: matmuls, attention and memory-bound work, forward and backward, with what
    checkpointing recomputes."""
    m, t = work.model, layout.tensor
    tokens = local_tokens(work, layout)
    rates = Rates.of(work, gpu, calibration)
    h, s = m.hidden_size, work.seq_len
    checkpointed = sum(1 for layer in layers if work.activation_checkpointing != "none"
                       and layer % work.checkpoint_every == 0)
    # the routed experts' grouped matmuls run at a fraction of a dense matmul's rate
    block = (dense_block_weights(m) + expert_block_weights(m) / calibration.grouped_matmul_fraction) / t
    head_weights = m.vocab_size * h / t if head else 0.0
    # per token: one matmul pass (2 FLOPs per weight) of the blocks and of the head
    block_pass = 2 * block * len(layers) * tokens / rates.fp8_matmul
    head_pass = 2 * head_weights * tokens / rates.matmul
    if work.activation_checkpointing == "full":
        recompute_share = 1.0
    elif work.activation_checkpointing == "selective":
        recompute_share = selective_recompute(work)
    else:
        recompute_share = 0.0
    recompute_matmul = block_pass * recompute_share * checkpointed / max(len(layers), 1)
    # causal attention: 2 x hidden x sequence FLOPs per token forward; the flash kernel's backward
    # recomputes the scores, 5 matmuls to the forward's 2 (ATTENTION_BACKWARD_PASSES)
    attention_pass = 2 * m.attention_width * s / t * len(layers) * tokens / rates.attention
    recompute_attention = attention_pass / len(layers) * checkpointed if layers and \
        work.activation_checkpointing == "full" else 0.0
    bytes_per_element = calibration.elementwise_bytes(work.compile)
    elements = _elementwise_elements(work, layout) * len(layers) * tokens
    elementwise = bytes_per_element * elements / rates.memory
    casts = (calibration.fp8_cast_bytes(work.compile) * _fp8_cast_elements(work, layout) * len(layers)
             * tokens / rates.memory)
    loss = calibration.loss_bytes_per_vocabulary * m.vocab_size / t * tokens / rates.memory if head else 0.0
    recompute_memory = (elementwise + casts) / 3 * checkpointed / max(len(layers), 1)
    matmuls = block_pass + head_pass
    memory_bound = elementwise + casts + loss
    forward = matmuls + attention_pass + memory_bound / 3
    backward_input = (matmuls + ATTENTION_BACKWARD_PASSES * attention_pass + memory_bound / 3
                      + recompute_matmul + recompute_attention + recompute_memory)
    backward_weight = matmuls + memory_bound / 3
    parts = (
        3 * matmuls + recompute_matmul,
        (1 + ATTENTION_BACKWARD_PASSES) * attention_pass + recompute_attention,
        memory_bound + recompute_memory,
    )
    return StageTimes(forward, backward_input, backward_weight, parts)


def stage_times(work: Workload, layout: Layout, stage: Stage, gpu: GpuModel,
                calibration: Calibration = CALIBRATION) -> StageTimes:
    """One micro-batch of a stage: its layers, and the head and loss on the last."""
    return layer_times(work, layout, gpu, calibration, list(stage.layers), head=stage.last)


# FSDP2 accumulating a micro-batch's bf16 gradient into its fp32 unsharded gradient (reduce_dtype
# fp32, no reduction until the last micro-batch): read 2 and 4 bytes, write 4, per element.
ACCUMULATE_BYTES_PER_ELEMENT = 10


def accumulation_seconds(work: Workload, layout: Layout, gpu: GpuModel, tensors: Tensors) -> float:
    """Seconds one micro-batch's backward spends adding its gradients of `tensors` into FSDP2's fp32
    unsharded gradients, where the program keeps them unsharded until the last micro-batch
    (pipeline stages; grad_op sharding): memory-bound, on the critical path."""
    unsharded = layout.pipelined or layout.fsdp_sharding == "grad_op"
    if not (layout.fsdp_wrapped and unsharded) or work.grad_accum_steps <= 1:
        return 0.0
    elements = sum(tp_local_numel(p, layout.tensor) for p in tensors.trainable)
    return ACCUMULATE_BYTES_PER_ELEMENT * elements / gpu.memory_bytes_per_second
