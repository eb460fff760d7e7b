"""`python -m bench.plan_gpu [--cases NAME ...] [--steps N] [--out FILE] [--dry-run]`

The planner against the training program on the GPUs of this machine (issue 29's GPU check): for
each case, the plan (tokens/s per GPU, MFU, peak memory) for this machine's GPU, then the program
itself (torchrun, `training_jobs/train.py` through the container contract, as bench/ours.py runs it)
for `--steps` steps on synthetic tokens, and the two side by side: tokens/s and MFU (the median of
the steps after the first third, which compile and the allocator's warm-up take) and the CUDA peak
the program reports (`memory_gb`: torch.cuda.max_memory_allocated on rank 0) against the plan's
allocated bytes (per GPU less the CUDA context and the allocator's reserve, which
max_memory_allocated does not see).

Cases (CASES): llama-1b at 2048 tokens in bf16 and in FP8, a shortened Llama 3 8B (4 of its 32
layers, 8192 tokens, selective checkpointing) in bf16 and FP8, and llama-1b on 2 GPUs with tensor
parallel 2 with and without sequence parallel (peak memory); a case that needs more GPUs than the
machine has, or FP8 on a GPU without it, is recorded as skipped with the reason.

`--dry-run` plans every case for a named GPU (`--gpu H100-80GB`) and prints the commands without
running them: what tests/bench/test_plan_bench.py runs on CPU machines. docs/benchmarks.md
("The planner on a GPU") says how to run it and where its results go.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.model import _tokenizer, tokenizer_vocab_size
from bench.modes import MODES, BenchConfig
from bench.ours import OursRun, write_train_channel
from llmtrain.core.instances import GPU_MODELS, GpuModel
from llmtrain.planner import memory, speed
from llmtrain.planner.workload import hyperparameter_values, workload_and_layout

GIB = 1024**3
MEASURE_FRACTION = 2 / 3  # of the steps, the last ones are timed


@dataclass(frozen=True)
class GpuCase:
    name: str
    gpus: int
    settings: dict

    def hyperparameters(self) -> dict:
        base = {"mixed_precision": "bf16", "compile": True, "grad_accum_steps": 1,
                "parallelism": "fsdp" if self.gpus > 1 else "single"}
        return {**base, **self.settings}


_1B = {"model_preset": "llama-1b", "seq_len": 2048, "micro_batch_size": 4, "activation_checkpointing": "none"}
_8B_SHORT = {"model_preset": "llama3-8b", "model_overrides": {"num_hidden_layers": 4}, "seq_len": 8192,
             "micro_batch_size": 1, "activation_checkpointing": "selective"}
_TP2 = {**_1B, "tensor_parallel_degree": 2, "activation_checkpointing": "selective"}
# Issue 33's GPU check: the tiny MoE and Qwen3-30B-A3B's shape cut to 4 of its 48 layers (128 experts,
# 8 active), one GPU, so the whole of each layer's experts runs the grouped matmul.
_MOE_TINY = {"model_preset": "qwen3-moe-tiny", "seq_len": 2048, "micro_batch_size": 8,
             "activation_checkpointing": "none"}
_30B_A3B_SHORT = {"model_preset": "qwen3-30b-a3b", "model_overrides": {"num_hidden_layers": 4},
                  "seq_len": 4096, "micro_batch_size": 2, "activation_checkpointing": "selective"}

CASES: tuple[GpuCase, ...] = (
    GpuCase("qwen3-moe-tiny bf16", 1, _MOE_TINY),
    GpuCase("qwen3-30b-a3b (4 layers) bf16", 1, _30B_A3B_SHORT),
    GpuCase("qwen3-30b-a3b (4 layers) bf16, eager", 1, {**_30B_A3B_SHORT, "compile": False}),
    GpuCase("llama-1b bf16", 1, _1B),
    GpuCase("llama-1b fp8", 1, {**_1B, "fp8": True}),
    GpuCase("llama3-8b (4 layers) bf16", 1, _8B_SHORT),
    GpuCase("llama3-8b (4 layers) fp8", 1, {**_8B_SHORT, "fp8": True}),
    GpuCase("llama-1b tp 2, sequence parallel", 2, {**_TP2, "sequence_parallel": True}),
    GpuCase("llama-1b tp 2, no sequence parallel", 2, {**_TP2, "sequence_parallel": False}),
)


def gpu_model_of(device_name: str) -> GpuModel:
    """The planner's GPU for the name CUDA reports (e.g. 'NVIDIA H100 80GB HBM3')."""
    for fragment, key in (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100-SXM4-40GB", "A100-40GB"),
                          ("A100", "A100-80GB"), ("A10G", "A10G"), ("L40S", "L40S"), ("L4", "L4")):
        if fragment in device_name:
            return GPU_MODELS[key]
    raise SystemExit(f"the planner has no GPU for {device_name!r}: add it to llmtrain/core/instances.py")


