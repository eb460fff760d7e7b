"""The training program's CUDA paths, on a machine with a GPU: skipped on the CPU machines of CI.

One process per launch (every machine with a GPU has one): bf16 with torch.compile, SDPA and the
fused AdamW; FSDP2 with bf16 mixed precision on NCCL, stopped and resumed from its checkpoint;
QLoRA with bitsandbytes' CUDA kernels. The CPU tests pin the same behaviour exactly (gloo, 2
processes); here the point is that nothing of it breaks on the device the templates pay for.

    pytest tests/training/test_cuda.py     # on a GPU machine (docs/benchmarks.md, "GPU mode")
"""

from __future__ import annotations

import pytest
import torch

from .conftest import TINY, job_root, losses, outcome, run_jobs, train_records

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = {**TINY, "seq_len": 64, "mixed_precision": "bf16", "max_steps": 6}
FSDP_SIX = {**BF16, "parallelism": "fsdp", "lr_decay_steps": 6, "checkpoint_every_steps": 3}
QLORA = {**TINY, "parallelism": "ddp", "quantization": "nf4", "mixed_precision": "bf16",
         "lora_r": 4, "lora_alpha": 8, "lr": 1e-2, "lora_target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data, base_model):
    base = tmp_path_factory.mktemp("cuda")
    roots = {name: job_root(base / name, tiny_data) for name in ("compiled", "fsdp_full", "fsdp_parts")}
    roots["qlora"] = job_root(base / "qlora", tiny_data, model=base_model)
    first = run_jobs(1, [(roots["compiled"], {**BF16, "compile": True}),
                         (roots["fsdp_full"], FSDP_SIX),
                         (roots["fsdp_parts"], {**FSDP_SIX, "max_steps": 3}),
                         (roots["qlora"], QLORA)], base)
    before_resume = losses(roots["fsdp_parts"])
    run_jobs(1, [(roots["fsdp_parts"], FSDP_SIX)], base)
    return roots, first.output, before_resume


@pytest.fixture(scope="module")
def graph_runs(tmp_path_factory, tiny_data):
    base = tmp_path_factory.mktemp("graphs")
    roots = {mode: job_root(base / mode, tiny_data) for mode in ("cuda_graphs", "default")}
    hps = {**BF16, "parallelism": "single", "compile": True, "micro_batch_size": 4, "grad_accum_steps": 1}
    run_jobs(1, [(roots[mode], {**hps, "compile_mode": mode}) for mode in roots], base)
    return roots


def test_cuda_graphs_train_like_plain_compiled_kernels(graph_runs):
    """Replayed graphs read and write the same memory every step: a stale buffer (an output or a
    gradient read after the next replay overwrote it) would show in the loss."""
    replayed, launched = losses(graph_runs["cuda_graphs"]), losses(graph_runs["default"])
    assert len(replayed) == 6 and replayed[-1] < replayed[0]
    assert replayed == pytest.approx(launched, rel=1e-3)


def test_compiled_bf16_run_trains_with_sdpa_on_the_gpu(runs):
    roots, output, _ = runs
    assert outcome(roots["compiled"]) == {"ok": True}
    assert "sdpa attention" in output  # attention=auto picks the flash/efficient kernels on CUDA
    curve = losses(roots["compiled"])
    assert len(curve) == 6 and curve[-1] < curve[0]
    records = train_records(roots["compiled"])
    assert all(r["memory_gb"] > 0 and 0 < r["mfu"] < 1 for r in records)  # CUDA's own accounting


def test_fsdp2_bf16_on_nccl_resumes_where_it_stopped(runs):
    roots, _, before_resume = runs
    uninterrupted = losses(roots["fsdp_full"])
    assert before_resume == pytest.approx(uninterrupted[:3], rel=1e-4)
    resumed = train_records(roots["fsdp_parts"])
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    # cuBLAS and the embedding's atomic-add backward are not bit-reproducible across processes;
    # the CPU tests pin exact equality, this one that the state (weights, optimizer, data) came back.
    assert [r["loss"] for r in resumed][3:] == pytest.approx(uninterrupted[3:], rel=5e-3)
    assert [r["lr"] for r in resumed] == [r["lr"] for r in train_records(roots["fsdp_full"])]


def test_qlora_trains_on_bitsandbytes_cuda_kernels(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    roots, _, _ = runs
    assert outcome(roots["qlora"]) == {"ok": True}
    assert all(0 < loss < 10 for loss in losses(roots["qlora"]))
    dcp_to_torch_save(str(roots["qlora"] / "checkpoints" / "step_00000004"), str(tmp_path / "q.pt"))
    trained = torch.load(tmp_path / "q.pt", weights_only=False)["model"]
    packed = [v for k, v in trained.items() if k.endswith("q_proj.base_layer.weight")]
    assert packed and all(v.dtype == torch.uint8 for v in packed)  # NF4, two per byte
    assert all(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)  # adapters trained
    exported = roots["qlora"] / "model"
    assert (exported / "adapter_model.safetensors").is_file()
    assert not (exported / "model.safetensors").exists()
