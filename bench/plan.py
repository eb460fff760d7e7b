"""`python -m bench.plan [--quick] [--skip-memory] [--out bench/results/plan.json]`

The planner (llmtrain.planner) against what it predicts, in one table each:

1. Memory, measured here: the training program runs on this CPU (torchrun, gloo) for every
   configuration in MEMORY_CONFIGS, and bench/workers/plan_memory.py counts what each rank holds:
   parameters, gradients, optimizer state (live tensors) and activations (saved-tensor hooks).
2. Speed, against published runs (bench/published.py: torchtitan's A100, H100 and H200 tables incl.
   FP8, context parallel, 2-D and 3-D; AWS's torchtitan-on-SageMaker runs) and the seeds'
   data-parallel scaling table. Each row says whether it calibrates a constant or only checks.

docs/planning.md shows the tables; tests/bench/test_plan_bench.py runs a subset.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import published
from llmtrain.core.instances import instance_type
from llmtrain.planner import memory, speed
from llmtrain.planner.shapes import SHIPPED_TOKENIZER_VOCAB
from llmtrain.planner.workload import (
    hyperparameter_values,
    resolve_layout,
    workload_and_layout,
    workload_from_hyperparameters,
)

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "workers" / "plan_memory.py"
PARTS = ("parameters", "gradients", "optimizer", "activations")
MEMORY_TOLERANCE = 0.10
SPEED_TOLERANCE = published.SPEED_TOLERANCE
SCALING_TOLERANCE = 0.10

# --- 1. memory, measured here ------------------------------------------------------------------------

# A small preset at a short sequence: every strategy and checkpointing mode in seconds per launch.
SMALL = {
    "model_preset": "llama-20m",
    "seq_len": 128,
    "micro_batch_size": 2,
    "grad_accum_steps": 1,
    "max_grad_norm": 1.0,
}


@dataclass(frozen=True)
class MemoryConfig:
    name: str
    processes: int
    hyperparameters: dict


def _config(name: str, processes: int, **settings) -> MemoryConfig:
    return MemoryConfig(name, processes, {**SMALL, **settings})


def _pipeline(name: str, processes: int, **settings) -> MemoryConfig:
    """Two pipeline stages of llama-20m's six layers (two of its four with interleaved schedules)
    and four micro-batches, with DDP unless named."""
    return _config(
        name,
        processes,
        **{"parallelism": "ddp", "pipeline_parallel_degree": 2, "grad_accum_steps": 4, **settings},
    )


# DeepSpeed last in each launch: its ZeRO-3 patches torch functions for the rest of the process.
MEMORY_CONFIGS = (
    _config("single fp32", 1, parallelism="single", mixed_precision="fp32"),
    _config("single bf16", 1, parallelism="single"),
    _config("single bf16, full AC", 1, parallelism="single", activation_checkpointing="full"),
    _config("single bf16, selective AC", 1, parallelism="single", activation_checkpointing="selective"),
    _config(
        "single bf16, full AC every 2nd",
        1,
        parallelism="single",
        activation_checkpointing="full",
        activation_checkpointing_every=2,
    ),
    _config("single gpt2-tiny bf16, seq 256", 1, parallelism="single", model_preset="gpt2-tiny", seq_len=256),
    _config("ddp bf16", 2, parallelism="ddp"),
    _config("ddp bf16, accumulation 2", 2, parallelism="ddp", grad_accum_steps=2),
    _config("fsdp full bf16", 2, parallelism="fsdp"),
    _config("fsdp full fp32", 2, parallelism="fsdp", mixed_precision="fp32"),
    _config("fsdp full, full AC", 2, parallelism="fsdp", activation_checkpointing="full"),
    _config("fsdp full, selective AC", 2, parallelism="fsdp", activation_checkpointing="selective"),
    _config(
        "fsdp grad_op, accumulation 2", 2, parallelism="fsdp", fsdp_sharding="grad_op", grad_accum_steps=2
    ),
    # Tensor parallel with sequence and loss parallel (the program's default), and without
    # sequence parallel (the residual stream replicated on every tensor-parallel rank).
    _config("tensor parallel 2", 2, parallelism="fsdp", tensor_parallel_degree=2),
    _config("tensor parallel 2, selective AC", 2, parallelism="fsdp", tensor_parallel_degree=2,
            activation_checkpointing="selective"),
    _config("tensor parallel 2, full AC", 2, parallelism="fsdp", tensor_parallel_degree=2,
            activation_checkpointing="full"),
    _config("tensor parallel 2 without sequence parallel", 2, parallelism="fsdp", tensor_parallel_degree=2,
            sequence_parallel=False),
    _config("tensor parallel 2 without sequence parallel, selective AC", 2, parallelism="fsdp",
            tensor_parallel_degree=2, sequence_parallel=False, activation_checkpointing="selective"),
    # Context parallel: each rank holds 2 of 2 x degree chunks of every sequence.
    _config("context parallel 2", 2, parallelism="fsdp", context_parallel_degree=2),
    _config("context parallel 2, selective AC", 2, parallelism="fsdp", context_parallel_degree=2,
            activation_checkpointing="selective"),
    _config("context parallel 2, full AC", 2, parallelism="fsdp", context_parallel_degree=2,
            activation_checkpointing="full"),
    _config("context parallel 4", 4, parallelism="fsdp", context_parallel_degree=4),
    _config("context parallel 2 x tensor parallel 2", 4, parallelism="fsdp", context_parallel_degree=2,
            tensor_parallel_degree=2),
    _config("fsdp 2 x context parallel 2, selective AC", 4, parallelism="fsdp", context_parallel_degree=2,
            activation_checkpointing="selective"),
    # FP8 (torchao float8, tensorwise: the decoder layers' weights all-gathered in FP8).
    _config("fsdp full, fp8", 2, parallelism="fsdp", fp8=True),
    _config("fsdp full, fp8, selective AC", 2, parallelism="fsdp", fp8=True,
            activation_checkpointing="selective"),
    _config("fsdp full, fp8 rowwise, full AC", 2, parallelism="fsdp", fp8=True, fp8_recipe="rowwise",
            activation_checkpointing="full"),
    _config("fsdp + LoRA r=8, dropout 0.1", 2, parallelism="fsdp", lora_r=8, lora_dropout=0.1),
    _config(
        "fsdp + LoRA r=8 q/v, full AC",
        2,
        parallelism="fsdp",
        lora_r=8,
        lora_target_modules=["q_proj", "v_proj"],
        activation_checkpointing="full",
    ),
    _config("ddp + LoRA r=8", 2, parallelism="ddp", lora_r=8),
    _config("hsdp 2 x 2", 4, parallelism="fsdp", fsdp_sharding="hybrid", replicate_degree=2),
    _config("fsdp 2 x tensor parallel 2", 4, parallelism="fsdp", tensor_parallel_degree=2),
    _pipeline("pp 2, 1f1b", 2, pipeline_schedule="1f1b"),
    _pipeline("pp 2, 1f1b, 8 micro-batches", 2, pipeline_schedule="1f1b", grad_accum_steps=8),
    _pipeline("pp 2, gpipe", 2, pipeline_schedule="gpipe"),
    _pipeline("pp 2, 1f1b, fp32", 2, pipeline_schedule="1f1b", mixed_precision="fp32"),
    _pipeline("pp 2, 1f1b, full AC", 2, pipeline_schedule="1f1b", activation_checkpointing="full"),
    _pipeline("pp 2, interleaved 1f1b", 2, pipeline_schedule="interleaved_1f1b"),
    _pipeline("pp 2, zero bubble", 2, pipeline_schedule="zero_bubble"),
    _pipeline("pp 2 x fsdp 2, 1f1b", 4, parallelism="fsdp", pipeline_schedule="1f1b"),
    _pipeline(
        "pp 2 x fsdp 2 grad_op, interleaved, full AC",
        4,
        parallelism="fsdp",
        fsdp_sharding="grad_op",
        pipeline_schedule="interleaved_1f1b",
        activation_checkpointing="full",
    ),
    _pipeline("pp 2 x ddp 2, 1f1b", 4, pipeline_schedule="1f1b"),
    _pipeline("pp 2 x tensor parallel 2, 1f1b", 4, parallelism="fsdp", tensor_parallel_degree=2),
    _pipeline("pp 2 x context parallel 2, 1f1b", 4, parallelism="fsdp", context_parallel_degree=2),
    _config("zero-1 bf16", 2, parallelism="deepspeed", zero_stage=1),
    _config("zero-2 bf16", 2, parallelism="deepspeed", zero_stage=2),
    _config(
        "zero-2 bf16, full AC", 2, parallelism="deepspeed", zero_stage=2, activation_checkpointing="full"
    ),
    _config("zero-3 bf16", 2, parallelism="deepspeed", zero_stage=3),
)
# What the test runs (tests/bench/test_plan_bench.py): one launch per process count.
QUICK_NAMES = (
    "single bf16",
    "single bf16, selective AC",
    "ddp bf16",
    "fsdp full, full AC",
    "fsdp grad_op, accumulation 2",
    "tensor parallel 2",
    "context parallel 2, selective AC",
    "fsdp full, fp8",
    "fsdp + LoRA r=8, dropout 0.1",
    "pp 2, 1f1b",
    "pp 2, gpipe",
    "pp 2, interleaved 1f1b",
    "pp 2 x fsdp 2, 1f1b",
    "zero-1 bf16",
    "zero-3 bf16",
)
# ... at a quarter of the tokens and a narrower model (head size kept): a CPU without bf16 matmul
# instructions (no AVX-512, no AMX) runs bf16 matmuls ~50x slower than fp32, which made the subset at
# full size a 10-minute test. The planner's parts are exact at either size (docs/planning.md,
# "Memory"); at hidden size 256 a part of ZeRO-3's parameter memory that does not shrink with
# the model, which the planner leaves out, would reach a tenth of it.
QUICK_SIZE = {"seq_len": 64, "micro_batch_size": 1,
              "model_overrides": {"hidden_size": 384, "intermediate_size": 1056,
                                  "num_attention_heads": 6, "num_key_value_heads": 6}}
QUICK_CONFIGS = tuple(
    MemoryConfig(c.name, c.processes, {**c.hyperparameters, **QUICK_SIZE})
    for c in MEMORY_CONFIGS
    if c.name in QUICK_NAMES
)


def predicted_memory(config: MemoryConfig) -> list[dict[str, int]]:
    """The planner's parts for a configuration measured here (CPU: no CUDA context, CPU dropout),
    one entry per pipeline rank (one for a configuration without pipeline stages); with pipeline
    stages also the receive buffers the activations include."""
    values = hyperparameter_values(config.hyperparameters)
    work, layout = workload_and_layout(values, config.processes, 1, vocab_size=SHIPPED_TOKENIZER_VOCAB)
    if not layout.pipelined:
        estimate = memory.estimate(work, layout, capacity=0, on_gpu=False)
        return [{part: getattr(estimate, part) for part in PARTS}]
    return [
        {
            **{part: getattr(estimate, part) for part in PARTS},
            "buffers": estimate.details["pipeline_receive_buffer_bytes"],
        }
        for estimate in memory.pipeline_estimates(work, layout, capacity=0, on_gpu=False)
    ]


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "SAGEMAKER_"))}
    env.update(
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure_memory(configs: tuple[MemoryConfig, ...], timeout: float = 1200) -> dict[str, list[dict]]:
    """Run each group of configurations (by process count) in one torchrun launch; what every rank
    measured (or the error), by configuration."""
    results: dict[str, dict] = {}
    for processes in sorted({c.processes for c in configs}):
        group = [c for c in configs if c.processes == processes]
        with tempfile.TemporaryDirectory() as folder:
            spec, out = Path(folder) / "spec.json", Path(folder) / "out.json"
            spec.write_text(
                json.dumps([{"name": c.name, "hyperparameters": c.hyperparameters} for c in group])
            )
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(processes),
                "--master_port",
                str(_free_port()),
                str(WORKER),
                str(spec),
                str(out),
            ]
            done = subprocess.run(
                command, cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=timeout
            )
            ranks = [
                json.loads(Path(f"{out}.{rank}").read_text())
                for rank in range(processes)
                if Path(f"{out}.{rank}").exists()
            ]
            if done.returncode or len(ranks) != processes:
                raise RuntimeError(
                    f"the memory worker failed ({done.returncode}):\n{done.stdout[-3000:]}"
                    f"\n{done.stderr[-3000:]}"
                )
        for config in group:
            results[config.name] = [rank[config.name] for rank in ranks]
    return results


def memory_rows(configs: tuple[MemoryConfig, ...], measured: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration, or per pipeline rank: per part the largest value over the ranks
    (of that pipeline rank: the mesh's outermost dimension, so consecutive global ranks)."""
    rows = []
    for config in configs:
        per_rank = measured[config.name]
        errors = [r["error"] for r in per_rank if "error" in r]
        predicted = predicted_memory(config)
        group = len(per_rank) // len(predicted)
        for index, expected in enumerate(predicted):
            name = config.name if len(predicted) == 1 else f"{config.name}: pipeline rank {index}"
            row = {"name": name, "processes": config.processes, "predicted": expected}
            if errors:
                row["measured"] = {"error": errors[0]}
            else:
                ranks = per_rank[index * group : (index + 1) * group]
                row["measured"] = {part: max(r[part] for r in ranks) for part in expected}
                row["error"] = {part: relative_error(expected[part], row["measured"][part]) for part in PARTS}
            rows.append(row)
    return rows


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else (0.0 if predicted == 0 else float("inf"))