def planned(case: GpuCase, gpu: GpuModel) -> dict:
    """The plan of a case on one host of `case.gpus` of these GPUs, with the vocabulary of the
    tokenizer the program ships (the run has no tokenizer channel, so the program sizes the
    embedding and the head to it)."""
    values = hyperparameter_values(case.hyperparameters())
    work, layout = workload_and_layout(values, case.gpus, 1, vocab_size=tokenizer_vocab_size())
    cluster = speed.Cluster(gpu, case.gpus, 1, 0.0)
    estimate = speed.estimate(work, layout, cluster)
    mem = memory.estimate(work, layout, gpu.memory_bytes)
    return {
        "layout": layout.describe(),
        "tokens_per_second_per_gpu": estimate.tokens_per_second_per_gpu,
        "mfu": estimate.mfu,
        "allocated_gib": (mem.per_gpu - mem.overhead) / GIB,
        "per_gpu_gib": mem.per_gpu / GIB,
    }


def skip_reason(case: GpuCase, gpu: GpuModel, available: int) -> str | None:
    if case.gpus > available:
        return f"needs {case.gpus} GPUs, the machine has {available}"
    if case.settings.get("fp8") and not gpu.has_fp8:
        return f"fp8 needs compute capability 8.9+, {gpu.name} has {gpu.compute_capability}"
    return None


def _run(case: GpuCase, steps: int, root: Path) -> OursRun:
    mode = replace(MODES["full"], model_preset=case.settings["model_preset"],
                   seq_len=case.settings["seq_len"],
                   global_batch_size=case.settings["micro_batch_size"] * case.gpus)
    config = BenchConfig(case.name, "ours", "bf16", world_size=case.gpus,
                         parallelism=case.hyperparameters()["parallelism"],
                         hyperparameters={**case.hyperparameters(), "log_every_steps": 1}, compile=True)
    return OursRun(config, mode, steps, root / "train", root / "job")


def measured(case: GpuCase, steps: int, root: Path) -> dict:
    """The program's own figures of its last steps: tokens/s per GPU, MFU, peak CUDA memory."""
    vocab = tokenizer_vocab_size()
    tokens = np.random.default_rng(0).integers(0, vocab, size=4_000_000, dtype=np.int64)
    write_train_channel(tokens, root / "train", vocab, _tokenizer().eos_token_id)
    run = _run(case, steps, root)
    result = run.launch(root / "log.txt")
    rows = [m for m in run.metrics() if "tokens_per_sec" in m]
    if not result.ok or not rows:
        return {"error": failure_reason([line for _, line in result.lines])}
    timed = rows[int(len(rows) * (1 - MEASURE_FRACTION)):] or rows
    return {
        "tokens_per_second_per_gpu": statistics.median(m["tokens_per_sec"] for m in timed) / case.gpus,
        "mfu": statistics.median(m["mfu"] for m in timed),
        "allocated_gib": max(m["memory_gb"] for m in rows) * 1e9 / GIB,
    }


def failure_reason(lines: list[str]) -> str:
    """The program's own reason (train.py's `[error]` line, or an exception's last line), not the
    launcher's traceback that ends every failed torchrun log."""
    reasons = [line for line in lines if line.startswith("[error]")
               or ("Error:" in line and "ChildFailedError" not in line)]
    return "\n".join(reasons[-5:]) or "\n".join(lines[-30:])


def compare(plan: dict, measure: dict) -> dict:
    if "error" in measure:
        return {}
    keys = ("tokens_per_second_per_gpu", "mfu", "allocated_gib")
    return {key: plan[key] / measure[key] - 1 for key in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_gpu", description=__doc__.splitlines()[2])
    parser.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="plan and print the commands, run nothing")
    parser.add_argument("--gpu", default=None, help="with --dry-run: the planner's GPU (default H100-80GB)")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    if args.dry_run:
        gpu, available = GPU_MODELS[args.gpu or "H100-80GB"], max(c.gpus for c in CASES)
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: use --dry-run, or run this on a GPU machine")
        gpu, available = gpu_model_of(torch.cuda.get_device_name(0)), torch.cuda.device_count()
    results = []
    for case in cases:
        row = {"case": case.name, "gpus": case.gpus, "gpu": gpu.name, "plan": planned(case, gpu)}
        reason = skip_reason(case, gpu, available)
        if reason:
            row["skipped"] = reason
        elif args.dry_run:
            with tempfile.TemporaryDirectory() as folder:
                run = _run(case, args.steps, Path(folder))
                row["command"] = run.command()
                row["hyperparameters"] = run.hyperparameters()
        else:
            with tempfile.TemporaryDirectory() as folder:
                row["measured"] = measured(case, args.steps, Path(folder))
            row["error"] = compare(row["plan"], row["measured"])
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
