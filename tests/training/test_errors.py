"""Bad input stops the job at once, non-zero, with a message that names the problem.

Hyperparameters are checked before torch is even imported; data channels before the model is
built; a diverged loss at the next logging step, before any checkpoint is written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from training_jobs.trainer.shards import mask_name, read_manifest, write_manifest

from .conftest import REPO, TINY, TRAIN, child_env, job_root, outcome, run_jobs

pytestmark = pytest.mark.slow


def _train(root, hyperparameters=None, args=()) -> subprocess.CompletedProcess:
    env = child_env(SAGEMAKER_BASE_DIR=str(root))
    if hyperparameters is not None:
        env["SM_HPS"] = json.dumps(hyperparameters)
    return subprocess.run([sys.executable, str(TRAIN), *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize(("hyperparameters", "expected"), [
    ({"learning_rate": 0.1}, "unknown hyperparameter 'learning_rate'"),
    ({"max_steps": "many"}, "invalid hyperparameter 'max_steps': got 'many', expected an integer"),
    ({"compile": 1}, "invalid hyperparameter 'compile': got 1, expected true or false"),
    ({"parallelism": "zero"}, "invalid hyperparameter 'parallelism'"),
    ({"lr": -1}, "invalid hyperparameter 'lr': got -1.0, expected a value > 0.0"),
])
def test_invalid_hyperparameters_in_sm_hps_stop_at_once(tmp_path, hyperparameters, expected):
    result = _train(tmp_path, {**TINY, **hyperparameters})
    assert result.returncode == 1
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_the_reason_becomes_the_jobs_failure_reason(tmp_path):
    """SageMaker's FailureReason is the output/failure file; the toolkit alone would leave it empty."""
    (tmp_path / "output").mkdir()
    env = child_env(SAGEMAKER_BASE_DIR=str(tmp_path), SM_OUTPUT_DIR=str(tmp_path / "output"),
                    SM_HPS=json.dumps({**TINY, "learning_rate": 0.1}))
    result = subprocess.run([sys.executable, str(TRAIN)], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1
    failure = (tmp_path / "output" / "failure").read_text()
    assert failure.startswith("ConfigError: unknown hyperparameter 'learning_rate'")


def test_invalid_hyperparameter_on_the_command_line(tmp_path):
    result = _train(tmp_path, args=["--model_preset", "llama-tiny", "--seq_len", "0"])
    assert result.returncode == 1
    assert "invalid hyperparameter 'seq_len': got 0, expected a value >= 1" in result.stderr


def test_nan_loss_stops_the_job_without_checkpointing_it(tiny_data, tmp_path):
    root = job_root(tmp_path / "job", tiny_data)
    result = _train(root, {**TINY, "parallelism": "single", "micro_batch_size": 4, "lr": 1e30,
                           "max_steps": 20, "log_every_steps": 5, "checkpoint_every_steps": 5})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "[error] DivergenceError: the" in result.stderr and "training diverged" in result.stderr
    assert not any((root / "checkpoints").iterdir())


def _dataset(folder, tokens: np.ndarray, vocab_size: int = 629):
    folder.mkdir(parents=True)
    tokens.astype("<u2").tofile(folder / "shard_00000.bin")
    write_manifest(folder, dtype="uint16", vocab_size=vocab_size, eos_token_id=0, num_documents=1,
                   shards=[("shard_00000.bin", len(tokens))], tokenizer="test")
    return folder


@pytest.fixture(scope="module")
def bad_channels(tmp_path_factory, tiny_data):
    base = tmp_path_factory.mktemp("bad")
    truncated = base / "truncated"
    shutil.copytree(tiny_data / "train", truncated)
    shard = read_manifest(truncated).shards[1].path
    shard.write_bytes(shard.read_bytes()[:1001])
    not_json = base / "not_json"
    not_json.mkdir()
    (not_json / "manifest.json").write_text("{\"format\": ")
    (base / "no_manifest").mkdir()
    return {
        "empty": (_dataset(base / "empty", np.array([5, 6, 7, 0])), "not enough for one sample"),
        "truncated": (truncated, f"{shard.name} has 1001 bytes but the manifest says"),
        "not_json": (not_json, "manifest.json is not valid JSON"),
        "no_manifest": (base / "no_manifest", "no manifest.json in"),
        "foreign_tokens": (_dataset(base / "foreign", np.full(200, 60000)), "token id 60000 outside"),
    }


def _masked_copy(folder, source):
    """`source`'s shards as a loss-masked dataset (every target trained)."""
    folder.mkdir(parents=True)
    shards = []
    for shard in read_manifest(source).shards:
        shutil.copy(shard.path, folder / shard.path.name)
        np.ones(shard.num_tokens, dtype=np.uint8).tofile(folder / mask_name(shard.path.name))
        shards.append((shard.path.name, shard.num_tokens))
    write_manifest(folder, dtype="uint16", vocab_size=629, eos_token_id=0, num_documents=1,
                   shards=shards, tokenizer="test", loss_mask=True)
    return folder


def _small_vocab_checkpoint(folder):
    """A Llama checkpoint whose embedding has fewer rows than the shipped tokenizer has tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2,
                                 max_position_embeddings=128)).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def failed_jobs(tmp_path_factory, tiny_data, bad_channels, base_model):
    base = tmp_path_factory.mktemp("failing")
    jobs = {name: (job_root(base / name, tiny_data, train=folder), {**TINY, "parallelism": "single"})
            for name, (folder, _) in bad_channels.items()}
    jobs["masked_train_plain_validation"] = (
        job_root(base / "mixed", tiny_data, validation=True,
                 train=_masked_copy(base / "masked", tiny_data / "train")),
        {**TINY, "parallelism": "single", "eval_every_steps": 2})
    jobs["qlora_without_checkpoint"] = (job_root(base / "qlora", tiny_data),
                            {**TINY, "parallelism": "single", "lora_r": 4, "quantization": "nf4"})
    jobs["smp_without_library"] = (job_root(base / "smp", tiny_data), {**TINY, "parallelism": "smp"})
    jobs["no_preset_no_model"] = (job_root(base / "nomodel", tiny_data),
                                  {**{k: v for k, v in TINY.items() if k != "model_preset"},
                                   "parallelism": "single"})
    # base_model: max_position_embeddings 128, and the shipped tokenizer in its folder
    jobs["seq_len_beyond_checkpoint"] = (job_root(base / "long", tiny_data, model=base_model),
                                         {**TINY, "parallelism": "single", "seq_len": 256})
    jobs["tokenizer_beyond_embedding"] = (
        job_root(base / "vocab", tiny_data, model=_small_vocab_checkpoint(base / "small_vocab"),
                 tokenizer=base_model),
        {**TINY, "parallelism": "single"})
    run_jobs(1, list(jobs.values()), base)
    return {name: outcome(root) for name, (root, _) in jobs.items()}


@pytest.mark.parametrize("name", ["empty", "truncated", "not_json", "no_manifest", "foreign_tokens"])
def test_bad_data_channel_stops_with_a_clear_message(failed_jobs, bad_channels, name):
    assert failed_jobs[name]["error"] == "DataError"
    assert bad_channels[name][1] in failed_jobs[name]["message"]


def test_train_and_validation_must_agree_on_the_loss_mask(failed_jobs):
    assert failed_jobs["masked_train_plain_validation"]["error"] == "DataError"
    assert "only the train channel has a loss mask" in \
        failed_jobs["masked_train_plain_validation"]["message"]


def test_qlora_without_a_checkpoint_to_quantize_is_a_clear_error(failed_jobs):
    assert failed_jobs["qlora_without_checkpoint"]["error"] == "ConfigError"
    assert "nf4 quantizes the checkpoint in the model channel and this job has none" in \
        failed_jobs["qlora_without_checkpoint"]["message"]


def test_smp_without_torch_sagemaker_is_a_clear_error(failed_jobs):
    assert failed_jobs["smp_without_library"]["error"] == "ContainerError"
    assert "torch.sagemaker" in failed_jobs["smp_without_library"]["message"]
    assert "parallelism=fsdp" in failed_jobs["smp_without_library"]["message"]


def test_a_model_is_required(failed_jobs):
    assert "set it (e.g. llama-1b) or provide a `model` channel" in \
        failed_jobs["no_preset_no_model"]["message"]


def test_seq_len_beyond_the_checkpoints_context_is_refused(failed_jobs):
    failure = failed_jobs["seq_len_beyond_checkpoint"]
    assert failure["error"] == "ConfigError"
    assert "'seq_len': 256 exceeds the checkpoint's context length of 128 positions; set seq_len <= 128" \
        in failure["message"]


def test_a_tokenizer_larger_than_the_embedding_is_refused(failed_jobs):
    failure = failed_jobs["tokenizer_beyond_embedding"]
    assert failure["error"] == "ConfigError"
    assert "embeds only 256: train with the checkpoint's own tokenizer" in failure["message"]
