"""Data preparation and the loader: deterministic shards, packing, shuffling, rank sharding and a
resumable position."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training_jobs import prepare_data
from training_jobs.trainer.data import BatchLayout, EvalBatches, ShuffledOrder, TokenSamples, TrainBatches
from training_jobs.trainer.errors import DataError
from training_jobs.trainer.shards import read_manifest

from .conftest import CORPUS, REPO, TOKENIZER, child_env

CPU = torch.device("cpu")


def _prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training_jobs.prepare_data", *args], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=300)


def _prepare_here(capsys, *args: str) -> tuple[int, str]:
    """The same CLI, in this process (no start-up cost), with one worker."""
    code = prepare_data.main([*args, "--workers", "1"])
    return code, capsys.readouterr().err


def test_manifest_counts_documents_tokens_and_dtype(tiny_data):
    train, validation = read_manifest(tiny_data / "train"), read_manifest(tiny_data / "validation")
    documents = len((CORPUS / "train.jsonl").read_text().splitlines())
    assert train.num_documents + validation.num_documents == documents
    assert 0 < validation.num_documents < train.num_documents / 5
    assert train.dtype == "uint16" and train.vocab_size == 629
    assert [s.num_tokens for s in train.shards[:-1]] == [20000] * (len(train.shards) - 1)
    stream = np.concatenate([np.fromfile(s.path, dtype="<u2") for s in train.shards])
    assert len(stream) == train.num_tokens
    assert (stream == train.eos_token_id).sum() == train.num_documents  # one separator per document
    assert stream[-1] == train.eos_token_id


def test_output_does_not_depend_on_the_number_of_workers(tiny_data, tmp_path):
    result = _prepare("--input", str(CORPUS / "train.jsonl"), "--tokenizer", str(TOKENIZER),
                      "--output", str(tmp_path / "one"), "--workers", "1",
                      "--validation-fraction", "0.1", "--shard-tokens", "20000")
    assert result.returncode == 0, result.stderr
    assert "tokenizing" in result.stderr  # the progress bar
    for split in ("train", "validation"):
        for path in sorted((tiny_data / split).iterdir()):
            assert (tmp_path / "one" / split / path.name).read_bytes() == path.read_bytes(), path.name


def test_text_files_folders_and_bad_lines(tmp_path, capsys):
    docs = tmp_path / "docs"
    (docs / "nested").mkdir(parents=True)
    (docs / "a.txt").write_text("The cat sees the red door.")
    (docs / "nested" / "b.md").write_text("A small dog finds a map.")
    common = ["--tokenizer", str(TOKENIZER)]
    assert _prepare_here(capsys, "--input", str(docs), *common, "--output", str(tmp_path / "out"))[0] == 0
    assert read_manifest(tmp_path / "out").num_documents == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    code, err = _prepare_here(capsys, "--input", str(bad), *common, "--output", str(tmp_path / "x"))
    assert code == 2 and f"{bad}:2: no string field 'text'" in err
    code, err = _prepare_here(capsys, "--input", str(docs), *common, "--output", str(tmp_path / "out"))
    assert code == 2 and "already holds a dataset" in err
    code, err = _prepare_here(capsys, "--input", str(tmp_path / "missing"), *common, "--output", "y")
    assert code == 2 and "no such file or folder" in err


def test_input_without_text_is_refused_and_blank_documents_are_left_out(tmp_path, capsys):
    common = ["--tokenizer", str(TOKENIZER)]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = _prepare_here(capsys, "--input", str(empty), *common, "--output", str(tmp_path / "a"))
    # refused before any work
    assert code == 2 and f"no text to train on in {empty}: every input file is empty" in err
    blank_records = tmp_path / "blank.jsonl"
    blank_records.write_text('{"text": ""}\n{"text": "   "}\n')
    code, err = _prepare_here(capsys, "--input", str(blank_records), *common, "--output", str(tmp_path / "b"))
    assert code == 2 and "the input holds 2 empty document(s), e.g. " + f"{blank_records}:1" in err
    assert not (tmp_path / "b" / "manifest.json").exists()
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": ""}\n{"text": "The red door opens."}\n')
    code, err = _prepare_here(capsys, "--input", str(mixed), *common, "--output", str(tmp_path / "c"))
    assert code == 0 and f"left out 1 empty document(s), e.g. {mixed}:1" in err
    assert read_manifest(tmp_path / "c").num_documents == 1


def test_csv_and_tsv_rows_are_documents_and_binary_files_are_refused(tmp_path, capsys):
    common = ["--tokenizer", str(TOKENIZER)]
    table = tmp_path / "reviews.csv"
    table.write_text('id,review\n1,"The cat sees the red door, twice."\n2,\n3,A small dog finds a map.\n')
    (tmp_path / "more.tsv").write_text("review\tlabel\nThe red door opens.\t1\n")
    code, _ = _prepare_here(capsys, "--input", str(table), str(tmp_path / "more.tsv"), *common,
                            "--text-key", "review", "--output", str(tmp_path / "out"))
    assert code == 0 and read_manifest(tmp_path / "out").num_documents == 3  # the empty cell skipped
    code, err = _prepare_here(capsys, "--input", str(table), *common, "--output", str(tmp_path / "x"))
    assert code == 2 and f"{table}: no column 'text' in the header (columns: id, review)" in err
    parquet = tmp_path / "data.parquet"
    parquet.write_bytes(b"PAR1\x15\x04\x15\x00")
    code, err = _prepare_here(capsys, "--input", str(parquet), *common, "--output", str(tmp_path / "y"))
    assert code == 2 and f"{parquet}: a .parquet file is not text; convert it to JSONL" in err
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    code, err = _prepare_here(capsys, "--input", str(latin), *common, "--output", str(tmp_path / "z"))
    assert code == 2 and f"{latin}: not UTF-8 text (byte 3)" in err
    assert not (tmp_path / "y" / "train" / "manifest.json").exists()


def test_samples_are_packed_windows_that_overlap_by_one_token(tiny_data):
    samples = TokenSamples(tiny_data / "train", seq_len=32, channel="train", model_vocab_size=640)
    first_shard = np.fromfile(samples.manifest.shards[0].path, dtype="<u2")
    per_shard = (20000 - 1) // 32
    assert np.array_equal(samples.gather(np.array([0, 1]))[1], first_shard[32:65])
    second_shard = np.fromfile(samples.manifest.shards[1].path, dtype="<u2")
    assert np.array_equal(samples.gather(np.array([per_shard]))[0], second_shard[:33])  # no crossing
    assert samples.num_samples == sum((s.num_tokens - 1) // 32 for s in samples.manifest.shards)


def test_vocabulary_mismatch_is_refused(tiny_data):
    with pytest.raises(DataError, match="larger than the model's 512"):
        TokenSamples(tiny_data / "train", seq_len=32, channel="train", model_vocab_size=512)


def test_data_made_with_another_tokenizer_is_refused_by_its_end_of_sequence_id(tiny_data):
    from types import SimpleNamespace

    from training_jobs.trainer.job import check_tokenizer

    samples = (TokenSamples(tiny_data / "train", seq_len=32, channel="train", model_vocab_size=640),
               TokenSamples(tiny_data / "validation", seq_len=32, channel="validation", model_vocab_size=640))
    check_tokenizer(samples, SimpleNamespace(eos_token_id=0), TOKENIZER)
    with pytest.raises(DataError, match="the train channel was made with a tokenizer whose end-of-sequence "
                                        "id is 0, and the job's tokenizer .* has 2: give the run"):
        check_tokenizer(samples, SimpleNamespace(eos_token_id=2), Path("/opt/ml/input/data/tokenizer"))


def test_order_is_a_fresh_seeded_permutation_per_epoch():
    order = ShuffledOrder(num_samples=10, seed=7)
    epoch0, epoch1 = order[np.arange(10)], order[np.arange(10, 20)]
    assert sorted(epoch0) == list(range(10)) and sorted(epoch1) == list(range(10))
    assert list(epoch0) != list(epoch1)
    assert list(ShuffledOrder(10, seed=7)[np.arange(8, 13)]) == list(np.concatenate([epoch0[8:], epoch1[:3]]))
    assert list(ShuffledOrder(10, seed=8)[np.arange(10)]) != list(epoch0)


def test_each_global_batch_is_split_over_ranks_and_micro_steps_without_overlap():
    seen = []
    for rank in range(4):
        layout = BatchLayout(data_parallel_size=4, data_parallel_rank=rank, micro_batch_size=3,
                             grad_accum_steps=2)
        for micro in range(2):
            seen.extend(layout.positions(first=48, micro_step=micro))
    assert sorted(seen) == list(range(48, 48 + 24))


def _stream(samples, dp, rank, micro, accum, steps, start_state=None):
    batches = TrainBatches(samples, BatchLayout(dp, rank, micro, accum), seed=3, device=CPU)
    if start_state:
        batches.load_state_dict(start_state)
    return batches, [[inputs.clone() for inputs, _ in batches.next_step()] for _ in range(steps)]


def test_global_batch_content_does_not_depend_on_the_split(tiny_data):
    samples = TokenSamples(tiny_data / "train", seq_len=32, channel="train", model_vocab_size=640)
    _, single = _stream(samples, 1, 0, 2, 4, steps=3)
    split = [_stream(samples, 2, rank, 2, 2, steps=3)[1] for rank in range(2)]
    for step in range(3):
        one = torch.cat(single[step])
        two = torch.cat([torch.cat([split[rank][step][micro] for rank in range(2)]) for micro in range(2)])
        assert torch.equal(one, two)


def test_resumed_position_continues_exactly(tiny_data):
    samples = TokenSamples(tiny_data / "train", seq_len=32, channel="train", model_vocab_size=640)
    batches, before = _stream(samples, 2, 1, 2, 2, steps=5)
    _, reference = _stream(samples, 2, 1, 2, 2, steps=9)
    state = json.loads(json.dumps(batches.state_dict()))  # as stored in trainer_state.json
    _, after = _stream(samples, 2, 1, 2, 2, steps=4, start_state=state)
    for expected, got in zip(reference, before + after, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert [inputs.shape for inputs in after[0]] == [torch.Size([2, 32])] * 2


def test_resume_refuses_a_different_dataset_or_seed(tiny_data):
    samples = TokenSamples(tiny_data / "train", seq_len=32, channel="train", model_vocab_size=640)
    batches, _ = _stream(samples, 1, 0, 1, 1, steps=1)
    state = batches.state_dict()
    with pytest.raises(DataError, match="seed=3 and this job has seed=4"):
        TrainBatches(samples, BatchLayout(1, 0, 1, 1), seed=4, device=CPU).load_state_dict(state)


def test_evaluation_batches_are_fixed_and_split_across_ranks(tiny_data):
    samples = TokenSamples(tiny_data / "validation", seq_len=32, channel="validation", model_vocab_size=640)
    ranks = [list(EvalBatches(samples, BatchLayout(2, r, 2, 1), steps=3, device=CPU)) for r in range(2)]
    assert len(ranks[0]) == 3
    whole = list(EvalBatches(samples, BatchLayout(1, 0, 4, 1), steps=3, device=CPU))
    for step in range(3):
        assert torch.equal(torch.cat([ranks[0][step][0], ranks[1][step][0]]), whole[step][0])
    with pytest.raises(DataError, match="fewer than one evaluation batch"):
        EvalBatches(samples, BatchLayout(2, 0, 10_000, 1), steps=1, device=CPU)


def _paragraphs(count: int) -> str:
    return "".join(f"Note {i}: the cat sees the red door.\nThe dog finds map {i}.\n\n" for i in range(count))


def _decoded(folder) -> str:
    from transformers import AutoTokenizer

    manifest = read_manifest(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    ids = np.concatenate([np.fromfile(s.path, dtype="<u2") for s in manifest.shards])
    return tokenizer.decode([int(i) for i in ids if i != manifest.eos_token_id])


def test_a_text_file_holds_out_its_end_for_validation_at_a_paragraph_boundary(tmp_path, capsys):
    """One .txt file is one document, yet `--validation-fraction 0.01` fills a validation split: the
    file's last paragraphs (at most 1% of its text) are held out, the rest trains, nothing is lost."""
    text = _paragraphs(300)
    (tmp_path / "notes.txt").write_text(text)
    code, err = _prepare_here(capsys, "--input", str(tmp_path / "notes.txt"), "--tokenizer", str(TOKENIZER),
                              "--output", str(tmp_path / "tokens"), "--validation-fraction", "0.01")
    assert code == 0, err
    train, validation = _decoded(tmp_path / "tokens" / "train"), _decoded(tmp_path / "tokens" / "validation")
    assert read_manifest(tmp_path / "tokens" / "validation").num_documents == 1
    assert validation.startswith("Note ") and validation.endswith("map 299.\n\n")
    assert 0 < len(validation) <= 0.01 * len(text)
    assert train + validation == text
    # The tokenizer travels with the data: the dataset's tokenizer/ is the run's tokenizer channel.
    assert (tmp_path / "tokens" / "tokenizer" / "tokenizer.json").is_file()


