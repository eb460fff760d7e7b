"""prepare_data as the instances of a distributed job (data_pipeline/instances.py), laid out as
SageMaker Processing lays them out: each instance its own resource config and output folder, the
outputs uploaded to one prefix (here a folder standing for it), then the merge step. The dataset
equals the local single-process one whatever the number of instances, with or without deduplication
across the instances, a rerun redoes only the units whose shards are missing, and the prefix holds no
dataset manifest before the merge."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from seeded_duplicates import SeededDuplicates, write_seeded_duplicates

from training_jobs import prepare_data
from training_jobs.contract.token_data import SPLITS
from training_jobs.data_pipeline.instances import SIZES_FILE
from training_jobs.trainer.shards import read_manifest

from .conftest import TOKENIZER
from .test_data_pipeline import _reference, _removed, _sentence, _stream

STATE = ".preparation"
OPTIONS = ("--unit-bytes", "1500", "--shard-tokens", "500", "--validation-fraction", "0.2", "--workers", "1")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[Path]:
    """Text files, a JSONL file large enough for several byte ranges, and a small one."""
    folder = tmp_path_factory.mktemp("inputs")
    rng = random.Random(5)
    for index in range(3):
        (folder / f"note{index}.txt").write_text("\n\n".join(_sentence(rng, 12) for _ in range(5)))
    for name, count in (("big.jsonl", 200), ("small.jsonl", 9)):
        records = [_sentence(rng, rng.randint(3, 30)) for _ in range(count)]
        (folder / name).write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    return [folder]


@pytest.fixture(scope="module")
def local_dataset(inputs, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("local") / "dataset"
    assert prepare_data.main(["--input", *map(str, inputs), "--tokenizer", str(TOKENIZER),
                              "--output", str(output), *OPTIONS]) == 0
    return output


def _resource_config(folder: Path, index: int, count: int) -> Path:
    path = folder / f"resourceconfig-{index}.json"
    hosts = [f"algo-{i + 1}" for i in range(count)]
    path.write_text(json.dumps({"current_host": hosts[index], "hosts": hosts}))
    return path


def _instance(inputs: list[Path], tmp: Path, index: int, count: int, *extra: str) -> Path:
    """One instance's run; returns its folder: `dataset` and `state`, SageMaker's two outputs."""
    folder = tmp / f"attempt-{len(list(tmp.glob('attempt-*')))}-algo-{index + 1}"
    assert prepare_data.main(["--input", *map(str, inputs), "--tokenizer", str(TOKENIZER),
                              "--output", str(folder / "dataset"), "--state", str(folder / "state"),
                              "--host-config", str(_resource_config(tmp, index, count)), *OPTIONS,
                              *extra]) == 0
    return folder


def _upload(instance: Path, prefix: Path) -> None:
    """SageMaker's uploads of the instance's outputs: the dataset's files and, beside them, its state."""
    shutil.copytree(instance / "dataset", prefix, dirs_exist_ok=True)
    shutil.copytree(instance / "state", prefix / STATE, dirs_exist_ok=True)


def _listing(prefix: Path, folder: Path) -> Path:
    """What the launcher gives a rerun or the merge: the state (plan.json, units/) and the sizes of
    the dataset's objects (not the shards themselves)."""
    shutil.copytree(prefix / STATE, folder)
    sizes = {p.relative_to(prefix).as_posix(): p.stat().st_size for p in prefix.rglob("*")
             if p.is_file() and STATE not in p.relative_to(prefix).parts}
    (folder / SIZES_FILE).write_text(json.dumps(sizes))
    return folder


def _merge(written: Path, prefix: Path, tmp: Path, *extra: str) -> int:
    output = tmp / f"merge-{len(list(tmp.glob('merge-*')))}"
    status = prepare_data.main(["--input", str(written), "--tokenizer", str(TOKENIZER),
                                "--output", str(output), "--merge-only", *extra])
    if status == 0:
        shutil.copytree(output, prefix, dirs_exist_ok=True)
    return status


def _splits(folder: Path) -> dict:
    return {split: _stream(folder / split) for split in ("train", "validation")}


@pytest.mark.parametrize("count", [1, 2, 3])
def test_any_number_of_instances_make_the_local_dataset_document_for_document(inputs, local_dataset, count,
                                                                                tmp_path):
    prefix = tmp_path / "s3" / "dataset"
    for index in range(count):
        _upload(_instance(inputs, tmp_path, index, count), prefix)
    assert not list(prefix.rglob("manifest.json"))  # no dataset until the merge
    assert _merge(_listing(prefix, tmp_path / "listing"), prefix, tmp_path) == 0
    assert _splits(prefix) == _splits(local_dataset)  # tokens and shard bytes alike
    report, local_report = (json.loads((f / "preparation.json").read_text()) for f in (prefix, local_dataset))
    assert report["units"] == local_report["units"] >= 4 and report["splits"] == local_report["splits"]
    assert (prefix / "tokenizer" / "tokenizer.json").is_file()


