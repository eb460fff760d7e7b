"""`llmtrain data prepare | upload | ls` and `llmtrain runs --local`.

prepare runs the real prepare_data on a text file; upload and ls run against moto's S3 (which
stores the SHA-256 checksums S3 computes, composite for multipart uploads) with the environment's
record in moto's SSM."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import boto3
import numpy as np
import pytest
from deployed_support import ACCOUNT, BUCKET, REGION, TEAM_URI, deploy_environment, moto_credentials
from moto import mock_aws

from llmtrain.cli import main
from llmtrain.client import datasets
from llmtrain.core.sourcedir import repository_root

MIB = 1 << 20
TEXT = (repository_root() / "README.md").read_text()


def llmtrain(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def environment(monkeypatch):
    moto_credentials(monkeypatch)
    with mock_aws():
        deploy_environment(
            f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:llmtrain-dev-launcher", with_dataset=False
        )
        yield boto3.client("s3", region_name=REGION)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A text file prepared by `llmtrain data prepare` into train/ and validation/ shards."""
    folder = tmp_path_factory.mktemp("data")
    (folder / "notes.txt").write_text(TEXT * 3)
    (folder / "more.txt").write_text(TEXT[::-1])
    output = folder / "prepared"
    code = main(
        [
            "data",
            "prepare",
            "--input",
            str(folder / "notes.txt"),
            str(folder / "more.txt"),
            "--output",
            str(output),
            "--validation-fraction",
            "0.5",
            "--workers",
            "1",
        ]
    )
    assert code == 0
    return output


def test_prepare_writes_shards_with_the_shipped_tokenizer(prepared, capsys):
    for split in ("train", "validation"):
        manifest = json.loads((prepared / split / "manifest.json").read_text())
        assert manifest["num_documents"] == 2 and manifest["shards"]  # each text file's two halves
        assert manifest["tokenizer"].endswith("training_jobs/assets/tokenizer")
    assert (prepared / "tokenizer" / "tokenizer.json").is_file()


def test_the_shipped_tokenizer_prepares_the_shipped_conversations(tmp_path, capfd):
    """Issue 36 item 6: `--messages-key` works with the platform's own tokenizer (its chat template)
    on the shipped tiny conversations; the assistant's answers are what the masks train."""
    from transformers import AutoTokenizer

    chats = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_chat" / "validation.jsonl"
    output = tmp_path / "chat-tokens"
    code = main(["data", "prepare", "--input", str(chats), "--messages-key", "messages", "--output",
                 str(output), "--workers", "1"])
    assert code == 0, capfd.readouterr().err[-2000:]
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["loss_mask"] is True and manifest["num_documents"] == 20
    shards = manifest["shards"]
    tokens = np.concatenate([np.fromfile(output / s["path"], dtype=manifest["dtype"]) for s in shards])
    mask = np.concatenate([np.fromfile(output / s["mask"], dtype=np.uint8) for s in shards])
    tokenizer = AutoTokenizer.from_pretrained(output / "tokenizer")
    trained = tokenizer.decode(tokens[mask == 1])
    answers = [json.loads(line)["messages"][-1]["content"] for line in chats.read_text().splitlines()]
    assert all(answer + "<|endoftext|>" in trained for answer in answers), trained[:300]
    assert "List in reverse order" not in trained and "<|user|>" not in trained


def test_prepare_passes_on_errors_and_help(tmp_path, capfd):
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["data", "prepare", "--input", str(empty), "--output", str(tmp_path / "out")])
    assert code == 2
    assert "error:" in capfd.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "prepare", "--help"])
    assert exit_info.value.code == 0
    shown = capfd.readouterr().out
    assert "llmtrain data prepare --input" in shown and "--validation-fraction" in shown


def test_prepare_passes_on_workers_and_the_quality_steps(tmp_path, capfd):
    records = [f"Record {i}: the red door opens onto the long road." for i in range(12)]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records * 2))
    output = tmp_path / "tokens"
    options = ["--output", str(output), "--workers", "2", "--unit-bytes", "300", "--dedup", "exact"]
    code = main(["data", "prepare", "--input", str(tmp_path / "records.jsonl"), *options])
    assert code == 0, capfd.readouterr().err
    report = json.loads((output / "preparation.json").read_text())
    assert report["units"] > 2 and json.loads((output / "manifest.json").read_text())["num_documents"] == 12
    assert report["steps"][0]["step"] == "dedup-exact" and report["steps"][0]["removed_documents"] == 12


