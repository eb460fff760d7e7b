"""What a post-training objective adds to the next-token step of its rows (docs/planning.md,
"Post-training: DPO and GRPO"), from the workload's `ObjectiveLoad` (llmtrain.planner.objective_load):

- the reference model: a frozen copy's parameters, stored and sharded like the policy's (the
  program builds it so), and a forward over every micro batch's rows without gradients (a copy's,
  or the policy's with its LoRA adapters off), its FSDP gathers hidden behind its compute as far as
  the compute lasts;
- generation (GRPO): each micro batch's rows sampled with the KV cache before it trains: a prefill
  forward over the prompts, then `sampled_tokens` decode steps, each reading every weight once (and
  the KV cache so far) for one token per row: memory-bound until the rows' FLOPs catch up (a
  roofline of the GPU's bandwidth and its matmul rate), and its KV cache in memory while sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmtrain.core.instances import GpuModel
from llmtrain.planner.compute_times import Rates, layer_times
from llmtrain.planner.model_states import model_states
from llmtrain.planner.precision import FP32, LOW, regime
from llmtrain.planner.shapes import ParameterTensor
from llmtrain.planner.sharding import parameter_tensors
from llmtrain.planner.speed_calibration import Calibration
from llmtrain.planner.workload import Layout, Workload

# Autocast (single, DDP) caches its bf16 copy of a weight that requires gradients for as long as its
# context lasts (one generate call), so a trained weight is read as 2 bytes per decode step; a frozen
# fp32 weight (a LoRA base) is cast again on every step: read 4, write 2, read 2.
CACHED_CAST_BYTES = LOW
RECAST_BYTES = FP32 + 2 * LOW


@dataclass(frozen=True)
class ObjectiveTimes:
    """Seconds per optimizer step the objective adds to its rows' training (0: not this run's)."""

    reference_forward: float = 0.0
    generation_prefill: float = 0.0
    generation_decode: float = 0.0

    @property
    def total(self) -> float:
        return self.reference_forward + self.generation_prefill + self.generation_decode

    def named(self) -> dict[str, float]:
        """The terms this run has, by name."""
        terms = {
            "reference_forward": self.reference_forward,
            "generation_prefill": self.generation_prefill,
            "generation_decode": self.generation_decode,
        }
        return {name: seconds for name, seconds in terms.items() if seconds}


def reference_bytes(work: Workload, layout: Layout) -> int:
    """Parameter storage of the reference copy on one rank: the model without adapters, stored like
    the policy's (fp32 replicated under DDP, fp32 shards and the gathered root under FSDP2)."""
    if not work.objective.reference_copy:
        return 0
    base = replace(work, lora_r=0, quantization="none")
    return model_states(base, layout, parameter_tensors(base)).parameters


def sampling_bytes(work: Workload, layout: Layout) -> int:
    """The KV cache of a micro batch's rows at their last sampled token (keys and values of every
    layer in the compute dtype), what generation holds beside the model's states."""
    if not work.objective.generates:
        return 0
    m = work.model
    compute = regime(work, layout).compute
    return work.micro_batch_size * work.seq_len * m.num_layers * 2 * m.kv_size * compute


def objective_times(
    work: Workload,
    layout: Layout,
    gpu: GpuModel,
    calibration: Calibration,
    forward: float,
    gather_forward: float,
) -> ObjectiveTimes:
    """The objective's seconds per step, given one micro batch's policy forward (`forward`) and its
    FSDP forward gathers (`gather_forward`, which a reference forward repeats)."""
    load, accum = work.objective, work.grad_accum_steps
    reference = accum * max(forward, gather_forward) if load.reference_forward else 0.0
    if not load.generates:
        return ObjectiveTimes(reference_forward=reference)
    return ObjectiveTimes(
        reference,
        accum * _prefill_seconds(work, layout, gpu, calibration),
        accum * _decode_seconds(work, layout, gpu, calibration),
    )


def _prompts(work: Workload) -> Workload:
    """The rows' prompts alone, as the prefill runs them (no gradients, nothing recomputed)."""
    return replace(work, seq_len=work.objective.prompt_tokens, activation_checkpointing="none")


def _prefill_seconds(work: Workload, layout: Layout, gpu: GpuModel, calibration: Calibration) -> float:
    prompts = _prompts(work)
    layers = list(range(work.model.num_layers))
    return layer_times(prompts, layout, gpu, calibration, layers, head=True).forward


def _decode_seconds(work: Workload, layout: Layout, gpu: GpuModel, calibration: Calibration) -> float:
    """`sampled_tokens` steps of one token per row: the weights and the KV cache read once per step,
    or the step's matmul FLOPs at the GPU's rate, whichever takes longer."""
    m, load, rows = work.model, work.objective, work.micro_batch_size
    rates = Rates.of(work, gpu, calibration)
    compute = regime(work, layout).compute
    context = load.prompt_tokens + load.sampled_tokens / 2  # the average step's cache length
    cache = rows * context * m.num_layers * 2 * m.kv_size * compute
    memory = (decode_weight_bytes(work, layout) + cache) / rates.memory
    flops = 2 * m.matmul_parameters() * rows + 4 * m.num_layers * m.attention_width * context * rows
    return load.sampled_tokens * max(memory, flops / rates.matmul)


def decode_weight_bytes(work: Workload, layout: Layout) -> float:
    """Bytes of weights one decode step reads: every weight but the embeddings (one row per token;
    a tied output head reads the whole table), in the dtype the step multiplies it in."""
    tensors, tied = parameter_tensors(work), work.model.tie_embeddings
    if work.precision == "fp32":
        return FP32 * _read_elements(tensors.all, tied)
    if not regime(work, layout).autocast:
        return LOW * _read_elements(tensors.all, tied)
    return CACHED_CAST_BYTES * _read_elements(tensors.trainable, tied) + RECAST_BYTES * _read_elements(
        tensors.frozen, tied
    )


def _read_elements(tensors: tuple[ParameterTensor, ...], tied_head: bool) -> int:
    return sum(
        p.active_numel
        for p in tensors
        if p.kind != "embedding" or (tied_head and p.name.endswith(("embed_tokens.weight", "wte.weight")))
    )
