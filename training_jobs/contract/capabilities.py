"""What this version of the training program does, in the platform's words: its capability table.

The platform plans a run (llmtrain/planner) with the behaviour of the code the run's template
version runs. A published version runs its frozen code (templates/_code/<hash>.tar.gz), which may
predate a feature or do it differently, so the planner reads this table from the version's own
contract (llmtrain/core/program_contract.py loads it in isolation, like the rest of the contract); code
frozen before the table existed gets the platform's description of that older program
(`llmtrain.core.program_contract.LEGACY_CAPABILITIES`).

Keys (plain values only: the table crosses into code that does not import this package):

- `sequence_parallel`: tensor parallel shards the residual stream and norms on the sequence when
  the run's `sequence_parallel` is on (trainer/tensor_parallel.py);
- `loss_parallel`: under tensor parallel the embedding and the output head are split on the
  vocabulary and the cross-entropy is computed on the shards;
- `chunked_loss`: the loss keeps the logits in their dtype and an fp32 log-sum-exp per token, never an
  fp32 copy of the logits (trainer/loss.py);
- `context_parallel`: `context_parallel_degree` splits every sequence (trainer/context_parallel.py);
- `selective_policy`: what `activation_checkpointing: selective` keeps: "torchtitan_op" (torchtitan's
  op-level policy: attention outputs, reduce-scatters, max and every other matmul) or, in older code,
  "every_matmul" (every matmul's output);
- `fp8`: the torchao requirement the code ships for `fp8: true` (training_jobs/requirements.txt), or
  None where FP8 cannot run (no torchao in the container);
- `model_archive`: a model channel holding one `.tar.gz` (a JumpStart model's training weights) is
  unpacked and trained from (trainer/model_channel.py); older code reads only a folder;
- `fp8_min_torch`: the oldest PyTorch whose container that torchao runs on (torchao's compatibility
  table, pytorch/ao issue 2919: 0.16.0's Python API supports torch 2.8 to 2.10);
- `expert_copies`: under expert parallelism, what the `shard / expert_parallel_degree` ranks that
  hold the same expert slice do with it: "sharded" (FSDP2 shards it between them, as torchtitan's
  dp_shard_mod_ep dimension does: trainer/expert_parallel.py) or, in older code, "replicated" (each
  keeps the slice whole, with its gradients and optimizer state).
"""

from __future__ import annotations

CAPABILITIES: dict[str, object] = {
    "sequence_parallel": True,
    "loss_parallel": True,
    "chunked_loss": True,
    "context_parallel": True,
    "selective_policy": "torchtitan_op",
    "fp8": "torchao==0.16.0",
    "fp8_min_torch": "2.8.0",
    "model_archive": True,
    "expert_copies": "sharded",
}