def test_a_rerun_redoes_only_the_units_whose_shards_are_missing(inputs, local_dataset, tmp_path, capsys):
    prefix = tmp_path / "s3" / "dataset"
    first = _instance(inputs, tmp_path, 0, 2)  # instance 2 of 2 was lost: none of its units is there
    _upload(first, prefix)
    units = sorted(p.name for p in (prefix / STATE / "units").iterdir())
    assert units and all(int(name[:5]) % 2 == 0 for name in units)
    capsys.readouterr()
    assert _merge(_listing(prefix, tmp_path / "listing-0"), prefix, tmp_path) == 2
    assert "work units are not complete" in capsys.readouterr().err
    assert not list(prefix.rglob("manifest.json"))
    lost = sorted((prefix / "train").glob("shard_00002_*"))[0]
    lost.unlink()  # one shard of a complete unit never reached the prefix
    previous = _listing(prefix, tmp_path / "listing-1")
    reruns = [_instance(inputs, tmp_path, index, 2, "--previous", str(previous)) for index in range(2)]
    redone = sorted(p.name for p in (reruns[0] / "state" / "units").iterdir())
    assert redone == ["00002.json"]  # instance 1 redoes the unit that lost a shard, and no other
    total = len(json.loads((prefix / STATE / "plan.json").read_text())["units"])
    odd_units = [f"{unit:05d}.json" for unit in range(1, total, 2)]
    assert sorted(p.name for p in (reruns[1] / "state" / "units").iterdir()) == odd_units  # all of the lost
    for rerun in reruns:
        _upload(rerun, prefix)
    assert _merge(_listing(prefix, tmp_path / "listing-2"), prefix, tmp_path) == 0
    assert _splits(prefix) == _splits(local_dataset)


def test_a_rerun_with_other_inputs_or_options_is_refused(inputs, tmp_path, capsys):
    prefix = tmp_path / "s3" / "dataset"
    _upload(_instance(inputs, tmp_path, 0, 1), prefix)
    previous = _listing(prefix, tmp_path / "listing")
    config = _resource_config(tmp_path, 0, 1)
    status = prepare_data.main(["--input", *map(str, inputs), "--tokenizer", str(TOKENIZER), "--output",
                                str(tmp_path / "again"), "--host-config", str(config),
                                "--previous", str(previous), *OPTIONS, "--shard-tokens", "900"])
    assert status == 2 and "holds the work units of another plan" in capsys.readouterr().err


def test_the_merge_refuses_a_prefix_that_already_holds_a_dataset(inputs, local_dataset, tmp_path, capsys):
    prefix = tmp_path / "s3" / "dataset"  # one instance, its state beside its shards (no --state)
    assert prepare_data.main(["--input", *map(str, inputs), "--tokenizer", str(TOKENIZER), "--output",
                              str(prefix), "--host-config", str(_resource_config(tmp_path, 0, 1)),
                              *OPTIONS]) == 0
    assert prepare_data.main(["--input", str(prefix), "--tokenizer", str(TOKENIZER), "--output", str(prefix),
                              "--merge-only"]) == 0
    assert prepare_data.main(["--input", str(prefix), "--tokenizer", str(TOKENIZER), "--output", str(prefix),
                              "--merge-only"]) == 2
    assert "already holds a dataset" in capsys.readouterr().err
    assert _splits(prefix) == _splits(local_dataset)  # a merge in place, from the shards themselves


def test_a_resource_config_without_this_host_is_named(inputs, tmp_path, capsys):
    config = tmp_path / "resourceconfig.json"
    config.write_text(json.dumps({"current_host": "algo-3", "hosts": ["algo-1", "algo-2"]}))
    status = prepare_data.main(["--input", *map(str, inputs), "--tokenizer", str(TOKENIZER), "--output",
                                str(tmp_path / "d"), "--host-config", str(config)])
    assert status == 2 and f"--host-config {config}" in capsys.readouterr().err


