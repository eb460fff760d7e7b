"""Helpers of the local-run end-to-end tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtrain.core.spec import TemplateSpec

E2E_DIR = Path(__file__).resolve().parent
REPO_ROOT = E2E_DIR.parents[1]
# Generous: the machine these run on may be busy; a healthy job takes a fraction of this.
JOB_TIMEOUT_SECONDS = 600


@dataclass
class CliRun:
    returncode: int
    output: str
    run_dir: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())

    def job_summaries(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted((self.run_dir / "jobs").glob("*/summary.json"))]


def cli_command(template: str, run_name: str, workdir: Path, *settings: str) -> list[str]:
    command = [sys.executable, "-m", "llmtrain.cli", "run", "--local", template, "--run-name", run_name,
               "--workdir", str(workdir)]
    for setting in settings:
        command += ["--set", setting]
    return command


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["COLUMNS"] = "200"  # rich wraps the summary panel at the terminal width
    return env


def run_cli(template: str, run_name: str, workdir: Path, *settings: str) -> CliRun:
    result = subprocess.run(cli_command(template, run_name, workdir, *settings), cwd=REPO_ROOT,
                            env=cli_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT_SECONDS)
    return CliRun(result.returncode, result.stdout + result.stderr, workdir / run_name)


def losses_by_step(run_dir: Path, metric: str = "train:loss") -> dict[int, float]:
    """Every logged loss of every job of a run that reported (a killed llmtrain reports nothing); a
    later job's value for a step wins."""
    reported = [job for job in (run_dir / "jobs").iterdir() if (job / "metrics.json").is_file()]
    jobs = sorted(reported, key=lambda p: (p / "metrics.json").stat().st_mtime)
    losses: dict[int, float] = {}
    for job in jobs:
        for point in json.loads((job / "metrics.json").read_text()):
            if point["name"] == metric and point["step"] is not None:
                losses[point["step"]] = point["value"]
    return losses


def toy_template(**changes: Any) -> TemplateSpec:
    """A byo template around tests/e2e/toy_program (repository root: tests/e2e)."""
    data: dict[str, Any] = {
        "name": "toy",
        "version": "1.0.0",
        "description": "The local runner's test program.",
        "code": {"source": "toy_program", "entry_point": "train.py"},
        "image": {"framework_version": "2.8.0", "py_version": "py312"},
        "distribution": {"strategy": "ddp"},
        "compute": {"instance_type": "ml.c5.xlarge", "instance_count": 1, "volume_size_gb": 30},
        "input": {"channels": {"train": "toy/"}},
        "hyperparameters": {"max_steps": 3, "step_seconds": 0.0, "fail": False, "gloo_quirk": False},
        "metrics": [
            {"name": "train:loss", "regex": r"\[metrics\].* loss=([0-9.]+)"},
            {"name": "train:tokens_per_sec", "regex": r"\[metrics\].* tokens_per_sec=([0-9.]+)"},
        ],
        "stopping": {"max_runtime_seconds": 3600},
        "overridable": {"max_steps": {"type": "int", "min": 1}},
    }
    data.update(changes)
    return TemplateSpec.from_dict(data, "toy.yaml")
