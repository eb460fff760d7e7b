"""Token shards checked before a job starts (llmtrain.core.token_data): `llmtrain run --local` refuses
data the training program would fail on, naming the fix, and starts nothing; a bare `--data DIR` of a
prepared dataset gives its splits and tokenizer as the channels. The manifest format the checks read
is the program's (kept equal here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmtrain.cli import main
from llmtrain.core.catalog import Catalog
from llmtrain.core.sourcedir import repository_root
from llmtrain.core.token_data import (
    FORMAT,
    MANIFEST,
    SHIPPED_TOKENIZER,
    TOKENIZER_FOLDER,
    RunShape,
    TokenDataError,
    TokenizerFacts,
    data_problems,
    parse_manifest,
    tokenizer_facts,
)
from llmtrain.local.data import parse_data_option
from training_jobs import prepare_data
from training_jobs.trainer import models, shards

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "training_jobs" / "assets" / "tokenizer"
TEXT = "".join(f"Note {i}: the cat sees the red door. The dog finds map {i}.\n\n" for i in range(400))


def test_the_shipped_tokenizer_is_where_the_program_finds_it():
    assert repository_root() / SHIPPED_TOKENIZER == models.SHIPPED_TOKENIZER


def _prepared(folder: Path, *options: str, tokenizer: Path = TOKENIZER, text: str = TEXT) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text(text)
    assert prepare_data.main(["--input", str(folder / "notes.txt"), "--tokenizer", str(tokenizer),
                              "--output", str(folder / "tokens"), "--workers", "1", *options]) == 0
    return folder / "tokens"


def test_the_checks_read_what_prepare_data_wrote(tmp_path):
    tokens = _prepared(tmp_path, "--validation-fraction", "0.1")
    train = parse_manifest((tokens / "train" / MANIFEST).read_bytes(), "train/")
    assert (train.vocab_size, train.eos_token_id, train.loss_mask) == (629, 0, False)
    assert train.num_tokens == shards.read_manifest(tokens / "train").num_tokens
    assert tokenizer_facts(tokens / TOKENIZER_FOLDER) == TokenizerFacts(
        f"the tokenizer in {tokens / TOKENIZER_FOLDER}", 629, 0)
    with pytest.raises(TokenDataError, match="not a manifest of token shards"):
        parse_manifest(b"{}", "s3://b/teams/t/notes/")


def test_a_prepared_datasets_folder_gives_its_splits_and_tokenizer_as_channels(tmp_path):
    tokens = _prepared(tmp_path / "a", "--validation-fraction", "0.1")
    data = parse_data_option([str(tokens)])
    assert data.channels == {"train": tokens / "train", "validation": tokens / "validation",
                             "tokenizer": tokens / "tokenizer"}
    assert data.optional == {"validation", "tokenizer"}  # left out by a template without them
    other = tmp_path / "b"
    other.mkdir()
    data = parse_data_option([str(tokens), f"validation={other}"])
    assert data.channels["validation"] == other and data.optional == {"tokenizer"}
    unsplit = _prepared(tmp_path / "c")
    assert parse_data_option([str(unsplit)]).channels == {"train": unsplit,
                                                          "tokenizer": unsplit / "tokenizer"}


def _refused(capsys, workdir: Path, *options: str) -> str:
    code = main(["run", "--local", "llama-pretrain-fsdp", "--run-name", "r1", "--workdir", str(workdir),
                 "--set", "instance_count=1", *options])
    captured = capsys.readouterr()
    assert code == 2, captured.out[-2000:]
    assert not (workdir / "r1" / "jobs").exists()  # refused before any job folder was made
    return captured.err


def test_a_datasets_top_folder_as_the_train_channel_is_refused_naming_its_splits(tmp_path, capsys):
    tokens = _prepared(tmp_path, "--validation-fraction", "0.1")
    err = _refused(capsys, tmp_path / "runs", "--data", f"train={tokens}")
    assert "the job would fail on its data, so nothing was started" in err
    assert f"channel train: {tokens}/ holds no manifest.json but the split folder(s) train/, " \
        "validation/" in err
    assert f"train -> {tokens}/train/" in err and "a bare --data DIR takes them all" in err


def test_a_validation_split_smaller_than_one_evaluation_step_is_refused(tmp_path, capsys):
    tokens = _prepared(tmp_path, "--validation-fraction", "0.01")
    err = _refused(capsys, tmp_path / "runs", "--data", str(tokens), "--set", "micro_batch_size=4")
    assert "channel validation (" in err and "one evaluation step takes 8 (data-parallel ranks x " \
        "micro_batch_size)" in err
    assert "--validation-fraction" in err


def test_data_made_with_another_tokenizer_than_the_jobs_is_refused(tmp_path, capsys):
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(tokenizer_models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.train_from_iterator([TEXT] * 3, trainers.BpeTrainer(vocab_size=120,
                                                              special_tokens=["<unk>", "</s>"]))
    own = tmp_path / "own-tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(str(own))
    tokens = _prepared(tmp_path, tokenizer=own)
    err = _refused(capsys, tmp_path / "runs", "--data", f"train={tokens}")
    assert f"channel train ({tokens}/) was made with a tokenizer of 120 tokens (end-of-sequence id 1), " \
        "but the job reads it with the tokenizer in" in err
    assert "629 tokens (end-of-sequence id 0): give the run the tokenizer the data was made with" in err
    # With the dataset's own tokenizer folder (what a bare --data DIR adds) the check passes on to the
    # next one: here the corrupted shard.
    shard = tokens / json.loads((tokens / "manifest.json").read_text())["shards"][0]["path"]
    shard.write_bytes(shard.read_bytes()[:-2])
    err = _refused(capsys, tmp_path / "runs", "--data", str(tokens))
    assert f"{shard} has" in err and "truncated" in err
    assert "tokenizer" not in err.split("truncated")[0]


def test_a_channel_without_a_manifest_and_a_masked_train_with_unmasked_validation(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _refused(capsys, tmp_path / "runs", "--data", str(empty))
    assert f"channel train: no manifest.json in {empty}: prepare it with `llmtrain data prepare" in err
    shape = RunShape(seq_len=8, eval_batch=1)
    masked = parse_manifest(json.dumps({
        "format": FORMAT, "version": 2, "dtype": "uint16", "vocab_size": 629, "eos_token_id": 0,
        "shards": [{"path": "s.bin", "num_tokens": 100, "mask": "s.mask"}]}).encode(), "a/")
    plain = parse_manifest(json.dumps({
        "format": FORMAT, "version": 1, "dtype": "uint16", "vocab_size": 629, "eos_token_id": 0,
        "shards": [{"path": "s.bin", "num_tokens": 100}]}).encode(), "b/")
    assert masked.file_sizes() == {"s.bin": 200, "s.mask": 100}
    (problem,) = data_problems({"train": masked, "validation": plain}, shape, None)
    assert problem.startswith("only the train channel is loss-masked")



# -- issue 36: the format version against the version's code, the masks, vocab_size --------------------

QA = "".join(json.dumps({"prompt": f"Question {i}: what does the cat see?", "answer": f"The red door {i}."})
             + "\n" for i in range(300))


def _masked(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "qa.jsonl").write_text(QA)
    assert prepare_data.main(["--input", str(folder / "qa.jsonl"), "--tokenizer", str(TOKENIZER),
                              "--output", str(folder / "tokens"), "--workers", "1", "--prompt-key", "prompt",
                              "--completion-key", "answer"]) == 0
    return folder / "tokens"


def _edit_manifest(folder: Path, **fields) -> None:
    body = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**body, **fields}))


def test_a_loss_masked_dataset_for_a_version_whose_code_reads_only_version_1_is_refused(tmp_path, capsys):
    tokens = _masked(tmp_path / "qa")
    assert json.loads((tokens / MANIFEST).read_text())["answer_tokens"] > 0  # recorded by prepare_data
    code = main(["run", "--local", "llama-pretrain-fsdp@1.0.0", "--run-name", "r1", "--workdir",
                 str(tmp_path / "runs"), "--set", "instance_count=1", "--data", str(tokens)])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "runs" / "r1" / "jobs").exists()
    assert f"channel train ({tokens}/) is a loss-masked dataset of manifest version 2, but the code this " \
        "template version runs reads manifest version 1 only" in err
    assert "run a newer version of the template" in err
    # `llmtrain start` checks with the same rule, the versions read from the version's contract.
    catalog = Catalog.load()
    assert catalog.program_contract(catalog.get("llama-pretrain-fsdp", "1.0.0")).manifest_versions == (1,)
    assert catalog.program_contract(catalog.get("llama-pretrain-fsdp", "1.1.0")).manifest_versions == (1, 2)
    manifest = parse_manifest((tokens / MANIFEST).read_bytes(), "s3://b/teams/t/qa/")
    assert data_problems({"train": manifest}, RunShape(seq_len=8, eval_batch=1), None, (1, 2)) == []
    (problem,) = data_problems({"train": manifest}, RunShape(seq_len=8, eval_batch=1), None, (1,))
    assert "manifest version 2" in problem


def test_masks_that_train_no_answer_token_are_refused_before_the_job(tmp_path, capsys):
    tokens = _masked(tmp_path / "qa")
    for mask in tokens.glob("*.mask"):
        mask.write_bytes(bytes(mask.stat().st_size))  # nothing trained
    err = _refused(capsys, tmp_path / "runs", "--data", str(tokens))
    assert f"the train channel ({tokens}) trains no answer token" in err and "--completion-key" in err
    # In S3 the masks are not read: the manifest's answer_tokens (prepare_data's count) is.
    manifest = parse_manifest(json.dumps({**json.loads((tokens / MANIFEST).read_text()),
                                          "answer_tokens": 0}).encode(), "s3://b/teams/t/qa/")
    (problem,) = data_problems({"train": manifest}, RunShape(seq_len=8, eval_batch=1), None)
    assert "channel train (s3://b/teams/t/qa/) trains no answer token (its manifest records " \
        "answer_tokens 0)" in problem


@pytest.mark.parametrize("vocab_size", [-1, 0])
def test_a_vocab_size_without_room_for_its_end_of_sequence_id_is_refused(tmp_path, vocab_size):
    body = {"format": FORMAT, "version": 1, "dtype": "uint16", "vocab_size": vocab_size, "eos_token_id": 0,
            "shards": [{"path": "s.bin", "num_tokens": 100}]}
    with pytest.raises(TokenDataError, match=f"says vocab_size {vocab_size} and eos_token_id 0: a "
                                             "vocabulary holds at least one token"):
        parse_manifest(json.dumps(body).encode(), "a/")


def test_a_vocab_size_its_shards_contradict_is_refused_before_the_job(tmp_path, capsys):
    tokens = _prepared(tmp_path)
    _edit_manifest(tokens, vocab_size=100)
    err = _refused(capsys, tmp_path / "runs", "--data", f"train={tokens}", "--data",
                   f"tokenizer={tokens / TOKENIZER_FOLDER}")
    assert re.search(f"the train channel: {re.escape(str(tokens))}/manifest.json says vocab_size 100, "
                     r"but its shards hold token id \d{3} outside that vocabulary", err)
