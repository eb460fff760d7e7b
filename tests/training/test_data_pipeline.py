"""prepare_data's pipeline (training_jobs/data_pipeline): work units over N workers give one dataset,
an interrupted preparation resumes with only the missing units, and datatrove's deduplication and
filters remove what they should across units."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from training_jobs import prepare_data
from training_jobs.data_pipeline.plan import InputFile, lines_in_range, make_plan
from training_jobs.data_pipeline.quality import FILTER_NAMES, Judge, QualitySettings
from training_jobs.sft_examples import document_separators
from training_jobs.trainer.shards import read_manifest

from .conftest import REPO, TOKENIZER, child_env

WORDS = ("the and of to that with have be river stone garden window morning letter bridge music "
         "quiet bright small green open old long road house light water paper table story night "
         "walks finds keeps builds reads writes carries opens follows remembers across under over "
         "near beside slowly often never always almost gently").split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _document(rng: random.Random, words: int = 200) -> str:
    return " ".join(_sentence(rng, 10) for _ in range(words // 10))


def _prepare(*args: str) -> int:
    return prepare_data.main(list(args))


def _stream(folder: Path) -> tuple[list[tuple[int, ...]], list[bytes]]:
    """The documents of a split, in order, as token id tuples (split at end-of-sequence ids), and
    the bytes of its files."""
    manifest = read_manifest(folder)
    ids = np.concatenate([np.fromfile(s.path, dtype=manifest.numpy_dtype) for s in manifest.shards])
    documents, start = [], 0
    for end in np.flatnonzero(ids == manifest.eos_token_id):
        documents.append(tuple(int(i) for i in ids[start:end + 1]))
        start = end + 1
    files = [s.path.read_bytes() for s in manifest.shards]
    files += [s.mask_path.read_bytes() for s in manifest.shards if s.mask_path]
    return documents, files


def _reference(texts: list[str]) -> list[tuple[int, ...]]:
    """Each document tokenized on its own, with its separators: what the dataset must hold."""
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    prefix, eos = document_separators(tokenizer)
    return [tuple(prefix + tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]) for text in texts]


def test_the_plan_groups_small_files_and_cuts_large_jsonl_into_ranges_that_hold_each_line_once(tmp_path):
    files = (InputFile("a.txt", 300), InputFile("b.txt", 500), InputFile("big.jsonl", 2500),
             InputFile("c.csv", 1500), InputFile("d.md", 100))
    plan = make_plan(files, {}, unit_bytes=1000)
    assert [[(p.file, p.start, p.end) for p in u.pieces] for u in plan.units] == [
        [(0, 0, None), (1, 0, None)], [(2, 0, 1000)], [(2, 1000, 2000)], [(2, 2000, None)],
        [(3, 0, None)], [(4, 0, None)]]  # a large CSV stays whole: its rows may span lines
    assert make_plan(files, {}, unit_bytes=1000) == plan and plan.fingerprint != make_plan(
        files, {"validation_fraction": 0.1}, unit_bytes=1000).fingerprint
    rng = random.Random(1)
    lines = [("x" * rng.randint(0, 40) + "\n").encode() for _ in range(200)]
    (tmp_path / "lines").write_bytes(b"".join(lines))
    size = len(b"".join(lines))
    for cut in (1, 7, 41, 42, 500, size):
        with (tmp_path / "lines").open("rb") as handle:
            read = [line for start in range(0, size, cut)
                    for _, line in lines_in_range(handle, start, start + cut if start + cut < size else None)]
        assert read == lines, cut


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[Path], list[str]]:
    """Text files and two JSONL files, one large enough to be cut into several byte ranges."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(7)
    files, texts = [], []
    for index in range(3):
        path = folder / f"note{index}.txt"
        text = "\n\n".join(_sentence(rng, 12) for _ in range(5))
        path.write_text(text)
        files.append(path)
        texts.append(text)
    for name, count in (("big.jsonl", 240), ("small.jsonl", 7)):
        records = [_sentence(rng, rng.randint(3, 30)) for _ in range(count)]
        (folder / name).write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
        files.append(folder / name)
        texts += records
    return files, texts


