"""`llmtrain run --local` on the post-training templates (llama-dpo, llama-grpo) with no --data: the
objective's shipped dataset (tiny_preference, tiny_grpo) on llama-tiny, for real up to the exported
model; and data of another objective's kind refused before any job starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from local_e2e_support import JOB_TIMEOUT_SECONDS, REPO_ROOT, cli_command, cli_env, run_cli

pytestmark = pytest.mark.slow


def _exported_model_loads(summary: dict, into: Path) -> None:
    from transformers import AutoModelForCausalLM

    archive = summary["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("file://")
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    model = AutoModelForCausalLM.from_pretrained(next(into.rglob("config.json")).parent)
    assert model.config.model_type == "llama"


def test_dpo_template_trains_on_the_shipped_pairs_and_exports_a_model(tmp_path):
    run = run_cli("llama-dpo", "dpo", tmp_path, "max_steps=2", "grad_accum_steps=2")
    assert run.returncode == 0, run.output[-3000:]
    (job,) = run.job_summaries()
    assert job["TrainingJobStatus"] == "Completed"
    names = {m["MetricName"] for m in job["FinalMetricDataList"]}
    assert {"train:loss", "train:rewards_margins", "train:rewards_accuracies", "eval:loss"} <= names
    assert "tiny_preference" in run.output
    _exported_model_loads(job, tmp_path / "model")


def test_grpo_template_trains_on_the_shipped_prompts(tmp_path):
    run = run_cli("llama-grpo", "grpo", tmp_path, "max_steps=1", "grpo_max_new_tokens=4",
                  "grpo_group_size=2", "grad_accum_steps=1")
    assert run.returncode == 0, run.output[-3000:]
    (job,) = run.job_summaries()
    names = {m["MetricName"] for m in job["FinalMetricDataList"]}
    assert {"train:reward", "train:reward_std", "train:completion_length"} <= names
    assert "tiny_grpo" in run.output


def test_preference_data_for_a_pretraining_template_is_refused_before_any_job(tmp_path):
    pairs = tmp_path / "pairs"
    subprocess.run([sys.executable, "-m", "training_jobs.prepare_data", "--input",
                    str(REPO_ROOT / "examples/data/tiny_preference/validation.jsonl"), "--tokenizer",
                    str(REPO_ROOT / "training_jobs/assets/tokenizer"), "--output", str(pairs),
                    "--preference", "--max-length", "64"], cwd=REPO_ROOT, check=True, capture_output=True)
    command = [*cli_command("llama-pretrain-fsdp", "wrong-kind", tmp_path, "max_steps=1"),
               "--data", str(pairs)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_SECONDS)
    assert result.returncode != 0
    assert "holds preference data" in result.stdout + result.stderr
    assert "objective=next_token" in result.stdout + result.stderr
    jobs = tmp_path / "wrong-kind" / "jobs"
    assert not jobs.exists() or not any(jobs.iterdir())


def test_dpo_template_tunes_locally_on_its_eval_metric(tmp_path):
    """`llmtrain tune --local llama-dpo`: two real trials at once over dpo_beta and lr, each a local run
    on the shipped pairs, reporting the template's eval:rewards_accuracies (maximized); each trial's job got
    the trial's values (early stopping off: with two trials the median pruner may stop the second)."""
    command = [sys.executable, "-m", "llmtrain.cli", "tune", "--local", "llama-dpo", "--run-name", "beta",
               "--workdir", str(tmp_path), "--param", "dpo_beta=0.05..0.5:log",
               "--param", "lr=1e-6..1e-4:log", "--objective", "eval:rewards_accuracies", "--maximize",
               "--trials", "2", "--parallel", "2", "--no-early-stopping", "--seed", "3", "--json",
               "--set", "max_steps=2",
               "--set", "grad_accum_steps=1"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True,
                            timeout=3 * JOB_TIMEOUT_SECONDS)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    tune = json.loads(result.stdout)
    assert (tune["objective"], tune["direction"]) == ("eval:rewards_accuracies", "maximize")
    trials = tune["trials"]
    assert [t["status"] for t in trials] == ["Completed", "Completed"]
    for trial in trials:
        assert 0.0 <= trial["objective"] <= 1.0 and math.isfinite(trial["objective"])
        assert 0.05 <= trial["params"]["dpo_beta"] <= 0.5 and 1e-6 <= trial["params"]["lr"] <= 1e-4
        (request,) = (tmp_path / "beta" / "trials" / trial["name"] / "jobs").glob("*/request.json")
        sent = json.loads(request.read_text())["HyperParameters"]
        assert float(sent["dpo_beta"]) == pytest.approx(trial["params"]["dpo_beta"])
        assert float(sent["lr"]) == pytest.approx(trial["params"]["lr"])
        assert json.loads(sent["objective"]) == "dpo"
    assert trials[0]["params"] != trials[1]["params"]
    assert tune["best"]["objective"] == max(t["objective"] for t in trials)
