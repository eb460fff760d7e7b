"""`llmtrain run --local` on the platform's own templates: the real CLI, toolkit, torchrun and program.

Every job is tiny (llama-tiny, a few steps, the shipped tiny corpus) so the whole module stays within
a few minutes on two cores. SageMaker itself cannot run here: everything up to it does, for real.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
from local_e2e_support import JOB_TIMEOUT_SECONDS, REPO_ROOT, cli_command, cli_env, losses_by_step, run_cli

pytestmark = pytest.mark.slow

STEPS = 12
# Every step logs its own loss (no averaging over a window), so runs compare step by step.
SHORT_FSDP = ("instance_count=1", f"max_steps={STEPS}", "log_every_steps=1")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def straight(workdir):
    """A single-host, 2-process FSDP run that is never interrupted: the reference for resumption."""
    return run_cli("llama-pretrain-fsdp", "straight", workdir, *SHORT_FSDP)


def log_text(summary: dict, host: str = "algo-1") -> str:
    return Path(summary["LocalRun"]["Logs"][host]).read_text()


def test_fsdp_template_runs_on_one_host_with_two_processes(straight):
    assert straight.returncode == 0, straight.output[-3000:]
    summary = straight.summary
    assert summary["TrainingJobStatus"] == "Completed"
    assert summary["LocalRun"]["Hosts"] == ["algo-1"]
    assert summary["LocalRun"]["ProcessesPerHost"] == 2
    log = log_text(summary)
    assert "torchrun --nnodes 1 --nproc_per_node 2 training_jobs/train.py" in log
    assert "ParallelDims(pipeline=1, replicate=1, shard=2, tensor=1, context=1)" in log
    assert sorted(losses_by_step(straight.run_dir)) == list(range(1, STEPS + 1))
    # Scaled down, and said so, never silently.
    settings = {a["Setting"] for a in summary["LocalRun"]["Adjustments"]}
    assert {"HyperParameters.model_preset", "processes per host", "ResourceConfig.InstanceType"} <= settings
    assert "llama-7b -> llama-tiny" in straight.output
    # The template's own regexes match every line, eval:loss too: the default run evaluates on the
    # shipped corpus's validation split; with max_steps=12 of the user's and evaluation every 1000
    # steps, once, at the end.
    assert summary["LocalRun"]["UnmatchedMetricDefinitions"] == []
    final = {m["MetricName"] for m in summary["FinalMetricDataList"]}
    assert {"train:loss", "train:tokens_per_sec", "eval:loss"} <= final
    assert sorted(losses_by_step(straight.run_dir, "eval:loss")) == [STEPS]
    assert "lines of library warnings and toolkit messages are only in the log file(s)" in straight.output
    assert "torch/distributed/run.py" not in straight.output  # torchrun's banner: in the log only
    assert "torch/distributed/run.py" in log_text(summary)
    # The model as SageMaker would upload it: HF safetensors in model.tar.gz.
    artifact = Path(summary["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("file://"))
    with tarfile.open(artifact) as tar:
        assert {"config.json", "model.safetensors"} <= set(tar.getnames())
    assert (straight.run_dir / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    # TensorBoard: the program's events, where TensorBoardOutputConfig's LocalPath maps in the job
    # root, reach the run's folder as they would reach the S3 prefix.
    local_path = summary["TensorBoardOutputConfig"]["LocalPath"].removeprefix("/opt/ml/")
    job_root = Path(summary["LocalRun"]["JobFolder"]) / "algo-1"
    written = sorted(p.name for p in (job_root / local_path).glob("events.out.tfevents.*"))
    assert written and sorted(p.name for p in (straight.run_dir / "tensorboard").iterdir()) == written
    assert summary["TensorBoardOutputConfig"]["S3OutputPath"] == \
        (straight.run_dir / "tensorboard").resolve().as_uri()


def test_a_local_run_logs_to_an_mlflow_store_in_its_folder(straight):
    """Read back with the mlflow package: what `mlflow ui --backend-store-uri ...` shows."""
    from mlflow.tracking import MlflowClient

    assert straight.returncode == 0, straight.output[-3000:]
    store = f"sqlite:///{(straight.run_dir / 'mlflow.db').resolve()}"
    assert f"mlflow ui --backend-store-uri {store}" in straight.output
    client = MlflowClient(tracking_uri=store)
    # <team>-<template>, as in the cloud: a local run renders for the team `default`.
    experiment = client.get_experiment_by_name("default-llama-pretrain-fsdp")
    [run] = client.search_runs([experiment.experiment_id])
    job = straight.summary["TrainingJobName"]
    assert run.info.run_name == job and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses_by_step(straight.run_dir), abs=1e-6)
    assert run.data.params["model_preset"] == "llama-tiny" and run.data.params["max_steps"] == str(STEPS)
    assert run.data.tags["model_artifact"] == (straight.run_dir / "jobs" / job / "output" /
                                               "model.tar.gz").resolve().as_uri()


def test_stopped_run_resumes_by_run_name_with_the_same_losses(straight, workdir):
    assert straight.returncode == 0, straight.output[-3000:]
    # Stop like StopTrainingJob: SIGTERM to llmtrain once training is under way.
    process = subprocess.Popen(cli_command("llama-pretrain-fsdp", "stopped", workdir, *SHORT_FSDP),
                               cwd=REPO_ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    output = []
    deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
    for line in process.stdout:
        output.append(line)
        if f"step 1/{STEPS}" in line:
            process.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(output)
    output.extend(process.stdout)
    assert process.wait(timeout=JOB_TIMEOUT_SECONDS) == 130, "".join(output)[-3000:]
    stopped_dir = workdir / "stopped"
    stopped = json.loads((stopped_dir / "summary.json").read_text())
    assert stopped["TrainingJobStatus"] == "Stopped"
    saved = sorted(p.name for p in (stopped_dir / "checkpoints").glob("step_*"))
    assert saved, "the stopped job saved no checkpoint"
    stopped_at = max(losses_by_step(stopped_dir))
    assert stopped_at < STEPS

    resumed = run_cli("llama-pretrain-fsdp", "stopped", workdir, *SHORT_FSDP)

    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.summary["TrainingJobStatus"] == "Completed"
    assert "resumed from" in log_text(resumed.summary)
    second_job = json.loads(Path(resumed.summary["LocalRun"]["JobFolder"], "metrics.json").read_text())
    assert min(p["step"] for p in second_job if p["name"] == "train:loss") == stopped_at + 1
    assert losses_by_step(stopped_dir) == losses_by_step(straight.run_dir)


def _committed_steps(run_dir: Path) -> list[int]:
    """Checkpoints the program committed in any job's host folders (COMPLETE is written last)."""
    return sorted(int(marker.parent.name.removeprefix("step_"))
                  for marker in run_dir.glob("jobs/*/algo-*/checkpoints/step_*/COMPLETE"))