def test_one_two_and_four_workers_write_the_same_dataset_document_for_document(corpus, tmp_path):
    files, texts = corpus
    datasets = {}
    for workers in (1, 2, 4):
        output = tmp_path / f"w{workers}"
        assert _prepare("--input", *map(str, files), "--tokenizer", str(TOKENIZER), "--output", str(output),
                        "--workers", str(workers), "--unit-bytes", "2000", "--shard-tokens", "700") == 0
        datasets[workers] = _stream(output)
    report = json.loads((tmp_path / "w1" / "preparation.json").read_text())
    assert report["units"] >= 6  # the large JSONL file was cut into ranges: real work for 4 workers
    assert datasets[1][0] == _reference(texts)  # every record once, in input order, across the cuts
    assert datasets[2] == datasets[1] and datasets[4] == datasets[1]  # and the same files, byte for byte
    assert not list(tmp_path.glob(".*.partial"))


def test_the_validation_split_does_not_depend_on_the_workers(corpus, tmp_path):
    files, texts = corpus
    streams = []
    for workers in (1, 2):
        output = tmp_path / f"w{workers}"
        assert _prepare("--input", *map(str, files), "--tokenizer", str(TOKENIZER), "--output", str(output),
                        "--workers", str(workers), "--unit-bytes", "2000",
                        "--validation-fraction", "0.2") == 0
        streams.append({split: _stream(output / split) for split in ("train", "validation")})
    assert streams[0] == streams[1]
    train, validation = (streams[0][s][0] for s in ("train", "validation"))
    reference = _reference(texts)
    # The text files give their ends to validation; every JSONL record goes to exactly one split.
    assert set(reference[3:]) <= set(train) | set(validation) and 20 < len(validation) < 120


