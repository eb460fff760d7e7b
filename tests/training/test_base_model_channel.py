"""A base model in the `model` channel as SageMaker JumpStart delivers its training weights (one
.tar.gz of a Hugging Face folder): the program unpacks it once and trains from it exactly as
transformers loads it. The model is a tiny Llama with random weights and the shipped tokenizer,
saved with save_pretrained (the session's `base_model` fixture)."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch
from transformers import AutoModelForCausalLM

from training_jobs.trainer.data import BatchLayout, TokenSamples, TrainBatches
from training_jobs.trainer.errors import ContainerError
from training_jobs.trainer.model_channel import model_folder

from .conftest import TINY, job_root, run_jobs, train_records

SEED = 42
JOB = {**TINY, "parallelism": "single", "grad_accum_steps": 1, "max_steps": 1, "seed": SEED}


def _archive(folder, channel, *, top: str | None = None):
    channel.mkdir(parents=True)
    with tarfile.open(channel / "train-model.tar.gz", "w:gz") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=f"{top}/{path.name}" if top else path.name)
    return channel


def test_the_archive_is_unpacked_once_into_the_folder_inside(base_model, tmp_path):
    channel = _archive(base_model, tmp_path / "data" / "model")
    folder = model_folder(channel)
    assert folder == tmp_path / "data" / "model.unpacked" and (folder / "config.json").is_file()
    marker = folder / "seen"
    marker.write_text("")
    assert model_folder(channel) == folder and marker.is_file()  # not unpacked again
    nested = model_folder(_archive(base_model, tmp_path / "nested" / "model", top="llama"))
    assert nested.name == "llama" and (nested / "config.json").is_file()
    assert model_folder(base_model) == base_model  # a folder channel stays as it is
    empty = tmp_path / "empty" / "model"
    empty.mkdir(parents=True)
    with tarfile.open(empty / "x.tar.gz", "w:gz") as tar:
        tar.add(base_model / "config.json", arcname="a/b/config.json")
    with pytest.raises(ContainerError, match="holds no config.json"):
        model_folder(empty)


def test_training_from_the_archive_starts_where_transformers_loads_the_model(base_model, tiny_data, tmp_path):
    channel = _archive(base_model, tmp_path / "channel" / "model")
    root = job_root(tmp_path / "job", tiny_data, model=channel)
    run_jobs(1, [(root, JOB)], tmp_path)
    first_loss = train_records(root)[0]["loss"]

    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    samples = TokenSamples(tiny_data / "train", JOB["seq_len"], "train", model.config.vocab_size)
    batches = TrainBatches(
        samples, BatchLayout(1, 0, JOB["micro_batch_size"], 1), seed=SEED, device=torch.device("cpu")
    )
    ((inputs, targets),) = batches.next_step()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100
    )
    assert first_loss == pytest.approx(expected.item(), rel=1e-4), json.dumps(train_records(root)[0])
