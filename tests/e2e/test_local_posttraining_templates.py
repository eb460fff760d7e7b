"""`llmtrain run --local` on the post-training templates (llama-dpo, llama-grpo) with no --data: the
objective's shipped dataset (tiny_preference, tiny_grpo) on llama-tiny, for real up to the exported
model; and data of another objective's kind refused before any job starts."""

from __future__ import annotations

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
