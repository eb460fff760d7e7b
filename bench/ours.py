"""Our training program, run the way the SageMaker PyTorch container runs it.

torchrun launches `training_jobs/train.py` with 1 or N processes; the job is described only through
the container contract: SM_HPS (hyperparameters as JSON), SM_CHANNEL_TRAIN, SM_MODEL_DIR,
SM_OUTPUT_DATA_DIR and a job root (SAGEMAKER_BASE_DIR) holding checkpoints/. Nothing of the program
is imported or copied: what is measured is the real entry point.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.modes import BenchConfig, BenchMode
from bench.procs import ProcessResult, run_measured

REPO_ROOT = Path(__file__).resolve().parent.parent
ENTRY_POINT = REPO_ROOT / "training_jobs" / "train.py"
SHARD_NAME = "shard_00000.bin"


def write_train_channel(tokens: np.ndarray, folder: Path, vocab_size: int, eos_token_id: int) -> Path:
    """The shared token stream as a dataset folder in our program's shard format."""
    from training_jobs.trainer.shards import dtype_for_vocab, write_manifest

    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    np.asarray(tokens).astype(np.dtype(dtype).newbyteorder("<")).tofile(folder / SHARD_NAME)
    write_manifest(folder, dtype=dtype, vocab_size=vocab_size, eos_token_id=eos_token_id,
                   num_documents=1, shards=[(SHARD_NAME, len(tokens))],
                   tokenizer="bench synthetic ids")
    return folder


@dataclass(frozen=True)
class OursRun:
    """One launch of our program."""

    config: BenchConfig
    mode: BenchMode
    steps: int
    train_channel: Path
    job_root: Path
    checkpoint_every_steps: int = 0  # 0: no checkpoint during the throughput runs

    def hyperparameters(self) -> dict:
        if self.mode.global_batch_size % self.config.world_size:
            raise ValueError(f"global_batch_size {self.mode.global_batch_size} is not divisible by "
                             f"the {self.config.world_size} processes of {self.config.name}")
        model = self.config.model(self.mode)
        return {
            "model_preset": model.preset,
            "model_overrides": model.overrides,
            "seq_len": self.mode.seq_len,
            "micro_batch_size": self.mode.global_batch_size // self.config.world_size,
            "grad_accum_steps": 1,
            "max_steps": self.steps,
            "lr": 3e-4,
            "warmup_steps": 2,
            "weight_decay": 0.1,
            "max_grad_norm": 1.0,
            "parallelism": self.config.parallelism,
            "mixed_precision": self.config.precision,
            "compile": self.config.compiles(self.mode),
            "log_every_steps": 1,  # one line per step: bench.timing times the lines
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "seed": 0,
            **self.config.hyperparameters,
        }

    def environment(self) -> dict[str, str]:
        for folder in ("model", "output/data", "checkpoints"):
            (self.job_root / folder).mkdir(parents=True, exist_ok=True)
        threads = max(1, (os.cpu_count() or 1) // self.config.world_size)
        env = {
            **os.environ,
            "SM_HPS": json.dumps(self.hyperparameters()),
            "SM_CHANNEL_TRAIN": str(self.train_channel),
            "SM_MODEL_DIR": str(self.job_root / "model"),
            "SM_OUTPUT_DATA_DIR": str(self.job_root / "output" / "data"),
            "SAGEMAKER_BASE_DIR": str(self.job_root),
            "SM_HOSTS": json.dumps(["algo-1"]),
            "SM_CURRENT_HOST": "algo-1",
            "OMP_NUM_THREADS": str(threads),  # the cores shared evenly, as torchrun advises
        }
        if self.mode.device == "cpu":
            env.update({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
        return env

    def command(self) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={self.config.world_size}", str(ENTRY_POINT)]

    def launch(self, log_path: Path) -> ProcessResult:
        return run_measured(self.command(), self.environment(), log_path, self.mode.step_timeout_s,
                            cwd=REPO_ROOT)

    def metrics(self) -> list[dict]:
        """The program's own JSON metric lines (for its loss and its own throughput figures)."""
        path = self.job_root / "output" / "data" / "metrics.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