def test_upload_sends_every_file_verified_and_prints_the_channels(environment, prepared, capsys):
    code, out, _ = llmtrain(capsys, "data", "upload", str(prepared), "--name", "notes")
    assert code == 0
    uri = f"{TEAM_URI}notes/"
    assert f"to {uri}, each verified against its SHA-256" in out
    assert (f"--set channels.train={uri}train/ --set channels.validation={uri}validation/ "
            f"--set channels.tokenizer={uri}tokenizer/") in out

    keys = {
        o["Key"]: o
        for o in environment.list_objects_v2(Bucket=BUCKET, Prefix="teams/default/notes/")["Contents"]
    }
    local = sorted(p.relative_to(prepared).as_posix() for p in prepared.rglob("*") if p.is_file())
    assert sorted(keys) == sorted(
        [f"teams/default/notes/{name}" for name in local] + ["teams/default/notes/llmtrain-dataset.json"]
    )
    record = json.loads(
        environment.get_object(Bucket=BUCKET, Key="teams/default/notes/llmtrain-dataset.json")["Body"].read()
    )
    assert {f["path"]: f["sha256"] for f in record["files"]} == {
        name: hashlib.sha256((prepared / name).read_bytes()).hexdigest() for name in local
    }
    assert record["uploaded_by"].startswith(f"arn:aws:sts::{ACCOUNT}:")


def test_a_large_file_goes_in_parts_and_is_checked_against_the_parts_checksums(environment, tmp_path, capsys):
    folder = tmp_path / "big"
    folder.mkdir()
    data = bytes(range(256)) * (27 * 1024)  # 6.75 MiB: two 5 MiB parts
    (folder / "shard.bin").write_bytes(data)
    code, out, _ = llmtrain(capsys, "data", "upload", str(folder), "--name", "big", "--part-size-mib", "5")
    assert code == 0 and "--set channels.<CHANNEL>=" in out
    head = environment.head_object(Bucket=BUCKET, Key="teams/default/big/shard.bin", ChecksumMode="ENABLED")
    parts = [hashlib.sha256(data[: 5 * MIB]).digest(), hashlib.sha256(data[5 * MIB :]).digest()]
    composite = base64.b64encode(hashlib.sha256(b"".join(parts)).digest()).decode()
    assert head["ChecksumSHA256"].split("-")[0] == composite  # S3 saw the two parts we computed
    assert environment.get_object(Bucket=BUCKET, Key="teams/default/big/shard.bin")["Body"].read() == data


