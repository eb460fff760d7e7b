"""Runs one configuration and turns its output into the benchmark's per-configuration record."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.machine import load_average
from bench.modes import BenchConfig, BenchMode
from bench.ours import REPO_ROOT, OursRun
from bench.procs import ProcessResult, run_measured
from bench.timing import StepTimes, step_cpu_times, step_times
from bench.workers.common import WorkerSpec

GIB = 2**30


@dataclass(frozen=True)
class Workspace:
    """Files shared by every configuration of one run."""

    root: Path
    tokens_npy: Path  # the token stream, for the peers
    train_channel: Path  # the same stream in our shard format


def fresh_job_dir(workspace: Workspace, name: str) -> Path:
    """A new folder per launch: our program resumes from any checkpoint it finds in its job root."""
    parent = workspace.root / "jobs"
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=parent))


def total_steps(mode: BenchMode) -> int:
    return mode.warmup_steps + mode.measure_steps


def peer_spec(config: BenchConfig, mode: BenchMode, workspace: Workspace, work_dir: Path) -> WorkerSpec:
    model = config.model(mode)
    return WorkerSpec(
        model_preset=model.preset, model_overrides={**model.overrides, **model.peer_overrides},
        seq_len=mode.seq_len, batch_size=mode.global_batch_size,
        steps=total_steps(mode), precision=config.precision, device=mode.device,
        compile=config.compiles(mode), tokens_path=str(workspace.tokens_npy),
        result_path=str(work_dir / "result.json"), work_dir=str(work_dir),
    )


def _peer_command(config: BenchConfig, spec: WorkerSpec) -> list[str]:
    return [sys.executable, "-m", f"bench.workers.{config.runner}", "--spec", spec.to_json()]


def _launch(config: BenchConfig, mode: BenchMode, workspace: Workspace) -> tuple[ProcessResult, str, dict]:
    """Runs the configuration; returns its process result, its command line and what it reported."""
    job_dir = fresh_job_dir(workspace, config.name)
    log_path = job_dir / "output.log"
    if config.runner == "ours":
        run = OursRun(config, mode, total_steps(mode), workspace.train_channel, job_dir)
        result = run.launch(log_path)
        command = f"SM_HPS={shlex.quote(run.environment()['SM_HPS'])} " + shlex.join(run.command())
        return result, command, _own_report(run.metrics())
    spec = peer_spec(config, mode, workspace, job_dir)
    command = _peer_command(config, spec)
    # Prepended, not replaced: a machine may hold its packages on PYTHONPATH (GPU mode's wheels).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                      os.environ.get("PYTHONPATH")]))}
    result = run_measured(command, env, log_path, mode.step_timeout_s, cwd=REPO_ROOT)
    reported = Path(spec.result_path)
    extra = json.loads(reported.read_text()) if result.ok and reported.is_file() else {}
    return result, shlex.join(command), {k: v for k, v in extra.items() if k != "worker_peak_rss_bytes"}


def measure(config: BenchConfig, mode: BenchMode, workspace: Workspace) -> dict:
    """The record of one configuration: timing, throughput, memory, and status."""
    record = {"name": config.name, "runner": config.runner, "precision": config.precision,
              "world_size": config.world_size, "parallelism": config.parallelism, "moe": config.moe,
              "load_average_before": load_average()}
    result, command, reported = _launch(config, mode, workspace)
    record.update(command=command, wall_seconds=round(result.wall_seconds, 2),
                  peak_rss_gb=round(result.peak_rss_bytes / GIB, 3),
                  peak_process_rss_gb=round(result.peak_process_rss_bytes / GIB, 3))
    times = step_times(result.lines)
    if not result.ok or len(times.after_warmup(mode.warmup_steps)) == 0:
        reason = "timed out" if result.timed_out else f"exit code {result.returncode}"
        return {**record, "status": "failed", "error": f"{reason}; log tail:\n{result.log_tail()}"}
    cpu = step_cpu_times(result.lines, result.line_cpu_seconds, mode.warmup_steps)
    return {**record, "status": "ok", **_throughput(times, mode),
            "cpu_step_times_s": [round(t, 4) for t in cpu], **reported}


def _throughput(times: StepTimes, mode: BenchMode) -> dict:
    step_time = times.median_after_warmup(mode.warmup_steps)
    return {
        "step_time_s": step_time,
        "step_times_s": [round(t, 4) for t in times.after_warmup(mode.warmup_steps)],
        "tokens_per_s": mode.global_batch_size * mode.seq_len / step_time,
    }


def _own_report(metrics: list[dict]) -> dict:
    """What our program says about itself (a cross-check; the benchmark's clock is what counts)."""
    steps = [line for line in metrics if "loss" in line and "step" in line]
    if not steps:
        return {}
    last = steps[-1]
    keys = ("tokens_per_sec", "mfu", "step_time", "memory_gb")
    return {"final_loss": last["loss"],
            "own_metrics_last_step": {key: last[key] for key in keys if key in last}}