def test_a_text_without_paragraphs_is_held_out_by_lines_then_words_and_a_tiny_one_says_what_helps(
        tmp_path, capsys):
    common = ["--tokenizer", str(TOKENIZER), "--validation-fraction", "0.01"]
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"line {i} of a log without blank lines\n" for i in range(400)))
    assert _prepare_here(capsys, "--input", str(lines), *common, "--output", str(tmp_path / "a"))[0] == 0
    assert _decoded(tmp_path / "a" / "validation").startswith("line 39")
    words = tmp_path / "words.txt"
    words.write_text(" ".join(["word"] * 2000))
    assert _prepare_here(capsys, "--input", str(words), *common, "--output", str(tmp_path / "b"))[0] == 0
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("three short words")
    code, err = _prepare_here(capsys, "--input", str(tiny), *common, "--output", str(tmp_path / "c"))
    assert code == 2
    assert f"{tiny} is too short to hold out 1% of its text" in err
    assert "--validation-fraction 0.3 or more" in err and "leave --validation-fraction out" in err
    assert not (tmp_path / "c").exists()
    code, err = _prepare_here(capsys, "--input", str(tiny), "--tokenizer", str(TOKENIZER),
                              "--validation-fraction", "0.3", "--output", str(tmp_path / "c"))
    assert code == 0, err
    assert _decoded(tmp_path / "c" / "validation") == "words"