def test_a_corrupted_upload_is_detected(environment, tmp_path, capsys, monkeypatch):
    """What S3 stored differs from the file (here: another file's bytes went up): refused."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "a.txt").write_text("the real content")
    (tmp_path / "other.txt").write_text("something else")
    real_upload = datasets.LocalFile

    def swapped(files):
        return [
            real_upload(f.relative, tmp_path / "other.txt", f.size, f.sha256, f.s3_checksum) for f in files
        ]

    original = datasets.local_files
    monkeypatch.setattr("llmtrain.commands.data.local_files", lambda *a: swapped(original(*a)))
    code, _, err = llmtrain(capsys, "data", "upload", str(folder), "--name", "ds")
    assert code == 2 and "does not match" in err and "upload again with --overwrite" in err
    listed = environment.list_objects_v2(Bucket=BUCKET, Prefix="teams/default/ds/")["Contents"]
    assert [o["Key"] for o in listed] == ["teams/default/ds/a.txt"]  # no completion marker


def test_an_existing_dataset_is_replaced_only_when_told_and_never_deleted(environment, tmp_path, capsys):
    folder = tmp_path / "v1"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "manifest.json").write_text("{}")
    (folder / "train" / "shard-0.bin").write_bytes(b"\x01" * 64)
    assert llmtrain(capsys, "data", "upload", str(folder), "--name", "corpus")[0] == 0

    code, _, err = llmtrain(capsys, "data", "upload", str(folder), "--name", "corpus")
    assert code == 2 and f"dataset {TEAM_URI}corpus/ already exists (2 files)" in err and "--overwrite" in err

    (folder / "train" / "shard-0.bin").write_bytes(b"\x02" * 64)
    assert llmtrain(capsys, "data", "upload", str(folder), "--name", "corpus", "--overwrite")[0] == 0
    body = environment.get_object(Bucket=BUCKET, Key="teams/default/corpus/train/shard-0.bin")["Body"].read()
    assert body == b"\x02" * 64

    (folder / "train" / "shard-0.bin").rename(folder / "train" / "shard-1.bin")
    code, _, err = llmtrain(capsys, "data", "upload", str(folder), "--name", "corpus", "--overwrite")
    assert code == 2 and "would leave 1 files of the old dataset" in err and "train/shard-0.bin" in err


def test_upload_checks_its_input_before_any_aws_call(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = llmtrain(capsys, "data", "upload", str(tmp_path / "missing"), "--name", "x")
    assert code == 2 and "is not a folder" in err
    code, _, err = llmtrain(capsys, "data", "upload", str(tmp_path), "--name", "../x")
    assert code == 2 and "a dataset name is" in err


def test_ls_lists_the_teams_datasets_and_flags_incomplete_ones(environment, prepared, capsys):
    code, out, _ = llmtrain(capsys, "data", "ls")
    assert code == 0 and f"no datasets in {TEAM_URI} (team default)" in out
    llmtrain(capsys, "data", "upload", str(prepared), "--name", "notes")
    environment.put_object(Bucket=BUCKET, Key="teams/default/partial/train/shard-0.bin", Body=b"x" * 10)
    environment.put_object(Bucket=BUCKET, Key="teams/other/secret/a.bin", Body=b"x")

    code, out, _ = llmtrain(capsys, "data", "ls", "--json")
    listed = {d["name"]: d for d in json.loads(out)}
    assert sorted(listed) == ["notes", "partial"]
    files = [p for p in prepared.rglob("*") if p.is_file()]
    assert listed["notes"]["complete"] and listed["notes"]["files"] == len(files)
    assert listed["notes"]["bytes"] == sum(p.stat().st_size for p in files)
    assert listed["partial"] == listed["partial"] | {
        "complete": False,
        "files": 1,
        "bytes": 10,
        "uri": f"{TEAM_URI}partial/",
    }
    code, out, _ = llmtrain(capsys, "data", "ls")
    assert "incomplete (interrupted, or not uploaded by llmtrain)" in out


# -- runs --local --------------------------------------------------------------------------------------------


def test_runs_local_lists_the_run_folders(tmp_path, capsys):
    for name, status, started in (
        ("first", "Completed", "2026-01-01T10:00:00"),
        ("second", "Failed", "2026-01-02T10:00:00"),
    ):
        job = tmp_path / name / "jobs" / f"local-{name}-a1"
        job.mkdir(parents=True)
        tags = [
            {"Key": "llmtrain:template", "Value": "llama-pretrain-fsdp"},
            {"Key": "llmtrain:template-version", "Value": "1.1.0"},
        ]
        (job / "request.json").write_text(json.dumps({"Tags": tags}))
        summary = {
            "TrainingJobStatus": status,
            "ResourceConfig": {"InstanceType": "local", "InstanceCount": 2},
            "CreationTime": started,
            "BillableTimeInSeconds": 42,
            "LocalRun": {
                "RunName": name,
                "CloudInstanceType": "ml.p4d.24xlarge",
                "Request": str(job / "request.json"),
            },
        }
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "not-a-run").mkdir()

    code, out, _ = llmtrain(capsys, "runs", "--local", "--workdir", str(tmp_path))
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [row[:3] for row in rows] == [
        ["second", "Failed", "llama-pretrain-fsdp@1.1.0"],
        ["first", "Completed", "llama-pretrain-fsdp@1.1.0"],
    ]
    assert "2 x local (ml.p4d.24xlarge in the cloud)" in out and out.splitlines()[1].rstrip().endswith("42")
    code, out, _ = llmtrain(capsys, "runs", "--local", "--workdir", str(tmp_path / "none"))
    assert code == 0 and "no local runs in" in out
