"""FP8 training pieces on CPU processes (test_fp8.py), run by a Python that has torchao.

    python -m torch.distributed.run --nproc_per_node 2 tests/training/fp8_worker.py OUT

FP8 matmuls run on this CPU (torch._scaled_mm has a CPU kernel in torch 2.13), so the program's own
FP8 pieces train here: its conversion (trainer/float8.py) of a tiny Llama's decoder layers with the
tensorwise recipe and FP8 all-gather, FSDP2 over the two ranks (trainer/parallel.py), the scales
precomputed after each optimizer step, three steps in bf16; and the same model without FP8. The
program itself refuses fp8 on a CPU (float8.check_fp8_device), so this calls the pieces after that
check. Also applies the tensor-parallel plan with torchao's float8 styles (construction only: gloo
cannot move float8 tensors, so the FP8 all-gathers of tensor parallel run only on NCCL). Rank 0
writes OUT/fp8.json.
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
from training_jobs.trainer import float8, parallel, tensor_parallel  # noqa: E402
from training_jobs.trainer.loss import causal_lm_loss  # noqa: E402
from training_jobs.trainer.models import forward_logits  # noqa: E402


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def _topology(settings: dict):
    config = from_hyperparameters({"parallelism": "fsdp", "seq_len": 32, "mixed_precision": "bf16",
                                   "fp8": True, **settings})
    dims = ParallelDims.resolve(config.parallel, dist.get_world_size(), 1)
    return config, parallel.build_topology(dims, torch.device("cpu"), needs_mesh=True)


def train(fp8: bool) -> dict:
    config, topology = _topology({})
    model = _model()
    converted = float8.convert_to_float8(model, "tensorwise", fsdp_float8_all_gather=True) if fp8 else 0
    parallel.apply_fsdp(model, parallel.fsdp_mesh(topology.mesh, topology.dims, config.parallel),
                        config.parallel, offload=False)
    weight = model.model.layers[0].self_attn.q_proj.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    losses = []
    for _ in range(3):
        loss = causal_lm_loss(forward_logits(model, tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if fp8 and float8.precomputes_scales(config.parallel, sharded=True):
            float8.precompute_scales([model])
        total = loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return {"converted": converted, "losses": losses,
            "sharded weight": type(weight.to_local()).__name__}


def tensor_parallel_styles() -> dict:
    from torchao.float8.float8_linear import Float8Linear

    config, topology = _topology({"tensor_parallel_degree": 2})
    model = _model()
    float8.convert_to_float8(model, "tensorwise")
    tensor_parallel.apply_tensor_parallel(model, topology.mesh["tp"], sequence_parallel=True, float8=True)
    q_proj = model.model.layers[0].self_attn.q_proj
    return {"q_proj": type(q_proj).__name__, "float8": isinstance(q_proj, Float8Linear),
            "q_proj placements": str(q_proj.weight.placements)}


def main(out: str) -> int:
    dist.init_process_group("gloo")
    result = {"fp8": train(True), "bf16": train(False), "tensor parallel": tensor_parallel_styles()}
    if dist.get_rank() == 0:
        (Path(out) / "fp8.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
