"""A cloud data preparation from start to the complete dataset, against moto's S3 and SageMaker with
the processing jobs simulated as SageMaker runs them: each instance is given every object of each
input (FullyReplicated) in its own folders and SageMaker's resource config, runs the program with
the request's arguments (the container's paths mapped to those folders), and its outputs are
uploaded to the outputs' S3 URIs. The dataset equals the local one (with deduplication across the
instances too), a failed job is resumed with only the missing units redone, and `data ls` lists no
dataset before the merge."""

from __future__ import annotations

import dataclasses
import io
import json
import random
import shutil
import tarfile
from datetime import UTC, datetime
from pathlib import Path

import boto3
import numpy as np
import pytest
from deployed_support import ACCOUNT, BUCKET, REGION, TEAM_URI, deploy_environment, moto_credentials
from moto import mock_aws
from seeded_duplicates import SeededDuplicates, write_seeded_duplicates

from llmtrain.cli import main
from llmtrain.client import preparations
from llmtrain.client.datasets import DATASET_MANIFEST, list_datasets
from llmtrain.client.preparation_jobs import preparation_jobs, run_preparation
from llmtrain.commands.data_cloud import status_lines
from llmtrain.core.catalog import Catalog
from llmtrain.core.deployed import read_deployed_environment
from llmtrain.core.preparation import Preparation, PreparationError
from llmtrain.core.s3_uris import parse_s3_uri
from llmtrain.core.sourcedir import repository_root
from llmtrain.planner import prices
from training_jobs import prepare_data
from training_jobs.contract.token_data import SPLITS
from training_jobs.trainer.shards import read_manifest

TOKENIZER = repository_root() / "training_jobs" / "assets" / "tokenizer"
TEMPLATE = Catalog.load().resolve("gpt2-ddp")
OPTIONS = ("--unit-bytes", "1500", "--shard-tokens", "500", "--validation-fraction", "0.2")
WORDS = "the river stone garden window morning letter bridge music quiet bright small green open".split()


class SimulatedProcessing:
    """moto's SageMaker, with each processing job run as SageMaker would run it (see the module)."""

    def __init__(self, s3, folder: Path, lost: set[int] = frozenset()) -> None:
        self.client, self.s3, self.folder, self.lost = (
            boto3.client("sagemaker", region_name=REGION),
            s3,
            folder,
            lost,
        )
        self.failed: set[str] = set()
        self.requests: dict[str, dict] = {}
        self.instance_units: dict[str, list[list[str]]] = {}

    def create_processing_job(self, **request) -> None:
        cluster = request["ProcessingResources"]["ClusterConfig"]
        name = request["ProcessingJobName"]
        self.instance_units[name] = []
        for index in range(cluster["InstanceCount"]):
            root = self.folder / "machine"  # a fresh machine, with the paths of every instance's /opt/ml
            shutil.rmtree(root, ignore_errors=True)
            if index in self.lost:
                self.failed.add(name)  # this instance never ran; the job fails
                continue
            for item in request["ProcessingInputs"]:
                self._download(item["S3Input"]["S3Uri"], root / item["S3Input"]["LocalPath"].lstrip("/"))
            code = root / "opt/ml/processing/input/code/sourcedir.tar.gz"
            with tarfile.open(fileobj=io.BytesIO(code.read_bytes())) as tar:  # the code the job would unpack
                assert "training_jobs/data_pipeline/instances.py" in tar.getnames()
            config = root / "resourceconfig.json"
            hosts = [f"algo-{i + 1}" for i in range(cluster["InstanceCount"])]
            config.write_text(json.dumps({"current_host": hosts[index], "hosts": hosts}))
            arguments = []
            for argument in request["AppSpecification"]["ContainerArguments"]:
                arguments.append(
                    str(root / argument.lstrip("/")) if argument.startswith("/opt/ml/") else argument
                )
                if argument == "--host-config":
                    arguments.append(str(config))
            assert prepare_data.main([*arguments, "--workers", "1"]) == 0
            outputs = request["ProcessingOutputConfig"]["Outputs"]
            for item in outputs:
                self._upload(root / item["S3Output"]["LocalPath"].lstrip("/"), item["S3Output"]["S3Uri"])
            units = root / "opt/ml/processing/output/state/units"
            self.instance_units[name].append(
                sorted(p.name for p in units.iterdir()) if units.is_dir() else []
            )
        self.client.create_processing_job(**request)
        self.requests[name] = request

    def describe_processing_job(self, ProcessingJobName: str) -> dict:  # noqa: N803 (boto3's name)
        job = self.client.describe_processing_job(ProcessingJobName=ProcessingJobName)
        # What SageMaker's answer holds and moto's leaves out: the cluster, and (made up) an hour's run.
        job["ProcessingResources"] = self.requests[ProcessingJobName]["ProcessingResources"]
        job["ProcessingStartTime"] = datetime(2026, 11, 28, 12, tzinfo=UTC)
        job["ProcessingEndTime"] = datetime(2026, 11, 28, 13, tzinfo=UTC)
        if ProcessingJobName in self.failed:
            job.update(ProcessingJobStatus="Failed", FailureReason="AlgorithmError: an instance was lost")
        return job

    def get_waiter(self, name: str):
        return type("Done", (), {"wait": lambda *args, **kwargs: None})()  # the simulated jobs have ended

    def get_paginator(self, name: str):
        return self.client.get_paginator(name)

    def _download(self, uri: str, local: Path) -> None:
        location = parse_s3_uri(uri)
        for page in self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=location.bucket, Prefix=location.key
        ):
            for obj in page.get("Contents", []):
                target = (
                    local / obj["Key"][len(location.key) :].lstrip("/")
                    if not uri.endswith(".tar.gz")
                    else local / Path(obj["Key"]).name
                )
                target.parent.mkdir(parents=True, exist_ok=True)
                self.s3.download_file(location.bucket, obj["Key"], str(target))
        local.mkdir(parents=True, exist_ok=True)

    def _upload(self, local: Path, uri: str) -> None:
        location = parse_s3_uri(uri)
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.s3.upload_file(
                    str(path), location.bucket, location.key + path.relative_to(local).as_posix()
                )


