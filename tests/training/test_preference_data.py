"""Preference pairs from prepare_data to the batches DPO trains on: masks on the completions only,
pairs left out with counts, other field names and chat messages, and the manifest version that older
program code and other objectives refuse."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from training_jobs import prepare_data
from training_jobs.contract.objectives import data_kind_problem
from training_jobs.trainer.data import IGNORE_INDEX
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.preference_data import PreferencePairs
from training_jobs.trainer.shards import read_manifest

from .conftest import REPO, TOKENIZER, child_env

PAIRS = [{"prompt": f"Q{i}: reverse a, b.\nA:", "chosen": " b, a.", "rejected": f" a, b{'!' * i}."}
         for i in range(6)]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _prepare(tmp_path: Path, records: list[dict], *options: str, tokenizer: Path = TOKENIZER,
             name: str = "out") -> tuple[int, str, Path]:
    """prepare_data's command line, run in this process (its own start-up, importing transformers,
    took longer than the preparation): exit code, error output and the output folder."""
    source = tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    output = tmp_path / name
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            code = prepare_data.main(["--input", str(source), "--tokenizer", str(tokenizer), "--output",
                                      str(output), "--workers", "1", *options])
        except SystemExit as exit_:  # argparse's refusals
            code = int(exit_.code or 0)
    return code, errors.getvalue(), output


def test_pairs_are_batched_chosen_then_rejected_with_only_completions_trained(tmp_path):
    code, err, output = _prepare(tmp_path, PAIRS, "--preference")
    assert code == 0, err
    manifest = read_manifest(output)
    assert manifest.version == 3 and manifest.kind == "preference" and manifest.num_documents == 6
    pairs = PreferencePairs(output, 64, "train", 640)
    inputs, targets = pairs.batch(np.array([2, 5]), torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    eos = tokenizer.eos_token
    trained = [tokenizer.decode(row[row != IGNORE_INDEX]) for row in targets]
    assert trained == [f" b, a.{eos}", f" b, a.{eos}", f" a, b!!.{eos}", f" a, b!!!!!.{eos}"]
    # Inputs are each sequence without its last token, right-padded to the longest.
    first = tokenizer.decode(inputs[0][: (targets[0] != IGNORE_INDEX).nonzero().max() + 1])
    assert first == "Q2: reverse a, b.\nA: b, a."  # (this tokenizer's bos is its eos: no bos)
    assert inputs.shape == targets.shape and inputs.shape[0] == 4


def test_identical_and_truncated_pairs_are_left_out_and_counted(tmp_path):
    records = [*PAIRS, {"prompt": "same", "chosen": " x", "rejected": " x"},
               {"prompt": "long " * 40, "chosen": " x", "rejected": " y"}]
    code, err, output = _prepare(tmp_path, records, "--preference", "--max-length", "30")
    assert code == 0, err
    assert "left out 1 pair(s) whose chosen and rejected completions are identical (e.g. " in err
    assert "out.jsonl:7)" in err
    assert ("1 pair(s) with a completion that has no token left after cutting its sequence to "
            "--max-length 30 tokens (e.g. ") in err and "out.jsonl:8)" in err
    assert "kept 6 pair(s)" in err
    assert read_manifest(output).num_documents == 6
    code, err, _ = _prepare(tmp_path, records[-2:], "--preference", "--max-length", "30", name="none")
    assert code == 2 and "no preference pair to train on" in err and "left out 1 pair(s) whose" in err


def test_other_field_names_and_missing_fields(tmp_path):
    renamed = [{"question": p["prompt"], "good": p["chosen"], "bad": p["rejected"]} for p in PAIRS]
    code, err, output = _prepare(tmp_path, renamed, "--prompt-key", "question", "--chosen-key", "good",
                                 "--rejected-key", "bad")
    assert code == 0, err
    assert read_manifest(output).num_documents == 6
    code, err, _ = _prepare(tmp_path, renamed, "--preference", "--prompt-key", "question", name="missing")
    assert code == 2 and "missing.jsonl:1: no field 'chosen' (choose it with --chosen-key)" in err


def test_chat_pairs_are_rendered_with_the_chat_template(tmp_path):
    folder = tmp_path / "chat_tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    records = [{"prompt": [{"role": "user", "content": "Pick one."}],
                "chosen": [{"role": "assistant", "content": "This."}], "rejected": "That."}]
    code, err, output = _prepare(tmp_path, records, "--preference", tokenizer=folder)
    assert code == 0, err
    inputs, targets = PreferencePairs(output, 64, "train", 640).batch(np.array([0]), torch.device("cpu"))
    eos = tokenizer.eos_token
    assert [tokenizer.decode(row[row != IGNORE_INDEX]) for row in targets] == \
        [f"This.{eos}\n{eos}", f"That.{eos}\n{eos}"]
    assert tokenizer.decode(inputs[0]) == f"<|user|>\nPick one.{eos}\n<|assistant|>\nThis.{eos}\n"
    plain = tmp_path / "plain_tokenizer"  # the shipped tokenizer has a chat template: one without
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(plain))
    code, err, _ = _prepare(tmp_path, records, "--preference", name="plain", tokenizer=plain)
    assert code == 2 and "the tokenizer has no chat template" in err


def test_each_objective_refuses_the_other_kinds_of_data():
    assert data_kind_problem("dpo", 3, "train") is None
    assert data_kind_problem("next_token", 3, "train") == (
        "the train channel holds preference data (manifest version 3) and objective=next_token trains "
        "on text or loss-masked data: set objective=dpo, or prepare the data for next_token")
    assert "set objective=next_token" in data_kind_problem("dpo", 2, "validation")
    assert "set objective=grpo" in data_kind_problem("dpo", 4, "train")


def test_a_sequence_longer_than_seq_len_is_refused(tmp_path):
    code, err, output = _prepare(tmp_path, PAIRS, "--preference")
    assert code == 0, err
    with pytest.raises(DataError, match=r"holds a sequence of \d+ tokens .* and seq_len is 4: set seq_len "
                                        r"to at least \d+"):
        PreferencePairs(output, 4, "train", 640)


def test_template_code_from_before_preference_data_refuses_it_by_version(tmp_path):
    """Run the reader of the newest published template version's frozen code on a version-3 dataset."""
    import tarfile

    code, err, output = _prepare(tmp_path, PAIRS, "--preference")
    assert code == 0, err
    lock = json.loads((REPO / "templates" / "catalog.lock").read_text())
    versions = lock["templates"]["llama-finetune-lora"]
    newest = max(versions, key=lambda v: tuple(map(int, v.split("."))))
    archive_sha = versions[newest]["code"].removeprefix("sha256:")
    with tarfile.open(REPO / "templates" / "_code" / f"{archive_sha}.tar.gz") as archive:
        archive.extractall(tmp_path / "old", filter="data")
    probe = ("import pathlib, sys; from training_jobs.trainer.shards import read_manifest; "
             "read_manifest(pathlib.Path(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", probe, str(output)], capture_output=True, text=True,
                            env=child_env(PYTHONPATH=str(tmp_path / "old")), cwd=tmp_path, timeout=60)
    assert result.returncode != 0 and "manifest version 3 is not supported" in result.stderr


@pytest.mark.parametrize("option", [["--dedup", "exact"], ["--filter", "gopher-quality"]])
def test_quality_steps_are_refused_for_preference_pairs(option):
    from training_jobs.prepare_data import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--input", "x.jsonl", "--tokenizer", "t", "--output", "o", "--preference", *option])