def test_a_failed_preparation_leaves_no_folder_behind_and_the_retry_works(tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    records.write_text('{"text": "The red door opens."}\n' * 300 + '{"body": "no text"}\n')
    common = ["--tokenizer", str(TOKENIZER), "--output", str(tmp_path / "tokens"), "--shard-tokens", "100"]
    code, err = _prepare_here(capsys, "--input", str(records), *common)
    assert code == 2 and f"{records}:301: no string field 'text'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records.jsonl"]  # not even a temporary folder
    records.write_text('{"text": "The red door opens."}\n' * 300)
    assert _prepare_here(capsys, "--input", str(records), *common)[0] == 0
    assert read_manifest(tmp_path / "tokens").num_documents == 300
    code, err = _prepare_here(capsys, "--input", str(records), *common)
    assert code == 2 and "already holds a dataset" in err


def test_too_few_records_for_the_validation_split_says_what_helps(tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    records.write_text('{"text": "The red door opens."}\n' * 20)
    code, err = _prepare_here(capsys, "--input", str(records), "--tokenizer", str(TOKENIZER),
                              "--output", str(tmp_path / "o"), "--validation-fraction", "0.01")
    assert code == 2
    assert "none of the input's 20 documents was drawn for the validation split" in err
    assert "--validation-fraction 0.1 or more" in err and "leave --validation-fraction out" in err
    assert not (tmp_path / "o").exists()
