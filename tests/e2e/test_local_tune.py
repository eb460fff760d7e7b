"""`llmtrain tune --local` end to end (issue 27's acceptance): the shipped default template, run tiny on
this machine, tuned for its learning rate over 8 trials, finds a lower eval loss than the template's
own learning rate on the same steps; the tune is interrupted (Ctrl-C) during a trial and continues
its SQLite study when started again, to 8 counted trials, the interrupted trial's values run again.

Each trial is a real `llmtrain run --local` job (the SageMaker toolkit, torchrun, the training
program). Steps are few, and the trials run two at a time (`--parallel 2`: one training process
each, with two micro-batches per step where the baseline's two processes take one each, so every
job trains the same global batch), so that the ten jobs here fit in a few minutes on 2 cores."""

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
# Short jobs: one emulated host, an evaluation every 4 steps. The baseline runs two processes of one
# micro-batch per step; a trial (two at a time) one process of two: the same global batch.
COMMON = ("instance_count=1", "max_steps=12", "eval_every_steps=4")
SETTINGS = (*COMMON, "grad_accum_steps=1")
TRIAL_SETTINGS = (*COMMON, "grad_accum_steps=2")
TRIALS = 8
PARALLEL = 2
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
        "--parallel",
        str(PARALLEL),
        "--json",
    ]
    for setting in TRIAL_SETTINGS:
        command += ["--set", setting]
    return command


def _default_interrupt() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_during_trial(workdir: Path, trial: int) -> tuple[int, str]:
    """Start the tune and press Ctrl-C once trial `trial` has started (its job is running)."""
    process = subprocess.Popen(
        tune_command(workdir),
        cwd=REPO_ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell's background job (`make test &`, nohup) ignores SIGINT, and a child inherits that: the
        # tune must get Ctrl-C as a terminal gives it.
        preexec_fn=_default_interrupt,
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
    # The study continued: the trials before the interruption are kept, the ones running at Ctrl-C
    # (trial INTERRUPT_AFTER and, two at a time, perhaps its neighbour) ran again with their values,
    # and the tune reached --trials.
    assert INTERRUPT_AFTER in [t["number"] for t in interrupted] and len(interrupted) <= PARALLEL, trials
    assert len(counted) == TRIALS, trials
    assert [t["number"] for t in trials[:INTERRUPT_AFTER]] == list(range(INTERRUPT_AFTER))
    for stopped in interrupted:
        assert any(t["params"] == stopped["params"] and t["number"] > stopped["number"] for t in counted)
    assert not [t for t in counted if t["status"] == "Failed"], trials
    # Every trial's job is a local run of the template, with the tuned value as a hyperparameter.
    first = json.loads((tmp_path / "lr" / "trials" / "t0" / "summary.json").read_text())
    assert json.loads(first["HyperParameters"]["lr"]) == pytest.approx(trials[0]["params"]["lr"])
    # The best trial beats the template's own learning rate on the same steps.
    assert result["best"]["objective"] < default_loss, (result["best"], default_loss)
    assert (tmp_path / "lr" / "tune.png").is_file() and (tmp_path / "lr" / "study.db").is_file()
