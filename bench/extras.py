"""The measurements beside throughput: checkpoint stall, data-loader speed, `cdk synth` time."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.measure import Workspace, fresh_job_dir
from bench.modes import BenchConfig, BenchMode
from bench.ours import REPO_ROOT, OursRun
from bench.timing import stall_per_event, step_times


def default_checkpoint_interval() -> int:
    """Our program's default `checkpoint_every_steps` (the interval the target is stated at)."""
    from training_jobs.contract.hyperparameters import CheckpointConfig

    return CheckpointConfig().checkpoint_every_steps


def checkpoint_stall(mode: BenchMode, workspace: Workspace) -> dict:
    """Saves every few steps and measures how much longer the steps around each save take.

    The stall per save is measured at a short interval (to see several saves in a short run) and
    then stated as a fraction of training time at our program's default interval.
    """
    every = mode.checkpoint_every_steps
    first_save = (mode.warmup_steps // every + 1) * every
    steps = first_save + every * (mode.checkpoint_saves - 1) + every  # ordinary steps after the last
    config = BenchConfig("ours_bf16_checkpointing", "ours", "bf16")
    run = OursRun(config, mode, steps, workspace.train_channel, fresh_job_dir(workspace, config.name),
                  checkpoint_every_steps=every)
    result = run.launch(run.job_root / "output.log")
    times = step_times(result.lines)
    if not result.ok:
        return {"status": "failed", "error": f"exit code {result.returncode}:\n{result.log_tail()}"}
    save_steps = {s for s in range(first_save, steps, every)}
    stalls = stall_per_event(times, save_steps, mode.warmup_steps)
    step_time = statistics.median(times.after_warmup(mode.warmup_steps))
    stall = statistics.mean(stalls)
    default_every = default_checkpoint_interval()
    return {
        "status": "ok",
        "measured_every_steps": every,
        "save_steps": sorted(save_steps),
        "stall_per_save_s": [round(s, 4) for s in stalls],
        "mean_stall_per_save_s": stall,
        "step_time_s": step_time,
        "stall_fraction_at_measured_interval": stall / (stall + every * step_time),
        "default_every_steps": default_every,
        "stall_fraction": stall / (stall + default_every * step_time),
        "checkpoints_written": _checkpoints_written(run.job_root / "checkpoints"),
        "logged_save_seconds": _logged_save_seconds(result.lines),
    }


SAVE_LOG = re.compile(r"^\[train\] checkpoint step=(\d+) .*seconds=([0-9.]+)")


def _logged_save_seconds(lines: list[tuple[float, str]]) -> dict[str, float]:
    """What our program logs as each save's duration (a human-readable line, a cross-check only)."""
    found = {}
    for _, text in lines:
        match = SAVE_LOG.match(text)
        if match:
            found[match[1]] = float(match[2])
    return found


def _checkpoints_written(folder: Path) -> list[str]:
    return sorted(child.name for child in folder.iterdir()) if folder.is_dir() else []


def data_loader(mode: BenchMode, workspace: Workspace, vocab_size: int) -> dict:
    """Tokens/s of our program's own loader (read, shuffle, pack, to device), on one rank."""
    import torch

    from training_jobs.trainer.data import BatchLayout, TokenSamples, TrainBatches

    device = torch.device(mode.device)
    samples = TokenSamples(workspace.train_channel, mode.seq_len, "train", vocab_size)
    layout = BatchLayout(data_parallel_size=1, data_parallel_rank=0,
                         micro_batch_size=mode.global_batch_size, grad_accum_steps=1)
    batches = TrainBatches(samples, layout, seed=0, device=device)
    tokens_per_step = mode.global_batch_size * mode.seq_len
    steps = max(1, mode.data_loader_tokens // tokens_per_step)
    start = time.perf_counter()
    for _ in range(steps):
        batches.next_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"status": "ok", "tokens": steps * tokens_per_step, "seconds": elapsed,
            "tokens_per_s": steps * tokens_per_step / elapsed}


def cdk_synth(timeout_s: int = 900) -> dict:
    """Wall time of `npx cdk synth --quiet` of the whole app, into a scratch output folder."""
    if not (REPO_ROOT / "app.py").is_file():
        return {"status": "skipped", "error": "app.py does not exist yet"}
    python = REPO_ROOT / ".venv" / "bin" / "python"
    if shutil.which("npx") is None or not python.is_file():
        # A GPU machine that only runs the training benchmarks need not carry Node and `make setup`.
        return {"status": "skipped", "error": "needs npx and the project's .venv (run `make setup`)"}
    with tempfile.TemporaryDirectory(prefix="bench-cdk-") as output:
        command = ["npx", "cdk", "synth", "--quiet", "--app", f"{python} app.py", "--output", output]
        env = {**os.environ, "CDK_DISABLE_VERSION_CHECK": "1"}  # npx runs the pinned Node (package.json)
        start = time.perf_counter()
        result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                timeout=timeout_s)
        seconds = time.perf_counter() - start
        templates = len(list(Path(output).rglob("*.template.json")))
    reproduce = 'npx cdk synth --quiet --app ".venv/bin/python app.py"'
    if result.returncode != 0:
        return {"status": "failed", "command": reproduce, "error": (result.stderr or result.stdout)[-2000:]}
    return {"status": "ok", "seconds": seconds, "templates": templates, "command": reproduce}