@pytest.fixture
def s3(monkeypatch, tmp_path):
    moto_credentials(monkeypatch)
    with mock_aws():
        deploy_environment(
            f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:llmtrain-dev-launcher", with_dataset=False
        )
        client = boto3.client("s3", region_name=REGION)
        rng = random.Random(3)
        raw = tmp_path / "raw"
        raw.mkdir()
        for index in range(2):
            (raw / f"note{index}.txt").write_text("\n\n".join(_sentence(rng) for _ in range(6)))
        (raw / "records.jsonl").write_text(
            "".join(json.dumps({"text": _sentence(rng)}) + "\n" for _ in range(150))
        )
        for path in raw.iterdir():
            client.upload_file(str(path), BUCKET, f"teams/default/raw/{path.name}")
        for path in TOKENIZER.iterdir():
            client.upload_file(str(path), BUCKET, f"teams/default/tok/{path.name}")
        yield client


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20))).capitalize() + "."


def _preparation(s3, **change) -> tuple[Preparation, object]:
    platform = read_deployed_environment(boto3.Session(), "dev", REGION).team(None).platform
    draft = Preparation(
        name="web",
        input_uri=f"{TEAM_URI}raw/",
        tokenizer_uri=f"{TEAM_URI}tok/",
        instance_type="ml.c5.xlarge",
        instance_count=2,
        options=OPTIONS,
        owner="alice",
        input_bytes=0,
        stamp="20261128120000",
    )
    draft = dataclasses.replace(draft, **change)
    files = preparations.input_files(s3, draft.input_uri)
    rerun = preparations.output_is_rerun(s3, draft, platform)
    return dataclasses.replace(draft, input_bytes=sum(f.size for f in files), rerun=rerun), platform


