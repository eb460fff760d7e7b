"""What each tensor-parallel rank holds, with and without sequence parallel (test_scale_memory.py).

    python -m torch.distributed.run --nproc_per_node 2 tests/training/scale_memory_worker.py OUT

Builds a tiny Llama with the program's own transformations (trainer/parallel.py: tensor parallel
with sequence and loss parallel), runs one forward, loss and backward, and writes per rank to
OUT/rank{r}_sp{0|1}.json: the local shape of every decoder layer's input (the residual stream
between layers), the local shape of the logits, and the local shape and dtype of every tensor
autograd saved for backward (saved-tensor hooks, as bench/workers/plan_memory.py counts them).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from training_jobs.contract.hyperparameters import from_hyperparameters  # noqa: E402
from training_jobs.contract.parallel_dims import ParallelDims  # noqa: E402
from training_jobs.trainer import parallel  # noqa: E402
from training_jobs.trainer.loss import causal_lm_loss_sum  # noqa: E402
from training_jobs.trainer.models import decoder_layers, forward_logits  # noqa: E402

BATCH, SEQ, VOCAB = 2, 32, 256


def _local_shape(tensor: torch.Tensor) -> list[int]:
    from torch.distributed.tensor import DTensor

    return list(tensor.to_local().shape if isinstance(tensor, DTensor) else tensor.shape)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def measure(sequence_parallel: bool) -> dict:
    config = from_hyperparameters({"parallelism": "fsdp", "tensor_parallel_degree": 2, "seq_len": SEQ,
                                   "mixed_precision": "fp32", "sequence_parallel": sequence_parallel})
    device = torch.device("cpu")
    topology = parallel.build_topology(ParallelDims.resolve(config.parallel, 2, 1), device, needs_mesh=True)
    model = _model()
    parallel.transform(model, config, topology, device, with_fsdp=False)
    layer_inputs, saved = [], []
    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(lambda _module, args: layer_inputs.append(_local_shape(args[0])))

    def pack(tensor):
        with torch.no_grad():
            saved.append({"shape": _local_shape(tensor), "dtype": str(tensor.dtype)})
        return tensor

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = topology.vocabulary_logits(forward_logits(model, tokens[:, :-1]))
        loss = causal_lm_loss_sum(logits, tokens[:, 1:])
    loss.backward()
    return {"layer_inputs": layer_inputs, "logits": _local_shape(logits), "saved": saved,
            "loss": loss.item()}


def main(out: str) -> int:
    dist.init_process_group("gloo")
    for sequence_parallel in (True, False):
        result = measure(sequence_parallel)
        path = Path(out) / f"rank{dist.get_rank()}_sp{int(sequence_parallel)}.json"
        path.write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