def test_a_killed_llmtrain_takes_its_job_along_and_the_next_run_resumes(straight, workdir, tmp_path):
    """SIGKILL (or the OOM killer) gives llmtrain no chance to stop its job or sync its checkpoints:
    no training process may survive it, and the next run of the name resumes from the last
    checkpoint the killed job committed."""
    assert straight.returncode == 0, straight.output[-3000:]
    settings = (*SHORT_FSDP, "checkpoint_every_steps=1")
    run_dir = workdir / "killed"
    with (tmp_path / "killed.log").open("w") as log:
        llmtrain = subprocess.Popen(cli_command("llama-pretrain-fsdp", "killed", workdir, *settings),
                                    cwd=REPO_ROOT, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
        while not _committed_steps(run_dir):
            running = llmtrain.poll() is None and time.monotonic() < deadline
            assert running, (tmp_path / "killed.log").read_text()
            time.sleep(0.05)
        job_processes = psutil.Process(llmtrain.pid).children(recursive=True)
        assert any("train.py" in " ".join(p.cmdline()) for p in job_processes)  # the ranks among them
        llmtrain.kill()
        llmtrain.wait()
    committed = _committed_steps(run_dir)
    _, alive = psutil.wait_procs(job_processes, timeout=30)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    assert max(committed) < STEPS
    assert not (run_dir / "summary.json").exists()  # the killed job never reported

    resumed = run_cli("llama-pretrain-fsdp", "killed", workdir, *settings)

    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "ended without syncing its checkpoints (its llmtrain process was killed): synced them now" \
        in resumed.output
    resumed_at = re.search(r"resumed from \S+/step_\d+ at step (\d+)", log_text(resumed.summary))
    assert resumed_at and int(resumed_at.group(1)) == max(committed)
    after_resume = losses_by_step(run_dir)  # the resumed job's: the killed one never reported
    assert sorted(after_resume) == list(range(max(committed) + 1, STEPS + 1))
    assert after_resume == {step: loss for step, loss in losses_by_step(straight.run_dir).items()
                            if step in after_resume}


def test_two_hosts_are_emulated_in_one_process_group(workdir):
    run = run_cli("llama-pretrain-fsdp", "two-hosts", workdir, "max_steps=2")

    assert run.returncode == 0, run.output[-3000:]
    summary = run.summary
    assert summary["TrainingJobStatus"] == "Completed"
    assert summary["LocalRun"]["Hosts"] == ["algo-1", "algo-2"]
    assert "--nnodes 2 --nproc_per_node 2 --master_addr algo-1 --master_port 7777 --node_rank 1" \
        in log_text(summary, "algo-2")
    assert "ParallelDims(pipeline=1, replicate=1, shard=4, tensor=1, context=1)" in log_text(summary)
    # One checkpoint from both hosts' shards, as the S3 prefix would hold it.
    shards = sorted(p.name for p in (run.run_dir / "checkpoints" / "step_00000002").glob("*.distcp"))
    assert shards == [f"__{rank}_0.distcp" for rank in range(4)]


def test_deepspeed_template_runs(workdir):
    run = run_cli("llama-finetune-deepspeed", "deepspeed", workdir, "max_steps=2")

    assert run.returncode == 0, run.output[-3000:]
    summary = run.summary
    assert summary["TrainingJobStatus"] == "Completed"
    assert json.loads(summary["HyperParameters"]["zero_stage"]) == 3
    # The 7B checkpoint of the model channel is not used locally; the program builds llama-tiny.
    adjustments = {a["Setting"]: a["Local"] for a in summary["LocalRun"]["Adjustments"]}
    assert adjustments["InputDataConfig.model"] == "(not provided)"
    assert sorted(losses_by_step(run.run_dir)) == [1, 2]


def test_lora_template_fine_tunes_on_prompt_completion_examples(workdir):
    """The shipped examples prepared with a loss mask, run by the template's frozen code (which
    must read masked datasets: older code refuses them)."""
    data = workdir / "sft-data"
    prepared = subprocess.run(
        [sys.executable, "-m", "training_jobs.prepare_data", "--input",
         str(REPO_ROOT / "examples" / "data" / "tiny_sft" / "train.jsonl"), "--tokenizer",
         str(REPO_ROOT / "training_jobs" / "assets" / "tokenizer"), "--output", str(data),
         "--completion-key", "completion", "--validation-fraction", "0.05", "--workers", "1"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_SECONDS)
    assert prepared.returncode == 0, prepared.stderr
    command = cli_command("llama-finetune-lora", "sft", workdir, "max_steps=3") + \
        ["--data", f"train={data / 'train'}", "--data", f"validation={data / 'validation'}"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_SECONDS)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    summary = json.loads((workdir / "sft" / "summary.json").read_text())
    assert summary["TrainingJobStatus"] == "Completed"
    code = {a["Setting"]: a["Cloud"] for a in summary["LocalRun"]["Adjustments"]}
    assert code["HyperParameters.sagemaker_submit_directory"].endswith(
        "/templates/llama-finetune-lora/1.3.0/sourcedir.tar.gz")
    final = {m["MetricName"]: m["Value"] for m in summary["FinalMetricDataList"]}
    assert {"train:loss", "eval:loss"} <= set(final)
    assert sorted(losses_by_step(workdir / "sft")) == [1, 2, 3]


def test_a_bad_hyperparameter_is_refused_before_any_job_with_the_programs_reason(workdir):
    """The training program's own rules run at render (its contract): a value it would stop on at
    start never reaches a job, here or in the cloud."""
    run = run_cli("llama-pretrain-fsdp", "bad-hp", workdir, "instance_count=1", "profile_steps=soon")

    assert run.returncode == 2, run.output[-3000:]
    assert ("the training program refuses this run: invalid hyperparameter 'profile_steps': got 'soon', "
            'expected "START-END"') in run.output
    assert "Traceback" not in run.output
    assert not (run.run_dir / "jobs").exists() and not (run.run_dir / "summary.json").exists()
