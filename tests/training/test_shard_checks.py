"""The program's own refusal of shards whose manifest they contradict (issue 36, item 19) and of loss
masks that train no answer token (item 18), as the job's loader and `python -m training_jobs.data_info`
(what the platform runs before a local job) apply them."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from training_jobs.trainer.data import TokenSamples
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import mask_name, read_manifest, write_manifest

from .conftest import REPO, child_env


def _dataset(folder, tokens, *, vocab_size=629, masks=None):
    folder.mkdir(parents=True)
    np.asarray(tokens, dtype="<u2").tofile(folder / "shard_00000.bin")
    if masks is not None:
        np.asarray(masks, dtype=np.uint8).tofile(folder / mask_name("shard_00000.bin"))
    write_manifest(folder, dtype="uint16", vocab_size=vocab_size, eos_token_id=0, num_documents=1,
                   shards=[("shard_00000.bin", len(tokens))], tokenizer="test", loss_mask=masks is not None)
    return folder


@pytest.mark.parametrize("vocab_size", [-1, 0])
def test_a_vocab_size_without_its_end_of_sequence_id_is_malformed(tmp_path, vocab_size):
    folder = _dataset(tmp_path / "d", [5, 6, 0] * 20, vocab_size=vocab_size)
    with pytest.raises(DataError, match=f"says vocab_size {vocab_size} and eos_token_id 0"):
        read_manifest(folder)


def test_tokens_beyond_the_manifests_vocab_size_are_refused_when_the_channel_loads(tmp_path):
    folder = _dataset(tmp_path / "d", [5, 628, 0] * 20, vocab_size=100)
    with pytest.raises(DataError, match="says vocab_size 100, but its shards hold token id 628 outside"):
        TokenSamples(folder, seq_len=8, channel="train", model_vocab_size=629)
    fine = _dataset(tmp_path / "fine", [5, 99, 0] * 20, vocab_size=100)
    assert TokenSamples(fine, seq_len=8, channel="train", model_vocab_size=629).num_samples == 7


def test_data_info_prints_what_the_loader_would_refuse(tmp_path):
    bad_vocab = _dataset(tmp_path / "v", [5, 628, 0] * 20, vocab_size=100)
    untrained = _dataset(tmp_path / "m", [5, 6, 0] * 20, masks=[0, 0, 1] * 20)
    fine = _dataset(tmp_path / "ok", [5, 6, 0] * 20, masks=[0, 1, 1] * 20)
    result = subprocess.run([sys.executable, "-m", "training_jobs.data_info", f"train={bad_vocab}",
                             f"validation={untrained}", f"extra={fine}"],
                            cwd=REPO, env=child_env(), capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.startswith("the train channel: ") and "token id 628 outside that vocabulary" in first
    assert second.startswith(f"the validation channel ({untrained}) trains no answer token")