def test_conversations_prepared_by_three_instances_equal_the_local_dataset_masks_included(tmp_path):
    rng = random.Random(9)
    records = [{"messages": [{"role": "user", "content": _sentence(rng, 6)},
                             {"role": "assistant", "content": _sentence(rng, rng.randint(2, 12))}]}
               for _ in range(60)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    options = ("--messages-key", "messages", "--unit-bytes", "1500", "--shard-tokens", "400",
               "--workers", "1")
    common = ("--input", str(tmp_path / "chats.jsonl"), "--tokenizer", str(TOKENIZER))
    assert prepare_data.main([*common, "--output", str(tmp_path / "local"), *options]) == 0
    prefix = tmp_path / "s3" / "dataset"
    for index in range(3):
        folder = tmp_path / f"algo-{index + 1}"
        config = _resource_config(tmp_path, index, 3)
        assert prepare_data.main([*common, "--output", str(folder / "dataset"), "--state",
                                  str(folder / "state"), "--host-config", str(config), *options]) == 0
        _upload(folder, prefix)
    assert _merge(_listing(prefix, tmp_path / "listing"), prefix, tmp_path) == 0
    assert read_manifest(prefix).loss_mask and read_manifest(prefix).num_documents == 60
    assert _stream(prefix) == _stream(tmp_path / "local")  # token ids and mask files alike


# -- deduplication across instances ----------------------------------------------------------------


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> SeededDuplicates:
    return write_seeded_duplicates(tmp_path_factory.mktemp("seeded"))


def _documents(folder: Path) -> list[tuple[int, ...]]:
    return [document for split in _splits(folder).values() for document in split[0]]


@pytest.mark.parametrize(("method", "filters"), [("exact", ()), ("minhash", ("--filter", "gopher-quality"))])
def test_deduplication_across_instances_gives_the_local_dataset_whatever_the_workers_or_instances(
        seeded, method, filters, tmp_path, capsys):
    options = ("--unit-bytes", str(seeded.unit_bytes), "--shard-tokens", "300", "--dedup", method, *filters)
    local = {}
    for workers in (1, 4):
        local[workers] = tmp_path / f"local-{workers}"
        assert prepare_data.main(["--input", *map(str, seeded.files), "--tokenizer", str(TOKENIZER),
                                  "--output", str(local[workers]), *OPTIONS, *options,
                                  "--workers", str(workers)]) == 0
    assert _splits(local[4]) == _splits(local[1])
    for count in (1, 2, 3):
        prefix = tmp_path / f"s3-{count}" / "dataset"
        for index in range(count):
            _upload(_instance(seeded.files, tmp_path, index, count, *options), prefix)
        plan = json.loads((prefix / STATE / "plan.json").read_text())
        assert [unit["pieces"] for unit in plan["units"]] == [[{"file": k, "start": 0, "end": None}]
                                                             for k in range(6)]  # unit k is file k
        listing = _listing(prefix, tmp_path / f"listing-{count}")
        if count == 2:  # the launcher's merge gives --shards: the state folder alone has no signatures
            capsys.readouterr()
            assert _merge(listing, prefix, tmp_path) == 2
            assert f"--shards {listing}: no .dedup/ there" in capsys.readouterr().err
        assert _merge(listing, prefix, tmp_path, "--shards", str(prefix)) == 0
        assert _splits(prefix) == _splits(local[1]), count  # documents, shard for shard
        report, local_report = (json.loads((f / "preparation.json").read_text()) for f in (prefix, local[1]))
        assert report["steps"] == local_report["steps"] and report["splits"] == local_report["splits"]
        names = [s.path.name for split in SPLITS for s in read_manifest(prefix / split).shards]
        assert any(n.endswith("_dedup.bin") for n in names)  # units that lost documents were rewritten
        assert any(n.startswith("shard_00004_") for n in names)  # and the one without duplicates was not
    kept = _documents(local[1])
    duplicates = sorted(_reference([t for t in seeded.texts if not (filters and t == seeded.short)]))
    for document in kept:
        duplicates.remove(document)
    distinct = [t for t in seeded.distinct if not (filters and t == seeded.short)]
    if method == "exact":  # every distinct text once: the variants are not copies
        assert sorted(kept) == sorted(_reference(distinct))
    else:  # copies and variants alike: one of each pair is kept
        assert len(kept) == len(distinct) - len(seeded.variants)
        for variant, original in seeded.variants.items():
            assert (_reference([variant])[0] in kept) != (_reference([original])[0] in kept)
    assert _removed(local_report, f"dedup-{method}") == (len(duplicates), sum(map(len, duplicates)))
    if filters:  # the filter ran first, and the deduplication numbered only what it kept
        assert _removed(local_report, "gopher-quality") == (1, len(_reference([seeded.short])[0]))
