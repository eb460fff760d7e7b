"""The parts of sequence, loss and context parallelism that run in one process: the chunked
cross-entropy against PyTorch's, what it keeps for backward, what the selective checkpointing policy
keeps, the context-parallel split of a sequence, and the settings' rules. The distributed runs are in
test_scale.py; what each rank holds under sequence and loss parallel in test_scale_memory.py."""

from __future__ import annotations

import pytest
import torch

from training_jobs.contract.hyperparameters import ConfigError, from_hyperparameters
from training_jobs.trainer import loss, parallel
from training_jobs.trainer.context_parallel import SequenceSplit
from training_jobs.trainer.data import IGNORE_INDEX


def _saved_tensors(function):
    """(shape, dtype) of every tensor autograd saves while `function` runs."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = function()
    return result, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_cross_entropy_is_pytorchs_in_chunks(monkeypatch, dtype):
    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 96 * 5)  # 5 tokens per chunk: 7 chunks of 32 tokens
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 16, 96, generator=generator) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 96, (2, 16), generator=generator)
    targets[0, :5] = IGNORE_INDEX
    reference = logits.detach().clone().requires_grad_()
    expected = torch.nn.functional.cross_entropy(reference.float().reshape(-1, 96), targets.reshape(-1),
                                                 reduction="sum")
    expected.backward()
    result = loss.causal_lm_loss_sum(logits, targets)
    result.backward()
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-4)
    assert logits.grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # bf16 gradients round at 2^-8 of their size
    torch.testing.assert_close(logits.grad, reference.grad, rtol=0, atol=tolerance)
    assert logits.grad[0, :5].abs().max() == 0  # ignored targets train nothing
    assert loss.causal_lm_loss(logits, torch.full_like(targets, IGNORE_INDEX)).item() == 0.0


def test_the_loss_keeps_the_logits_as_they_are_and_no_fp32_copy():
    """PyTorch's cross-entropy of bf16 logits saves an fp32 log-softmax as large as the logits; the
    chunked loss saves the bf16 logits themselves and four bytes per token."""
    logits = torch.randn(2, 16, 96, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 96, (2, 16))
    _, pytorch = _saved_tensors(lambda: torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, 96), targets.reshape(-1), reduction="sum"))
    assert ((32, 96), torch.float32) in pytorch
    _, chunked = _saved_tensors(lambda: loss.causal_lm_loss_sum(logits, targets))
    assert ((32, 96), torch.bfloat16) in chunked
    assert all(shape[-1] != 96 for shape, dtype in chunked if dtype == torch.float32)
    assert sum(torch.Size(shape).numel() for shape, _ in chunked if shape != (32, 96)) <= 3 * 32


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


FUSED_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _dispatched(layer, hidden, positions) -> set[str]:
    """The names of the operators a layer's forward dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Recorder() as recorder:
        layer(hidden, position_embeddings=positions)
    return recorder.names


def _kept(storage) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of the outputs a selective checkpoint's forward kept, by operator (the storage of
    torch's caching dispatch mode: per operator, its calls' outputs, or a marker where recomputed)."""
    from torch.utils import checkpoint

    kept = {}
    for op, entries in storage.items():
        firsts = [value[0] if isinstance(value, tuple) else value  # a kernel's first output
                  for value in (entries.values() if isinstance(entries, dict) else entries)]
        outputs = [value.val if isinstance(value, checkpoint._VersionWrapper) else value for value in firsts]
        outputs = [output for output in outputs if isinstance(output, torch.Tensor)]
        if outputs:
            kept[str(op)] = [tuple(output.shape) for output in outputs]
    return kept


def test_the_selective_policy_keeps_attention_and_every_other_projection_of_a_layer():
    """A Llama layer's matmuls run q, k, v, o, gate, up, down: the policy keeps q, v, gate and down
    and the attention output, and recomputes k, o, up, the norms, rotary embeddings and activations."""
    from torch.utils.checkpoint import checkpoint

    model = _tiny_llama()
    layer = model.model.layers[0]
    hidden = torch.randn(2, 16, 64, requires_grad=True)
    positions = model.model.rotary_emb(hidden, torch.arange(16).unsqueeze(0))
    contexts = []

    def keep_contexts():
        contexts.append(parallel._selective_contexts())
        return contexts[-1]

    out = checkpoint(layer, hidden, position_embeddings=positions, use_reentrant=False,
                     context_fn=keep_contexts)
    forward_mode = contexts[0][0]
    kept = _kept(forward_mode.storage)
    tokens = 2 * 16
    assert kept.pop("aten.mm.default") == [(tokens, 64), (tokens, 32), (tokens, 176), (tokens, 64)]
    # the output of the attention kernel (its log-sum-exp beside it), where torch runs a fused one:
    # torch 2.8 on the CPU (the DLC's torch, make test-container) takes the math path for this
    # layer, whose small ops the policy recomputes
    fused = {f"aten.{name}.default" for name in FUSED_ATTENTION} & _dispatched(layer, hidden, positions)
    assert {op: kept.pop(op) for op in fused} == {op: [(2, 4, 16, 16)] for op in fused}
    assert kept == {}
    out.sum().backward()  # the recompute sees the same matmuls in the same order
    reference = hidden.detach().clone().requires_grad_()
    layer(reference, position_embeddings=positions).sum().backward()
    torch.testing.assert_close(hidden.grad, reference.grad)


def test_each_context_rank_holds_an_early_and_a_late_chunk():
    tokens = torch.arange(16).unsqueeze(0).repeat(2, 1)
    parts = [SequenceSplit(rank, 2) for rank in range(2)]
    assert [split.chunks for split in parts] == [(0, 3), (1, 2)]
    assert parts[0].shard(tokens)[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert parts[1].shard(tokens)[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert parts[1].positions(8, torch.device("cpu")).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    # gathered in rank order (0, 3, 1, 2): chunk k of the sequence is gathered chunk natural_order[k]
    assert parts[0].natural_order == [0, 2, 3, 1]
    four = [SequenceSplit(rank, 4) for rank in range(4)]
    assert sorted(chunk for split in four for chunk in split.chunks) == list(range(8))
    assert {sum(split.chunks) for split in four} == {7}  # the same causal work on every rank


def test_context_parallel_settings_are_checked_before_anything_runs():
    base = {"parallelism": "fsdp", "context_parallel_degree": 2, "seq_len": 32}
    assert from_hyperparameters(base).parallel.context_parallel_degree == 2
    for extra, message in [({"parallelism": "ddp"}, "1 with parallelism=ddp"),
                           ({"seq_len": 30}, "divide seq_len \\(30\\) evenly"),
                           ({"attention": "eager"}, "'attention': got 'eager'"),
                           ({"lora_r": 8}, "LoRA with context parallel is not supported")]:
        with pytest.raises(ConfigError, match=message):
            from_hyperparameters({**base, **extra})
    assert from_hyperparameters({}).parallel.sequence_parallel is True
