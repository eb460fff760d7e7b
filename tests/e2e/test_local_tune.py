"""`llmtrain tune --local` end to end (issue 27's acceptance): the shipped default template, run tiny on
this machine, tuned for its learning rate over 8 trials, finds a lower eval loss than the template's
own learning rate on the same steps; the tune is interrupted (Ctrl-C) during a trial and continues
its SQLite study when started again, to 8 counted trials, the interrupted trial's values run again.

Each trial is a real `llmtrain run --local` job (the SageMaker toolkit, torchrun, the training
program). Steps are few so that the ten jobs here fit in a few minutes on 2 cores."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_e2e_support import JOB_TIMEOUT_SECONDS, REPO_ROOT, cli_env, run_cli

pytestmark = pytest.mark.slow

TEMPLATE = "llama-pretrain-fsdp"
# Short trials: one emulated host, one optimizer micro step per step, an evaluation every 4 steps.
SETTINGS = ("instance_count=1", "max_steps=12", "grad_accum_steps=1", "eval_every_steps=4")
TRIALS = 8
INTERRUPT_AFTER = 3


def tune_command(workdir: Path) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "llmtrain.cli",
        "tune",
        "--local",
        TEMPLATE,
        "--run-name",
        "lr",
        "--workdir",
        str(workdir),
        "--param",
        "lr=1e-4..1e-2:log",
        "--objective",
        "eval:loss",
        "--trials",
        str(TRIALS),
        "--seed",
        "3",
        "--json",
    ]
    for setting in SETTINGS:
        command += ["--set", setting]
    return command


def interrupt_during_trial(workdir: Path, trial: int) -> tuple[int, str]:
    """Start the tune and press Ctrl-C once trial `trial` has started (its job is running)."""
    process = subprocess.Popen(
        tune_command(workdir),
        cwd=REPO_ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    deadline = time.monotonic() + JOB_TIMEOUT_SECONDS * 2
    for line in process.stderr:
        lines.append(line)
        if f"trial {trial} started" in line:
            time.sleep(8)  # into the job: the toolkit and the training program are running
            process.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(lines)
    out, err = process.communicate(timeout=JOB_TIMEOUT_SECONDS)
    return process.returncode, "".join(lines) + err + out


def test_a_local_tune_beats_the_default_learning_rate_and_resumes_its_study(tmp_path):
    baseline = run_cli(TEMPLATE, "default-lr", tmp_path, *SETTINGS)
    assert baseline.returncode == 0, baseline.output
    default_loss = next(
        m["Value"] for m in baseline.summary["FinalMetricDataList"] if m["MetricName"] == "eval:loss"
    )

    code, output = interrupt_during_trial(tmp_path, INTERRUPT_AFTER)
    assert code == 130, output
    assert "interrupted" in output and "continue it with the same command" in output, output

    resumed = subprocess.run(
        tune_command(tmp_path),
        cwd=REPO_ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_SECONDS * TRIALS,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    result = json.loads(resumed.stdout)
    trials = result["trials"]
    interrupted = [t for t in trials if t["status"] == "Interrupted"]
    counted = [t for t in trials if t["status"] in ("Completed", "Pruned", "Failed")]
    # The study continued: the trials before the interruption are kept, the interrupted one ran again
    # with its values, and the tune reached --trials.
    assert len(interrupted) == 1 and interrupted[0]["number"] == INTERRUPT_AFTER, trials
    assert len(counted) == TRIALS, trials
    assert [t["number"] for t in trials[:INTERRUPT_AFTER]] == list(range(INTERRUPT_AFTER))
    assert any(t["params"] == interrupted[0]["params"] and t["number"] > INTERRUPT_AFTER for t in counted)
    assert not [t for t in counted if t["status"] == "Failed"], trials
    # Every trial's job is a local run of the template, with the tuned value as a hyperparameter.
    first = json.loads((tmp_path / "lr" / "trials" / "t0" / "summary.json").read_text())
    assert json.loads(first["HyperParameters"]["lr"]) == pytest.approx(trials[0]["params"]["lr"])
    # The best trial beats the template's own learning rate on the same steps.
    assert result["best"]["objective"] < default_loss, (result["best"], default_loss)
    assert (tmp_path / "lr" / "tune.png").is_file() and (tmp_path / "lr" / "study.db").is_file()