# --- 2. speed, against published runs ---------------------------------------------------------------

# The published runs, their calibration and the validation table live in bench/published.py.
PUBLISHED_RUNS = published.PUBLISHED_RUNS
calibrate = published.calibrate
published_rows = published.rows


# The seeds' table (a SageMaker distributed-training talk): one data-parallel job on 1, 2, 4 and 8
# instances, minutes to train. It names neither the model nor the instance type: the planner runs
# it as SEEDS_JOB, a data-parallel pretraining run of the training program on ml.p4d.24xlarge, and
# the single-instance time fixes the job's amount of work (it calibrates nothing else).
SEEDS_MINUTES = {1: 99.0, 2: 55.0, 4: 27.0, 8: 13.5}
SEEDS_INSTANCE = "ml.p4d.24xlarge"
SEEDS_JOB = {
    "model_preset": "llama-1b",
    "parallelism": "ddp",
    "seq_len": 2048,
    "micro_batch_size": 2,
    "grad_accum_steps": 8,
    "activation_checkpointing": "full",
    "mixed_precision": "bf16",
}


# Not claims: how the same check comes out for other data-parallel jobs on ml.p4d.24xlarge (the
# table's job is unknown; docs/planning.md discusses it).
SEEDS_OTHER_JOBS = {
    "gpt2-ddp recipe (gpt2-small, seq 128, micro batch 32)": {
        "model_preset": "gpt2-small",
        "parallelism": "ddp",
        "seq_len": 128,
        "micro_batch_size": 32,
    },
    "gpt2-large, seq 1024, micro batch 4": {
        "model_preset": "gpt2-large",
        "parallelism": "ddp",
        "seq_len": 1024,
        "micro_batch_size": 4,
    },
    "llama-1b as SEEDS_JOB without accumulation": {**SEEDS_JOB, "grad_accum_steps": 1},
}