def test_conversations_are_the_same_with_any_number_of_workers(tmp_path):
    rng = random.Random(3)
    records = [{"messages": [{"role": "user", "content": _sentence(rng, 6)},
                             {"role": "assistant", "content": _sentence(rng, rng.randint(2, 12))}]}
               for _ in range(80)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    datasets = []
    for workers in (1, 2, 4):
        output = tmp_path / f"w{workers}"
        assert _prepare("--input", str(tmp_path / "chats.jsonl"), "--tokenizer", str(TOKENIZER),
                        "--output", str(output), "--messages-key", "messages", "--workers", str(workers),
                        "--unit-bytes", "1500") == 0
        datasets.append(_stream(output))
    manifest = read_manifest(tmp_path / "w1")
    assert manifest.loss_mask and manifest.num_documents == 80
    assert json.loads((tmp_path / "w1" / "preparation.json").read_text())["units"] >= 4
    assert datasets[1] == datasets[0] and datasets[2] == datasets[0]  # tokens and masks alike


def test_manifest_lists_each_shard_with_its_checksum(corpus, tmp_path):
    import hashlib

    files, _ = corpus
    output = tmp_path / "out"
    assert _prepare("--input", *map(str, files), "--tokenizer", str(TOKENIZER), "--output", str(output),
                    "--workers", "1", "--unit-bytes", "4000") == 0
    body = json.loads((output / "manifest.json").read_text())
    for entry in body["shards"]:
        assert hashlib.sha256((output / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
    assert sorted(p.name for p in output.iterdir() if not p.name.startswith("shard_")) == [
        "manifest.json", "preparation.json", "tokenizer"]  # no work files left in the dataset


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_killed_worker_is_redone_alone_when_the_command_is_run_again(tmp_path):
    rng = random.Random(11)
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"text": _document(rng, 60)}) + "\n" for _ in range(600)))
    output = tmp_path / "out"
    command = [sys.executable, "-m", "training_jobs.prepare_data", "--input", str(tmp_path / "data.jsonl"),
               "--tokenizer", str(TOKENIZER), "--output", str(output), "--workers", "2",
               "--unit-bytes", "4000"]
    work = tmp_path / ".out.partial"
    process = subprocess.Popen(command, cwd=REPO, env=child_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((work / "units").glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    # The workers are forked by multiprocessing's fork server, a child of the command.
    helpers = _children(process.pid)
    workers = [pid for helper in helpers for pid in _children(helper)]
    assert len(workers) == 2
    everyone = [process.pid, *helpers, *workers]
    for pid in everyone:
        os.kill(pid, signal.SIGSTOP)  # hold everything still while a worker is killed
    os.kill(workers[-1], signal.SIGKILL)
    for pid in everyone:
        if pid != workers[-1]:
            os.kill(pid, signal.SIGCONT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2 and "a worker process died" in err and "run the same command again" in err
    assert not output.exists()
    done = sorted(work.glob("units/*.json"))
    units = len(json.loads((work / "plan.json").read_text())["units"])
    assert 0 < len(done) < units
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in work.glob("shard_*.bin")}

    rerun = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(done)} of {units} work units already complete" in rerun.stderr
    for name, (inode, mtime) in before.items():
        unit = name.split("_")[1]
        if (f"{unit}.json") in {p.name for p in done}:  # a complete unit's shards were not rewritten
            assert ((output / name).stat().st_ino, (output / name).stat().st_mtime_ns) == (inode, mtime)
    whole = tmp_path / "whole"
    assert _prepare("--input", str(tmp_path / "data.jsonl"), "--tokenizer", str(TOKENIZER), "--output",
                    str(whole), "--workers", "1", "--unit-bytes", "4000") == 0
    assert _stream(output) == _stream(whole)


# -- quality steps ---------------------------------------------------------------------------------


def _changed_word(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    at = rng.randrange(10, len(words) - 10)
    words[at] = "zebra" if words[at] != "zebra" else "lantern"
    return " ".join(words)


@pytest.fixture(scope="module")
def duplicated(tmp_path_factory) -> dict:
    """50 distinct documents; exact copies of 5 of them (one copied twice) and a one-word variant
    of 4 others, each far from its original (another file, another work unit)."""
    folder = tmp_path_factory.mktemp("dups")
    rng = random.Random(2024)
    uniques = [_document(rng) for _ in range(50)]
    copies = [uniques[i] for i in (2, 9, 17, 25, 20, 9)]
    variants = {i: _changed_word(rng, uniques[i]) for i in (5, 14, 22, 27)}
    # Originals in order; each copy or variant lands at least 12 documents after its original.
    records = list(uniques)
    for text in [*copies, *variants.values()]:
        source = text if text in uniques else uniques[next(i for i, v in variants.items() if v == text)]
        records.insert(rng.randrange(records.index(source) + 12, len(records) + 1), text)
    files = []
    for index, part in enumerate((records[:20], records[20:40], records[40:])):
        path = folder / f"part{index}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        files.append(path)
    return {"files": files, "uniques": uniques, "copies": copies, "variants": variants,
            "records": records}


def _deduplicated(tmp_path: Path, files: list[Path], name: str, *options: str) -> tuple[list, dict]:
    output = tmp_path / name
    assert _prepare("--input", *map(str, files), "--tokenizer", str(TOKENIZER), "--output", str(output),
                    "--unit-bytes", "6000", *options) == 0
    report = json.loads((output / "preparation.json").read_text())
    return _stream(output)[0], report


def _removed(report: dict, step: str) -> tuple[int, int]:
    entry = next(s for s in report["steps"] if s["step"] == step)
    return entry["removed_documents"], entry["removed_tokens"]


def test_exact_deduplication_removes_exactly_the_copies_across_units(duplicated, tmp_path, capsys):
    kept, report = _deduplicated(tmp_path, duplicated["files"], "exact", "--dedup", "exact",
                                 "--workers", "2")
    assert report["units"] >= 6
    expected = _reference(duplicated["uniques"] + list(duplicated["variants"].values()))
    assert sorted(kept) == sorted(expected)  # every distinct text once; the variants are not copies
    copies = _reference(duplicated["copies"])
    assert _removed(report, "dedup-exact") == (len(copies), sum(map(len, copies)))
    assert f"dedup-exact removed {len(copies)} document(s) ({sum(map(len, copies))} tokens)" \
        in capsys.readouterr().err


def test_minhash_deduplication_removes_copies_and_near_copies_the_same_with_any_workers(duplicated, tmp_path):
    kept, report = _deduplicated(tmp_path, duplicated["files"], "one", "--dedup", "minhash", "--workers", "1")
    kept_two, _ = _deduplicated(tmp_path, duplicated["files"], "two", "--dedup", "minhash", "--workers", "2")
    assert kept_two == kept
    uniques = _reference(duplicated["uniques"])
    variants = dict(zip(duplicated["variants"], _reference(list(duplicated["variants"].values())),
                        strict=True))
    assert len(kept) == len(uniques) and len(set(kept)) == len(kept)
    for index, original in enumerate(uniques):  # each group keeps one member: the original or its variant
        assert (original in kept) != (variants.get(index) in kept) if index in variants else original in kept
    everything = _reference(duplicated["records"])
    assert _removed(report, "dedup-minhash") == (len(everything) - len(kept),
                                                 sum(map(len, everything)) - sum(map(len, kept)))


def test_a_quality_filter_removes_what_it_fails_before_deduplication(tmp_path, capsys):
    rng = random.Random(5)
    long_documents = [_document(rng) for _ in range(12)]
    short = [_sentence(rng, 8) for _ in range(4)]  # Gopher: fewer than 50 words
    texts = long_documents[:6] + short[:2] + long_documents[6:] + short[2:] + [long_documents[0], short[0]]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    kept, report = _deduplicated(tmp_path, [tmp_path / "mixed.jsonl"], "out", "--filter", "gopher-quality",
                                 "--dedup", "exact", "--workers", "1")
    assert kept == _reference(long_documents)
    removed_short = _reference(short + [short[0]])
    assert _removed(report, "gopher-quality") == (5, sum(map(len, removed_short)))
    assert _removed(report, "dedup-exact") == (1, len(_reference([long_documents[0]])[0]))
    err = capsys.readouterr().err
    assert "gopher-quality removed 5 document(s)" in err and "dedup-exact removed 1 document(s)" in err


@pytest.mark.parametrize("name", FILTER_NAMES)
def test_each_filter_keeps_prose_and_fails_a_page_of_one_repeated_line(name, tmp_path):
    rng = random.Random(5)
    prose = "\n".join(" ".join(_sentence(rng, 12) for _ in range(3)) for _ in range(8))
    judge = Judge(QualitySettings((name,)), tmp_path, 0)
    assert judge.failed_filter(prose) is None
    assert judge.failed_filter("\n".join(["buy now"] * 30)) == name


# -- errors before any work ------------------------------------------------------------------------


def _refused(capsys, tmp_path: Path, *args: str) -> str:
    code = _prepare(*args, "--workers", "2")
    err = capsys.readouterr().err
    assert code == 2, err
    assert not list(tmp_path.glob(".*.partial"))  # refused before any work folder exists
    return err


def test_bad_input_tokenizer_and_output_are_named_before_any_work(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "The red door opens."}\n')
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    common = ["--tokenizer", str(TOKENIZER), "--output", str(tmp_path / "out")]
    err = _refused(capsys, tmp_path, "--input", str(good), str(latin), *common)
    assert f"{latin}: not UTF-8 text (byte 28)" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"no text to train on in {empty}: every input file is empty" in _refused(
        capsys, tmp_path, "--input", str(empty), *common)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    err = _refused(capsys, tmp_path, "--input", str(good), "--tokenizer", str(tmp_path / "broken"),
                   "--output", str(tmp_path / "out"))
    assert f"--tokenizer {tmp_path / 'broken'}: not a tokenizer folder transformers can load" in err
    err = _refused(capsys, tmp_path, "--input", str(good), "--tokenizer", str(tmp_path / "nowhere"),
                   "--output", str(tmp_path / "out"))
    assert f"--tokenizer {tmp_path / 'nowhere'}: no such folder" in err
    assert _prepare("--input", str(good), *common, "--workers", "4") == 0
    assert "1 work unit(s), so 1 worker(s) instead of --workers 4" in capsys.readouterr().err
    assert "already holds a dataset" in _refused(capsys, tmp_path, "--input", str(good), *common)


def test_a_work_folder_of_other_inputs_is_not_resumed(tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    records.write_text('{"text": "The red door opens."}\n' * 30)
    stale = tmp_path / ".out.partial"
    stale.mkdir()
    (stale / "plan.json").write_text('{"files": [], "units": [], "settings": {}}')
    (stale / "shard_00000_00000.bin").write_bytes(b"\0" * 8)
    assert _prepare("--input", str(records), "--tokenizer", str(TOKENIZER), "--output", str(tmp_path / "out"),
                    "--workers", "1") == 0
    assert "holds an interrupted preparation of other inputs or options; starting anew" in \
        capsys.readouterr().err
    assert read_manifest(tmp_path / "out").num_documents == 30 and not stale.exists()