def _dataset(s3, folder: Path) -> dict:
    """The dataset in S3 as a run reads it: each split's documents as token tuples."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="teams/default/web/"):
        for obj in page.get("Contents", []):
            target = folder / obj["Key"][len("teams/default/web/") :]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(BUCKET, obj["Key"], str(target))
    return {split: _documents(folder / split) for split in ("train", "validation")}


def _documents(folder: Path) -> list[tuple[int, ...]]:
    manifest = read_manifest(folder)
    ids = np.concatenate([np.fromfile(s.path, dtype=manifest.numpy_dtype) for s in manifest.shards])
    ends = np.flatnonzero(ids == manifest.eos_token_id)
    return [
        tuple(ids[start : end + 1].tolist()) for start, end in zip(np.r_[0, ends[:-1] + 1], ends, strict=True)
    ]


@pytest.fixture
def local_dataset(tmp_path) -> dict:
    output = tmp_path / "local"
    assert (
        prepare_data.main(
            [
                "--input",
                str(tmp_path / "raw"),
                "--tokenizer",
                str(TOKENIZER),
                "--output",
                str(output),
                "--workers",
                "1",
                *OPTIONS,
            ]
        )
        == 0
    )
    return {split: _documents(output / split) for split in ("train", "validation")}


def test_two_instances_and_the_merge_make_the_local_dataset(s3, local_dataset, tmp_path):
    preparation, platform = _preparation(s3)
    simulated = SimulatedProcessing(s3, tmp_path / "jobs")
    run_preparation(simulated, s3, preparation, platform, TEMPLATE, say=lambda line: None)
    assert _dataset(s3, tmp_path / "cloud") == local_dataset
    team = read_deployed_environment(boto3.Session(), "dev", REGION).team(None)
    assert {d.name: d.complete for d in list_datasets(s3, BUCKET, team)}["web"]
    jobs = preparation_jobs(simulated, platform, "web")
    assert [job.status for job in jobs] == ["Completed", "Completed"] and jobs[0].instances == 2
    price = prices.load().on_demand("ml.c5.xlarge")
    assert [job.usd for job in jobs] == [pytest.approx(2 * price), pytest.approx(price)]  # an hour each
    lines = status_lines(simulated, s3, platform, "web")
    plan = json.loads(
        s3.get_object(Bucket=BUCKET, Key="teams/default/web/.preparation/plan.json")["Body"].read()
    )
    tokens = sum(len(document) for documents in local_dataset.values() for document in documents)
    assert f"work units: {len(plan['units'])} of {len(plan['units'])} written; {tokens:,} tokens" in lines[2]
    assert f"cost so far: ${3 * price:,.2f}" in lines[2] and lines[3] == "dataset: complete"


def test_a_failed_job_is_resumed_with_only_the_missing_units_redone(s3, local_dataset, tmp_path):
    preparation, platform = _preparation(s3)
    failing = SimulatedProcessing(s3, tmp_path / "jobs", lost={1})
    with pytest.raises(
        PreparationError, match="ended Failed .*redoes only the work units whose shards are missing"
    ):
        run_preparation(failing, s3, preparation, platform, TEMPLATE, say=lambda line: None)
    team = read_deployed_environment(boto3.Session(), "dev", REGION).team(None)
    assert not {d.name: d.complete for d in list_datasets(s3, BUCKET, team)}["web"]  # shards, no dataset
    assert (
        "KeyCount" in s3.list_objects_v2(Bucket=BUCKET, Prefix="teams/default/web/train/manifest.json")
        and s3.list_objects_v2(Bucket=BUCKET, Prefix="teams/default/web/train/manifest.json")["KeyCount"] == 0
    )
    first = failing.instance_units[next(iter(failing.instance_units))][0]
    rerun, _ = _preparation(s3, stamp="20261128130000")
    assert rerun.rerun
    failing.lost = set()  # the same SageMaker, which has the failed job on record; no instance lost now
    run_preparation(failing, s3, rerun, platform, TEMPLATE, say=lambda line: None)
    shard_job = next(name for name in failing.instance_units if "-shard-20261128130000" in name)
    kept, redone = failing.instance_units[shard_job]
    assert kept == [] and first and set(redone).isdisjoint(first)  # instance 1's units were kept
    assert _dataset(s3, tmp_path / "cloud") == local_dataset


def test_the_command_checks_estimates_and_prints_the_requests(s3, capsys):
    code = main(
        [
            "data",
            "prepare",
            "--cloud",
            "--name",
            "web",
            "--input",
            "raw/",
            "--tokenizer",
            "tok/",
            "--template",
            "gpt2-ddp",
            "--instance-count",
            "2",
            "--env",
            "dev",
            "--dry-run",
            *OPTIONS,
            "--dedup",
            "exact",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "3 input file(s)" in out and "estimated" in out and "6 MB in 14.2 s" in out
    requests = json.loads(out[out.index("[") :])
    assert [r["ProcessingResources"]["ClusterConfig"]["InstanceCount"] for r in requests] == [2, 1]
    assert [len(r["ProcessingInputs"]) for r in requests] == [3, 4]  # the merge reads the shards to rewrite
    code = main(
        [
            "data",
            "prepare",
            "--cloud",
            "--name",
            "web",
            "--input",
            "raw/",
            "--tokenizer",
            "tok/",
            "--template",
            "gpt2-ddp",
            "--instance-count",
            "4",
            "--env",
            "dev",
            "--dry-run",
        ]
    )
    assert code == 2 and "--instance-count 4 is more than the 3 input file(s)" in capsys.readouterr().err


@pytest.fixture
def seeded(s3, tmp_path) -> SeededDuplicates:
    """The seeded corpus with known duplicates (tests/support/seeded_duplicates.py) under raw-dups/."""
    seeded = write_seeded_duplicates(tmp_path / "seeded")
    for path in seeded.files:
        s3.upload_file(str(path), BUCKET, f"teams/default/raw-dups/{path.name}")
    return seeded


def _keys(s3, prefix: str) -> list[str]:
    where = f"teams/default/{prefix}"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=where)
    return [o["Key"][len(where) :] for page in pages for o in page.get("Contents", [])]


def test_deduplication_across_instances_resumed_after_a_lost_instance_gives_the_local_dataset(
    s3, seeded, tmp_path
):
    options = ("--unit-bytes", str(seeded.unit_bytes), "--shard-tokens", "300", "--dedup", "minhash")
    options += ("--validation-fraction", "0.2")
    local = tmp_path / "local"
    command = ["--input", *map(str, seeded.files), "--tokenizer", str(TOKENIZER), "--output", str(local)]
    assert prepare_data.main([*command, "--workers", "1", *options]) == 0
    job = {"input_uri": f"{TEAM_URI}raw-dups/", "instance_count": 3, "options": options}
    preparation, platform = _preparation(s3, **job)
    failing = SimulatedProcessing(s3, tmp_path / "jobs", lost={1})
    with pytest.raises(PreparationError, match="ended Failed"):
        run_preparation(failing, s3, preparation, platform, TEMPLATE, say=lambda line: None)
    first = failing.instance_units[next(iter(failing.instance_units))]
    assert first == [["00000.json", "00003.json"], ["00002.json", "00005.json"]]  # instance 2 of 3 was lost
    assert "bucket_000/00003.minhash.sig" in {k.split("signatures/")[-1] for k in _keys(s3, "web/.dedup/")}
    # One signature file of a complete unit never reached the prefix: its unit is redone with the lost ones.
    s3.delete_object(Bucket=BUCKET, Key="teams/default/web/.dedup/signatures/bucket_005/00003.minhash.sig")
    rerun, _ = _preparation(s3, stamp="20261128130000", **job)
    failing.lost = set()
    said: list[str] = []
    run_preparation(failing, s3, rerun, platform, TEMPLATE, say=said.append)
    shard_job = next(name for name in failing.instance_units if "-shard-20261128130000" in name)
    assert failing.instance_units[shard_job] == [["00003.json"], ["00001.json", "00004.json"], []]
    assert _dataset(s3, tmp_path / "cloud") == {split: _documents(local / split) for split in SPLITS}
    report = json.loads((local / "preparation.json").read_text())
    removed = next(step for step in report["steps"] if step["step"] == "dedup-minhash")
    assert removed["removed_documents"] == len(seeded.copies) + len(seeded.variants)
    line = f"dedup-minhash removed 5 document(s) ({removed['removed_tokens']:,} tokens)"
    assert line in said and said[-1].endswith("is complete")
    # The dataset keeps only what it uses: no signatures, no shard that the merge replaced.
    keys = _keys(s3, "web/")
    assert not [k for k in keys if k.startswith(".dedup/")]
    listed = {f"{split}/{shard.path.name}" for split in SPLITS
              for shard in read_manifest(tmp_path / "cloud" / split).shards}
    assert {k for k in keys if "/shard_" in k} == listed and any("_dedup.bin" in k for k in listed)
    marker = s3.get_object(Bucket=BUCKET, Key=f"teams/default/web/{DATASET_MANIFEST}")["Body"].read()
    assert sorted(f["path"] for f in json.loads(marker)["files"]) == sorted(set(keys) - {DATASET_MANIFEST})
    assert line in status_lines(failing, s3, platform, "web")