def seeds_rows(job: dict | None = None) -> list[dict]:
    values = hyperparameter_values(job or SEEDS_JOB)
    work = workload_from_hyperparameters(values)
    kind = instance_type(SEEDS_INSTANCE)
    step_seconds = {}
    for count in SEEDS_MINUTES:
        layout = resolve_layout(values, kind.gpus, count)
        step_seconds[count] = speed.estimate(work, layout, speed.Cluster.of(kind, count)).step_seconds
    # One instance trains the whole job in 99 minutes: that many of its steps.
    steps_on_one = SEEDS_MINUTES[1] * 60 / step_seconds[1]
    rows = []
    for count, minutes in SEEDS_MINUTES.items():
        steps = steps_on_one / count  # the same tokens, a global batch `count` times larger
        predicted = steps * step_seconds[count] / 60
        rows.append(
            {
                "instances": count,
                "published_minutes": minutes,
                "predicted_minutes": predicted,
                "error": relative_error(predicted, minutes),
                "role": "calibrates the job's size" if count == 1 else "checks",
                "step_seconds": step_seconds[count],
            }
        )
    return rows


# --- report -----------------------------------------------------------------------------------------


def _mib(value: float) -> str:
    return f"{value / 1024**2:9.2f}"


def print_memory(rows: list[dict]) -> None:
    print("Memory per rank, measured on this CPU vs predicted (MiB; error = predicted / measured - 1)")
    print(f"{'configuration':58} {'part':12} {'measured':>9} {'predicted':>9} {'error':>8}")
    for row in rows:
        if "error" in row["measured"]:
            print(f"{row['name']:58} FAILED: {row['measured']['error'].splitlines()[-1]}")
            continue
        for index, part in enumerate(PARTS):
            label = row["name"] if index == 0 else ""
            print(
                f"{label:58} {part:12} {_mib(row['measured'][part])} {_mib(row['predicted'][part])} "
                f"{row['error'][part]:+8.1%}"
            )
        if "buffers" in row["predicted"]:
            print(
                f"{'':58} {'(buffers)':12} {_mib(row['measured']['buffers'])} "
                f"{_mib(row['predicted']['buffers'])}   of the activations: receive buffers"
            )


