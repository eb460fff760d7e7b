"""Shared fixtures for the training program's tests: real data, real torchrun launches.

Every multi-process test runs `python -m torch.distributed.run` with gloo on CPU. A launch costs
several seconds of start-up, so tests group several jobs per launch (tests/training/multirun.py)
and module-scoped fixtures share one launch between the tests that check its results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from shared_tmp import workers_shared_folder

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "training_jobs" / "train.py"
MULTIRUN = Path(__file__).resolve().parent / "multirun.py"
CORPUS = REPO / "examples" / "data" / "tiny_corpus"
TOKENIZER = REPO / "training_jobs" / "assets" / "tokenizer"

# A few steps of the tiny Llama on 32-token samples: seconds per job, and every code path.
TINY = {"model_preset": "llama-tiny", "seq_len": 32, "micro_batch_size": 2, "grad_accum_steps": 2,
        "max_steps": 4, "log_every_steps": 1, "mixed_precision": "fp32", "checkpoint_every_steps": 0,
        "lr": 1e-3, "warmup_steps": 1, "max_grad_norm": 0.0}


def child_env(**extra: str) -> dict[str, str]:
    """The parent's environment without SageMaker variables, set up for CPU runs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SM_", "SAGEMAKER_"))}
    env.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@dataclass
class Completed:
    returncode: int
    output: str


def torchrun(nproc: int, script: Path, args: list[str], *, env: dict[str, str] | None = None,
             timeout: float = 420) -> Completed:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(_free_port()), str(script), *args]
    result = subprocess.run(command, env=env or child_env(), capture_output=True, text=True,
                            timeout=timeout, cwd=REPO)
    return Completed(result.returncode, result.stdout + result.stderr)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_root(base: Path, data: Path, *, validation: bool = False, **channels: Path) -> Path:
    """A folder laid out like /opt/ml with the channels linked in."""
    root = base
    (root / "input" / "data").mkdir(parents=True, exist_ok=True)
    links = {"train": data / "train", **channels}
    if validation:
        links["validation"] = data / "validation"
    for name, target in links.items():
        (root / "input" / "data" / name).symlink_to(target, target_is_directory=True)
    return root


def run_jobs(nproc: int, jobs: list[tuple[Path, dict] | tuple[Path, dict, dict]], spec_dir: Path,
             timeout: float = 420) -> Completed:
    """Run several jobs in one torchrun launch; assert the launch itself succeeded. A job is (root,
    hyperparameters) or (root, hyperparameters, environment variables for that job only)."""
    spec = spec_dir / f"spec-{len(list(spec_dir.glob('spec-*.json')))}.json"
    spec.write_text(json.dumps([{"root": str(job[0]), "hyperparameters": job[1],
                                 "environment": job[2] if len(job) > 2 else {}} for job in jobs]))
    completed = torchrun(nproc, MULTIRUN, [str(spec)], timeout=timeout)
    assert completed.returncode == 0, completed.output[-6000:]
    return completed


def outcome(root: Path) -> dict:
    return json.loads((root / "outcome.json").read_text())


def train_records(root: Path) -> list[dict]:
    lines = (root / "output" / "data" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == "train"]


def losses(root: Path) -> list[float]:
    assert outcome(root)["ok"], outcome(root)
    return [record["loss"] for record in train_records(root)]


def _prepare_tiny(output: Path) -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "training_jobs.prepare_data", "--input", str(CORPUS / "train.jsonl"),
         "--tokenizer", str(TOKENIZER), "--output", str(output), "--workers", "2",
         "--validation-fraction", "0.1", "--shard-tokens", "20000"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return output


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """The shipped tiny corpus, tokenized by the real prepare_data CLI (train + validation)."""
    return _prepare_tiny(tmp_path_factory.mktemp("data") / "tiny")


# The 8-rank jobs of test_pipeline.py (a 3-D mesh: pipeline x FSDP2 x tensor parallel) and
# test_scale.py (pipeline x context x tensor parallel). Eight processes on two cores start and
# rendezvous for about 40 s, so both files share one launch (eight_rank_runs).
PIPELINE_BASE = {**TINY, "model_overrides": {"num_hidden_layers": 4}, "grad_accum_steps": 4, "max_steps": 6,
                 "lr_decay_steps": 6, "eval_steps": 4, "eval_every_steps": 3}
PIPELINE_PP = {**PIPELINE_BASE, "parallelism": "ddp", "pipeline_parallel_degree": 2}
SCALE_BASE = {**TINY, "micro_batch_size": 2, "grad_accum_steps": 1, "global_batch_size": 8, "max_steps": 6,
              "lr_decay_steps": 6, "eval_steps": 2, "eval_every_steps": 3}
SCALE_FSDP = {**SCALE_BASE, "parallelism": "fsdp"}
EIGHT_RANK_JOBS = {
    "3d": {**PIPELINE_PP, "parallelism": "fsdp", "tensor_parallel_degree": 2, "micro_batch_size": 2},
    "pp2_cp2_tp2": {**SCALE_FSDP, "pipeline_parallel_degree": 2, "context_parallel_degree": 2,
                    "tensor_parallel_degree": 2, "max_steps": 3},
}


@pytest.fixture(scope="session")
def eight_rank_runs(tmp_path_factory) -> dict[str, Path]:
    """EIGHT_RANK_JOBS' job folders, from one launch: under pytest-xdist the first worker to ask runs
    it in the workers' shared temporary folder, and the other waits for it (a file lock)."""
    from filelock import FileLock

    shared = workers_shared_folder(tmp_path_factory)
    folder = shared / "eight-ranks"
    with FileLock(str(shared / "eight-ranks.lock")):
        if not (folder / "launched").exists():
            if folder.exists():  # a failed attempt of the other worker's: start over
                shutil.rmtree(folder)
            data = _prepare_tiny(folder / "data")
            jobs = [(job_root(folder / name, data, validation=True), hps)
                    for name, hps in EIGHT_RANK_JOBS.items()]
            (folder / "launched").write_text(run_jobs(8, jobs, folder).output)
    return {name: folder / name for name in EIGHT_RANK_JOBS}


@pytest.fixture(scope="session")
def base_model(tmp_path_factory):
    """A 'pretrained' Llama saved as an HF folder with its tokenizer, as a model channel holds."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("base") / "model"
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    torch.manual_seed(123)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=640, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128,
                                         eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


TORCHAO = "torchao==0.18.0"  # declares no torch dependency: the CPU build of torch stays
NEEDS_TORCHAO = pytest.mark.skipif(
    tuple(int(part) for part in __import__("torch").__version__.split(".")[:2]) < (2, 11),
    reason=f"{TORCHAO} needs torch 2.11 or newer; an older container pairs its torch with an older "
           "torchao (docs/training.md, FP8)")


@pytest.fixture(scope="session")
def torchao_python(tmp_path_factory) -> Path:
    """A Python with torchao, in a virtual environment of its own beside the project's (its compiled
    kernels do not load against this torch and say so at every import), seeing the project's
    packages."""
    import site

    venv = tmp_path_factory.mktemp("torchao") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    packages = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    (Path(packages) / "project.pth").write_text(site.getsitepackages()[0] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", TORCHAO], check=True)
    return python


@pytest.fixture
def group_of_one(tmp_path):
    """This process as a job of one rank, torn down after the test (the checkpoint store's barriers
    and gathers and the MoE signals' all-reduces are collectives)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "rendezvous"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()
