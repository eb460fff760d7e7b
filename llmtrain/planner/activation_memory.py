"""Activation memory per GPU: what autograd saves for backward, and the working buffers at the peak.

The activation terms follow the Hugging Face Llama block op by op (`BlockTrace`: which tensor each
op saves, in which dtype) rather than a fitted constant, so they hold for any width, depth, sequence
and batch; GPT-2 blocks are counted the same way. Checkpointing keeps less per block (full: the
block's input; selective: what the policy keeps). The working buffers are those that exist for a
moment at the peak of a step: the logits' gradient and the loss's chunk, one checkpointed block
recomputed, the next block gathered ahead of use (llmtrain.planner.memory, parts "activations" and
"working").
"""

from __future__ import annotations

from llmtrain.planner.experts import dispatch_bytes_per_token
from llmtrain.planner.precision import FP32, LOW, Regime, gathered_bytes, regime
from llmtrain.planner.sharding import Tensors, lora_targets, tp_local_numel
from llmtrain.planner.workload import Layout, Workload

# Elements of one fp32 chunk of the program's cross-entropy (training_jobs/trainer/loss.py).
LOSS_CHUNK_ELEMENTS = 1 << 24


class BlockTrace:
    """Walks a Llama block op by op, the way autograd records it: which tensors each op saves for
    backward (per token of the rank's part of the sequence, keyed so that a tensor saved twice
    counts once), which weights autocast copies and keeps (per block, not per token), and which
    outputs require a gradient.

    Under tensor parallel with sequence parallel the norms run on the rank's 1 / tp of the tokens
    and each region opens with an all-gather of the norm's output (a new tensor, what the region's
    linears keep); under context parallel attention keeps the keys and values of the whole sequence
    (all-gathered and repeated to the query heads: `context` x a query's width per local token) and
    its output twice (SDPA's two chunks and o_proj's contiguous input)."""

    def __init__(
        self, work: Workload, reg: Regime, layout: Layout, input_requires_grad: bool, on_gpu: bool = True
    ) -> None:
        self.work, self.reg, self.on_gpu = work, reg, on_gpu
        self.t, self.sp, self.c = layout.tensor, layout.sequence_shards, layout.context
        self.per_token: dict[str, float] = {}
        self.weight_copies = 0.0
        self.grad: dict[str, bool] = {"input": input_requires_grad}
        self.adapted = _adapted_modules(work)

    def save(self, key: str, bytes_per_token: float) -> None:
        self.per_token[key] = bytes_per_token

    def norm(self, name: str, source: str) -> None:
        """RMSNorm in fp32: the (upcast) input and 1/rms for the input's gradient, the normalized
        value (in the input dtype) for the scale's; on 1 / tp of the tokens with sequence parallel."""
        h = self.work.model.hidden_size
        trains_scale = not self.work.lora
        if self.grad[source]:
            self.save(f"{name}.x", FP32 * h / self.sp)
            self.save(f"{name}.rstd", FP32 / self.sp)
        if trains_scale:
            self.save(f"{name}.y", self.reg.residual * h / self.sp)
        self.grad[name] = self.grad[source] or trains_scale

    def region_input(self, norm: str) -> str:
        """The tensor a tensor-parallel region's linears take: the norm's output, or under sequence
        parallel its all-gather (full width, every token of the rank's sequence part)."""
        return norm if self.sp == 1 else f"{norm}.gathered"

    def linear(self, module: str, source: str, d_in: int, d_out: int, source_bytes: float,
               saved: str | None = None) -> None:
        """A linear layer taking `source` (whose gradient flag it reads) as the tensor `saved` (the
        key of what it keeps; `source` itself unless a collective made a new tensor of it)."""
        trains_weight = not self.work.lora
        needs_input_grad = self.grad[source]
        cast_input = self.reg.autocast and source_bytes == FP32 * d_in
        if trains_weight:
            self._save_input(f"{module}.input", saved or source, d_in, source_bytes, cast_input)
        # torchao's Float8Linear keeps its high-precision weight itself, not an autocast copy.
        if self.reg.autocast and (trains_weight or needs_input_grad) and not self.work.fp8:
            self.weight_copies += LOW * d_in * d_out
        adapted = module in self.adapted
        if adapted:
            self._adapter(module, source, d_in, d_out, source_bytes, cast_input, needs_input_grad)
        self.grad[module] = needs_input_grad or trains_weight or adapted

    def _save_input(self, key: str, source: str, d_in: int, source_bytes: float, cast: bool) -> None:
        if cast:
            self.save(key, LOW * d_in)  # autocast copies a fp32 input at every call
        else:
            self.save(source, source_bytes)

    def _adapter(
        self,
        module: str,
        source: str,
        d_in: int,
        d_out: int,
        source_bytes: float,
        cast_input: bool,
        needs_input_grad: bool,
    ) -> None:
        """peft's LoRA: B(A(dropout(x))) x scale, with x first cast to the adapter weights' dtype.
        lora_A saves its input (dropout's output, or x itself; under autocast always a fresh
        compute-dtype copy, since peft casts x to the fp32 adapter dtype first), lora_B lora_A's
        output; dropout saves its mask when x needs a gradient: a bool tensor on CUDA, the scaled
        noise in the adapter dtype on a CPU."""
        r, e = self.work.lora_r, self.reg.compute
        adapter_dtype = FP32 if self.reg.autocast or self.reg.compute == FP32 else LOW
        if self.work.lora_dropout > 0:
            if needs_input_grad:
                self.save(f"{module}.dropout_mask", (1 if self.on_gpu else adapter_dtype) * d_in)
            self.save(f"{module}.dropout_out", (LOW if self.reg.autocast else adapter_dtype) * d_in)
        elif self.reg.autocast:
            self.save(f"{module}.lora_input", LOW * d_in)
        else:
            self._save_input(f"{module}.lora_input", source, d_in, source_bytes, cast_input)
        self.save(f"{module}.lora_a_out", e * r)
        if self.reg.autocast:
            self.weight_copies += LOW * r * d_out + (LOW * r * d_in if needs_input_grad else 0)

    def trace(self) -> BlockTrace:
        m, t, e = self.work.model, self.t, self.reg.compute
        h, i, kv, q = m.hidden_size, m.token_intermediate_size, m.kv_size, m.attention_width
        region_bytes = (FP32 if self.reg.autocast else self.reg.residual) * h
        self.norm("norm1", "input")
        for module, d_out in (("q_proj", q // t), ("k_proj", kv // t), ("v_proj", kv // t)):
            self.linear(module, "norm1", h, d_out, region_bytes, self.region_input("norm1"))
        self.grad["attn"] = self.grad["q_proj"] or self.grad["k_proj"] or self.grad["v_proj"]
        if self.grad["attn"]:
            self._attention()
        self.linear("o_proj", "attn", q // t, h, e * q / t, "attn" if self.c == 1 else "attn.contiguous")
        self.grad["mid"] = self.grad["input"] or self.grad["o_proj"]
        self.norm("norm2", "mid")
        for module in ("gate_proj", "up_proj"):
            self.linear(module, "norm2", h, i // t, region_bytes, self.region_input("norm2"))
        if self.grad["gate_proj"]:
            self.save("gate", e * i / t)
        if self.grad["gate_proj"] or self.grad["up_proj"]:
            self.save("silu", e * i / t)
            self.save("up", e * i / t)
        self.grad["prod"] = self.grad["gate_proj"] or self.grad["up_proj"]
        self.linear("down_proj", "prod", i // t, h, e * i / t)
        if m.moe:
            # a mixture of experts' dispatch and combine buffers, averaged over the layers
            self.save("moe_dispatch", dispatch_bytes_per_token(m, e) * m.moe_layers / m.num_layers)
        return self

    def _attention(self) -> None:
        """What SDPA keeps: its inputs (q and k after rotary, v), its output and its fp32
        log-sum-exp; under context parallel the keys and values of the whole sequence repeated to
        the query heads, and the output once more as o_proj's contiguous input (the two query
        chunks' outputs are concatenated and transposed)."""
        m, t, e, c = self.work.model, self.t, self.reg.compute, self.c
        h, kv = m.attention_width, m.kv_size
        if c == 1:
            widths = (("q_rotary", h / t), ("k_rotary", kv / t), ("v", kv / t), ("attn", h / t))
        else:
            widths = (("q_rotary", h / t), ("keys", c * h / t), ("values", c * h / t), ("attn", h / t),
                      ("attn.contiguous", h / t))
        for key, width in widths:
            self.save(key, e * width)
        self.save("lse", FP32 * m.num_heads / t)

    def bytes(self, tokens: int) -> float:
        return sum(self.per_token.values()) * tokens + self.weight_copies


def _adapted_modules(work: Workload) -> set[str]:
    if not work.lora:
        return set()
    return {p.module for p in lora_targets(work.model, work.lora_targets)}


def local_tokens(work: Workload, layout: Layout) -> int:
    """Tokens of one micro batch on one rank: its part of every sequence under context parallel."""
    return work.micro_batch_tokens // layout.context


def _block_traces(
    work: Workload, layout: Layout, reg: Regime, on_gpu: bool = True
) -> tuple[BlockTrace, BlockTrace]:
    """The first block (whose input needs no gradient when the embedding is frozen, as with LoRA)
    and every other block."""
    first = BlockTrace(work, reg, layout, input_requires_grad=not work.lora, on_gpu=on_gpu)
    rest = BlockTrace(work, reg, layout, input_requires_grad=True, on_gpu=on_gpu)
    return first.trace(), rest.trace()


def _matmul_widths(work: Workload, layout: Layout) -> list[float]:
    """Output widths per token of a block's matmuls in the order it runs them (LoRA's two matmuls
    per adapted projection after their base's); o and down write the full width (partial sums
    under tensor parallel)."""
    m, t = work.model, layout.tensor
    h, i, kv = m.hidden_size, m.token_intermediate_size, m.kv_size
    adapted = _adapted_modules(work)
    outputs = {
        "q_proj": h / t,
        "k_proj": kv / t,
        "v_proj": kv / t,
        "o_proj": h,
        "gate_proj": i / t,
        "up_proj": i / t,
        "down_proj": h,
    }
    matmuls = []
    for module, width in outputs.items():
        matmuls.append(width)
        if module in adapted:
            matmuls += [work.lora_r, width]
    return matmuls


def _selective_bytes(work: Workload, layout: Layout, reg: Regime, tokens: int) -> float:
    """What a selectively checkpointed block keeps, per its code's policy: the block's input (which
    the checkpoint keeps; 1 / tp of the tokens with sequence parallel), SDPA's output and
    log-sum-exp, and
    - torchtitan's op-level policy (this program): every other matmul's output in the block's
      order (the 1st, 3rd, ...: q, v, gate and down without adapters; LoRA's two matmuls per adapted
      projection take their turns) and, with sequence parallel, the outputs of the two
      reduce-scatters that close the tensor-parallel regions;
    - older code ("every_matmul"): every matmul's output."""
    m, t, e = work.model, layout.tensor, reg.compute
    h = m.hidden_size
    matmuls = _matmul_widths(work, layout)
    per_token = reg.residual * h / layout.sequence_shards + e * h / t + FP32 * m.num_heads / t
    if work.behaviour.selective_policy == "every_matmul":
        return (per_token + e * sum(matmuls)) * tokens
    per_token += e * sum(matmuls[0::2])
    if layout.sequence_parallel:
        per_token += 2 * e * h / layout.tensor
    return per_token * tokens


def checkpointed_block_bytes(work: Workload, layout: Layout, reg: Regime, tokens: int) -> float | None:
    """What a checkpointed block keeps; None without checkpointing."""
    if work.activation_checkpointing == "full":
        return reg.residual * work.model.hidden_size * tokens / layout.sequence_shards
    if work.activation_checkpointing == "selective":
        return _selective_bytes(work, layout, reg, tokens)
    return None


def _head_bytes(work: Workload, layout: Layout, reg: Regime, tokens: int) -> float:
    """After the blocks: the final norm, the output head's input (or, frozen under autocast, its
    weight copy), the loss and the token ids the embedding and the loss keep."""
    ids = 8 + (8 if not work.lora else 0)
    return (head_per_token(work, layout, reg) + ids) * tokens + head_weight_copy(work, layout, reg)


def head_per_token(work: Workload, layout: Layout, reg: Regime) -> float:
    """The final norm (on 1 / tp of the tokens with sequence parallel), the head's input (all of the
    rank's tokens) and the loss's: with the chunked loss the logits as the head computed them (the
    rank's vocabulary shard under loss parallel), an fp32 log-sum-exp and a flag per token; older
    code's cross-entropy kept an fp32 log-softmax of the whole vocabulary instead."""
    h = work.model.hidden_size
    trains = not work.lora
    per_token = (FP32 * h + FP32 + (reg.residual * h if trains else 0)) / layout.sequence_shards
    per_token += (LOW if reg.autocast else reg.compute) * h if trains else 0
    if not work.behaviour.chunked_loss:
        return per_token + FP32 * work.model.vocab_size
    return per_token + _logit_bytes(reg) * _vocabulary_shard(work, layout) + FP32 + 1


def _vocabulary_shard(work: Workload, layout: Layout) -> float:
    """Vocabulary entries whose logits one rank computes: its shard under loss parallel."""
    return work.model.vocab_size / (layout.tensor if work.behaviour.loss_parallel else 1)


def _logit_bytes(reg: Regime) -> int:
    return LOW if reg.autocast else reg.compute


def head_weight_copy(work: Workload, layout: Layout, reg: Regime) -> float:
    """Autocast's compute-dtype copy of the output head's weight (the rank's vocabulary shard)."""
    return LOW * _vocabulary_shard(work, layout) * work.model.hidden_size if reg.autocast else 0


def rotary_bytes(work: Workload, layout: Layout, reg: Regime) -> float:
    """cos and sin of the rank's positions, shared by the blocks that save them."""
    return 2 * work.seq_len / layout.context * work.model.head_dim * reg.residual


def activation_bytes(work: Workload, layout: Layout, on_gpu: bool = True) -> tuple[int, dict[str, int]]:
    """Bytes saved for backward during one micro batch's forward, on one rank."""
    if work.model.family != "llama":
        return _gpt2_activation_bytes(work, layout)
    reg = regime(work, layout)
    tokens = local_tokens(work, layout)
    m = work.model
    first, rest = _block_traces(work, layout, reg, on_gpu)
    kept = checkpointed_block_bytes(work, layout, reg, tokens)
    blocks = 0.0
    for layer in range(m.num_layers):
        checkpointed = kept is not None and layer % work.checkpoint_every == 0
        blocks += kept if checkpointed else (first if layer == 0 else rest).bytes(tokens)
    head = _head_bytes(work, layout, reg, tokens)
    # cos and sin, shared by the blocks that save them (a checkpointed block keeps them only as
    # its inputs, outside autograd's saved tensors)
    uncheckpointed = m.num_layers - work.checkpointed_layers
    rotary = rotary_bytes(work, layout, reg) if uncheckpointed else 0
    total = int(blocks + head + rotary)
    return total, {"activation_block_bytes": int(rest.bytes(tokens)), "activation_head_bytes": int(head)}


def _gpt2_activation_bytes(work: Workload, layout: Layout) -> tuple[int, dict[str, int]]:
    """GPT-2 blocks op by op (LayerNorm keeps its input, mean and 1/std; Conv1D its input; SDPA the
    fused q/k/v projection, its output and log-sum-exp; the tanh GELU four intermediates; the
    second Conv1D the GELU's output); dropout is off in the presets. Autocast copies the LayerNorms'
    fp32 outputs and every weight to the compute dtype."""
    reg = regime(work, layout)
    m, tokens, e = work.model, work.micro_batch_tokens, reg.compute
    h, i = m.hidden_size, m.intermediate_size
    norm = (FP32 if reg.autocast else reg.residual) * h + 2 * FP32  # input, mean, 1/std
    norm_output = (LOW if reg.autocast else e) * h  # what the next Conv1D keeps
    per_token = 2 * (norm + norm_output) + e * (3 * h + h) + FP32 * m.num_heads + 5 * e * i
    block_weights = sum(p.numel for p in m.parameters() if p.kind == "linear" and p.layer == 0)
    full_block = per_token * tokens + (LOW * block_weights if reg.autocast else 0)
    if work.activation_checkpointing == "full":
        kept = reg.residual * h * tokens
    elif work.activation_checkpointing == "selective":  # attention and every other matmul: c_attn, c_fc
        matmuls = 3 * h + i if work.behaviour.selective_policy != "every_matmul" else 3 * h + i + 2 * h
        kept = (reg.residual * h + e * (h + matmuls) + FP32 * m.num_heads) * tokens
    else:
        kept = full_block
    checkpointed = work.checkpointed_layers
    blocks = checkpointed * kept + (m.num_layers - checkpointed) * full_block
    loss = _logit_bytes(reg) * m.vocab_size + FP32 + 1 if work.behaviour.chunked_loss else FP32 * m.vocab_size
    head = (norm + norm_output + loss + 8 + 8) * tokens + 8 * work.seq_len
    head += LOW * m.vocab_size * h if reg.autocast else 0
    return int(blocks + head), {"activation_block_bytes": int(full_block), "activation_head_bytes": int(head)}


# --- working buffers ------------------------------------------------------------------------------


def working_bytes(work: Workload, layout: Layout, tensors: Tensors) -> int:
    """Transient buffers at the peak (beginning of backward): the logits' gradient and the loss's
    fp32 working copy; one checkpointed block recomputed; for FSDP the next block gathered ahead
    and one block's unsharded gradients; for ZeRO-3 the gathered block."""
    m = work.model
    reg = regime(work, layout)
    tokens = local_tokens(work, layout)
    recompute = 0
    if work.activation_checkpointing != "none" and m.family == "llama":
        recompute = int(_block_traces(work, layout, reg)[1].bytes(tokens))
    # the last block: a mixture of experts' leading layers are dense, its last has experts
    block = [p for p in tensors.all if p.layer == m.num_layers - 1]
    gathered = 0
    if layout.fsdp_wrapped:
        # prefetched block (FP8 weights gathered in one byte) + its unsharded fp32 gradients
        gathered = sum((gathered_bytes(work, layout, reg, p) + FP32) * tp_local_numel(p, layout.tensor)
                       for p in block)
    elif layout.strategy == "deepspeed" and layout.zero_stage == 3:
        gathered = 2 * reg.compute * sum(tp_local_numel(p, layout.tensor) for p in block)
    return int(loss_working_bytes(work, layout, reg, tokens) + recompute + gathered)


def loss_working_bytes(work: Workload, layout: Layout, reg: Regime, tokens: int) -> float:
    """The chunked loss: the logits' gradient in their dtype and one fp32 chunk of its backward (64
    MiB at most), on the rank's vocabulary shard; older code: the logits, the fp32 log-softmax's
    gradient and the fp32 logits' gradient, of the whole vocabulary."""
    if not work.behaviour.chunked_loss:
        return (reg.compute + FP32 + FP32) * work.model.vocab_size * tokens
    shard = _vocabulary_shard(work, layout) * tokens
    return _logit_bytes(reg) * shard + FP32 * min(shard, LOSS_CHUNK_ELEMENTS)