def print_speed(runs: list[dict], seeds: list[dict]) -> None:
    print("\nSpeed vs published runs (tokens/s per GPU; error = predicted / published - 1)")
    print(f"{'run':62} {'published':>9} {'predicted':>9} {'error':>7}  {'MFU':>5}  role")
    for row in runs:
        print(
            f"{row['name']:62} {row['published_tokens_per_second_per_gpu']:9.0f} "
            f"{row['predicted_tokens_per_second_per_gpu']:9.0f} {row['error']:+7.1%}  "
            f"{row['predicted_mfu']:5.1%}  {row['role']}"
        )
    print("\nData-parallel scaling, the seeds' table (minutes)")
    print(f"{'instances':>9} {'published':>9} {'predicted':>9} {'error':>7}  role")
    for row in seeds:
        print(
            f"{row['instances']:9d} {row['published_minutes']:9.1f} {row['predicted_minutes']:9.1f} "
            f"{row['error']:+7.1%}  {row['role']}"
        )
    print("\nThe same check for other jobs (not claims; errors at 2, 4, 8 instances)")
    for name, job in SEEDS_OTHER_JOBS.items():
        errors = ", ".join(f"{row['error']:+.1%}" for row in seeds_rows(job)[1:])
        print(f"  {name:52} {errors}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.splitlines()[2])
    parser.add_argument("--quick", action="store_true", help="measure only QUICK_CONFIGS (the test's subset)")
    parser.add_argument("--skip-memory", action="store_true", help="only the published-runs tables")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables as JSON")
    args = parser.parse_args(argv)
    configs = QUICK_CONFIGS if args.quick else MEMORY_CONFIGS
    results: dict[str, object] = {}
    if not args.skip_memory:
        results["memory"] = memory_rows(configs, measure_memory(configs))
        print_memory(results["memory"])
    results["published"] = published_rows()
    results["seeds"] = seeds_rows()
    print_speed(results["published"], results["seeds"])
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
