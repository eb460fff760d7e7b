"""A cloud data preparation from `llmtrain data prepare --cloud` to the complete dataset, through the
team's preparation state machine as the stacks deploy it.

The dev stage is synthesized (with gpt2-ddp its only template, to keep the synth short); its
preparation state machine's definition, resolved as CloudFormation would, runs in moto's Step
Functions with its real function (in process: tests/llmtrain/launcher_harness.py) and with the
processing jobs run as SageMaker runs them (tests/llmtrain/processing_support.py: every request
through botocore's CreateProcessingJob shape and its min/max/pattern metadata, every instance's
inputs downloaded as its distribution type says, the program's prepare_data run per instance on this
CPU, the outputs uploaded). The CLI reads the environment's record from moto's SSM, naming the
harness's state machine, and talks to AWS with nothing else.

The dataset equals the local one, with `--dedup` across the instances too (a seeded corpus with known
duplicates: tests/support/seeded_duplicates.py); a failed job leaves no dataset and the rerun redoes
only the missing units; a deduplicating preparation leaves no signatures and no replaced shards.
"""

from __future__ import annotations

import dataclasses
import json
import random
import uuid
from pathlib import Path

import aws_cdk as cdk
import boto3
import numpy as np
import pytest
import yaml
from launcher_harness import ACCOUNT, REGION, launcher_in_moto
from processing_support import LOST_REASON, SimulatedProcessingJobs
from seeded_duplicates import SeededDuplicates, write_seeded_duplicates

from llmtrain.cli import main
from llmtrain.client import preparation_jobs
from llmtrain.client.datasets import DATASET_MANIFEST, list_datasets
from llmtrain.core.deployed import TeamAccess, parameter_values, read_deployed_environment
from llmtrain.core.environments import load_environment
from llmtrain.core.function_settings import ENV_PLATFORM_CONTEXT, ENV_PROCESSING_ROLE_ARN
from llmtrain.core.platform import PlatformContext
from llmtrain.core.preparation import PROCESSING_REQUEST_FIELDS, SHARDS_PATH, Preparation, PreparationInput
from llmtrain.core.sourcedir import repository_root
from llmtrain.planner import prices
from stacks.platform import PlatformStage
from training_jobs import prepare_data
from training_jobs.contract.token_data import SPLITS
from training_jobs.trainer.shards import read_manifest

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = repository_root() / "training_jobs" / "assets" / "tokenizer"
OPTIONS = ("--unit-bytes", "1500", "--shard-tokens", "500", "--validation-fraction", "0.2")
WORDS = "the river stone garden window morning letter bridge music quiet bright small green open".split()


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    """The dev stage with gpt2-ddp its only template, synthesized once for moto's account."""
    raw = yaml.safe_load((ROOT / "config" / "dev.yaml").read_text())
    raw["job_templates"]["enabled"] = ["gpt2-ddp"]
    path = tmp_path_factory.mktemp("config") / "dev.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = dataclasses.replace(load_environment(path), account=ACCOUNT)
    outdir = tmp_path_factory.mktemp("cdk.out")
    app = cdk.App(outdir=str(outdir))
    stage = PlatformStage(app, config=config)
    assembly = app.synth().get_nested_assembly(stage.artifact_id)
    return (
        Path(assembly.directory),
        stage.launcher.stack_name,
        {s.stack_name: s.template for s in assembly.stacks},
    )


@pytest.fixture(scope="module")
def raw_files(tmp_path_factory) -> Path:
    """A small corpus: two notes and a JSONL file (three files: up to three instances have work)."""
    folder = tmp_path_factory.mktemp("raw")
    rng = random.Random(3)
    for index in range(2):
        (folder / f"note{index}.txt").write_text("\n\n".join(_sentence(rng) for _ in range(6)))
    (folder / "records.jsonl").write_text(
        "".join(json.dumps({"text": _sentence(rng)}) + "\n" for _ in range(150))
    )
    return folder


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20))).capitalize() + "."


@pytest.fixture(scope="module")
def local_dataset(raw_files, tmp_path_factory) -> dict:
    """The dataset `llmtrain data prepare` makes locally from the same files."""
    output = tmp_path_factory.mktemp("local") / "tokens"
    arguments = [
        "--input",
        str(raw_files),
        "--tokenizer",
        str(TOKENIZER),
        "--output",
        str(output),
        "--workers",
        "1",
        *OPTIONS,
    ]
    assert prepare_data.main(arguments) == 0
    return {split: _documents(output / split) for split in ("train", "validation")}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> SeededDuplicates:
    """The seeded corpus with known duplicates: six files, each one work unit at `unit_bytes`."""
    return write_seeded_duplicates(tmp_path_factory.mktemp("seeded"))


def seeded_options(seeded: SeededDuplicates) -> tuple[str, ...]:
    return (
        "--unit-bytes", str(seeded.unit_bytes), "--shard-tokens", "300", "--dedup", "minhash",
        "--validation-fraction", "0.2",
    )


@pytest.fixture(scope="module")
def seeded_local(seeded, tmp_path_factory) -> Path:
    """The seeded corpus prepared locally with MinHash deduplication."""
    output = tmp_path_factory.mktemp("seeded-local") / "tokens"
    arguments = ["--input", *map(str, seeded.files), "--tokenizer", str(TOKENIZER), "--output", str(output)]
    assert prepare_data.main([*arguments, "--workers", "1", *seeded_options(seeded)]) == 0
    return output


def _documents(folder: Path) -> list[tuple[int, ...]]:
    manifest = read_manifest(folder)
    ids = np.concatenate([np.fromfile(s.path, dtype=manifest.numpy_dtype) for s in manifest.shards])
    ends = np.flatnonzero(ids == manifest.eos_token_id)
    return [tuple(ids[a : b + 1].tolist()) for a, b in zip(np.r_[0, ends[:-1] + 1], ends, strict=True)]


class Deployed:
    """The preparation state machine in moto, the environment's record naming it, the team's files."""

    def __init__(
        self, harness, processing: SimulatedProcessingJobs, raw_files: Path, seeded: SeededDuplicates
    ):
        self.harness, self.processing = harness, processing
        function = next(
            f for f in harness.launcher.functions.values() if f.handler.endswith("preparation.handler")
        )
        self.platform = PlatformContext.from_dict(json.loads(function.environment[ENV_PLATFORM_CONTEXT]))
        self.processing_role = function.environment[ENV_PROCESSING_ROLE_ARN]
        team = TeamAccess(
            name=self.platform.team,
            state_machine_arn=f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:launcher",
            notification_topic_arn="arn:aws:sns:us-east-1:1:t",
            platform=self.platform,
            preparation_state_machine_arn=harness.state_machine_arn,
        )
        values = parameter_values(
            environment="dev",
            region=REGION,
            account=ACCOUNT,
            job_name_prefix="llmtrain-dev",
            enabled_templates=["gpt2-ddp"],
            teams=[team.to_dict()],
        )
        ssm = boto3.client("ssm", region_name=REGION)
        for name, value in values.items():
            ssm.put_parameter(Name=name, Value=json.dumps(value), Type="String")
        self.s3 = boto3.client("s3", region_name=REGION)
        self.bucket = self.platform.datasets_bucket
        self.s3.create_bucket(Bucket=self.bucket)
        for path in raw_files.iterdir():
            self.s3.upload_file(str(path), self.bucket, f"teams/default/raw/{path.name}")
        for path in seeded.files:
            self.s3.upload_file(str(path), self.bucket, f"teams/default/raw-dups/{path.name}")
        for path in TOKENIZER.iterdir():
            self.s3.upload_file(str(path), self.bucket, f"teams/default/tok/{path.name}")

    def keys(self, name: str = "web") -> list[str]:
        """The keys of the dataset's folder, relative to it."""
        prefix = f"teams/default/{name}/"
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", [])]

    def dataset(self, folder: Path, name: str = "web") -> dict:
        """The dataset in S3 as a run reads it: each split's documents as token tuples."""
        prefix = f"teams/default/{name}/"
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                target = folder / obj["Key"][len(prefix) :]
                target.parent.mkdir(parents=True, exist_ok=True)
                self.s3.download_file(self.bucket, obj["Key"], str(target))
        return {split: _documents(folder / split) for split in ("train", "validation")}

    def complete(self, name: str = "web") -> bool:
        team = read_deployed_environment(boto3.Session(), "dev", REGION).team(None)
        return {d.name: d.complete for d in list_datasets(self.s3, self.bucket, team)}[name]

    def processing_jobs(self) -> list[str]:
        sagemaker = boto3.client("sagemaker", region_name=REGION)
        return [j["ProcessingJobName"] for j in sagemaker.list_processing_jobs()["ProcessingJobSummaries"]]


@pytest.fixture
def deployed(synthesized, raw_files, seeded, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setattr(preparation_jobs, "POLL_SECONDS", 0.05)
    processing = SimulatedProcessingJobs(tmp_path / "jobs")
    with launcher_in_moto(
        *synthesized, outcomes=[], processing=processing, machine_prefix="Preparations"
    ) as harness:
        yield Deployed(harness, processing, raw_files, seeded)


def prepare(
    *extra: str, name: str = "web", count: int = 2, source: str = "raw/", options: tuple[str, ...] = OPTIONS
) -> list[str]:
    return [
        "data",
        "prepare",
        "--cloud",
        "--name",
        name,
        "--input",
        source,
        "--tokenizer",
        "tok/",
        "--template",
        "gpt2-ddp",
        "--instance-type",
        "ml.c5.xlarge",
        "--instance-count",
        str(count),
        "--env",
        "dev",
        *extra,
        *options,
    ]


def test_the_cli_starts_the_state_machine_whose_jobs_make_the_local_dataset(
    deployed, local_dataset, tmp_path, capsys
):
    code = main(prepare())
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "3 input file(s)" in out and "estimated" in out and "Dataset web: Completed" in out
    assert deployed.dataset(tmp_path / "cloud") == local_dataset
    assert deployed.complete()
    # Both requests passed botocore's shape and its metadata (the simulation checks each), every field of
    # the rendered request reached SageMaker, and the role is the processing role the definition fixes.
    shards, merge = deployed.processing.requests
    assert set(shards) == set(merge) == {"RoleArn", *PROCESSING_REQUEST_FIELDS}
    assert {shards["RoleArn"], merge["RoleArn"]} == {deployed.processing_role}
    assert [r["ProcessingResources"]["ClusterConfig"]["InstanceCount"] for r in (shards, merge)] == [2, 1]
    assert "shards" not in {i["InputName"] for i in merge["ProcessingInputs"]}  # no --dedup, no rewrite
    assert shards["ProcessingJobName"].startswith("llmtrain-dev-default-web-")
    assert {t["Key"]: t["Value"] for t in shards["Tags"]}["llmtrain:team"] == "default"
    # Every instance was given the whole input (FullyReplicated), and ran its own work units.
    inputs = deployed.processing.instance_inputs[shards["ProcessingJobName"]]
    assert inputs[0]["data"] == inputs[1]["data"] and len(inputs[0]["data"]) == 3
    first, second = deployed.processing.instance_units[shards["ProcessingJobName"]]
    assert first and second and set(first).isdisjoint(second)
    [note] = deployed.harness.notifications()
    assert note["Subject"] == "llmtrain: dataset web Completed"
    price = prices.load().on_demand("ml.c5.xlarge")
    assert f"Cost: ${3 * price:,.2f}" in note["Message"]  # an hour of two instances, then of one

    assert main(["data", "status", "web", "--env", "dev"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("preparation llmtrain-dev-default-web-") and lines[0].endswith("SUCCEEDED")
    assert [line.split()[1] for line in lines[1:3]] == ["Completed", "Completed"]
    plan = json.loads(
        deployed.s3.get_object(Bucket=deployed.bucket, Key="teams/default/web/.preparation/plan.json")[
            "Body"
        ].read()
    )
    tokens = sum(len(document) for documents in local_dataset.values() for document in documents)
    units = len(plan["units"])
    assert (
        f"work units: {units} of {units} written; {tokens:,} tokens; cost so far: ${3 * price:,.2f}"
        in lines[3]
    )
    assert lines[4] == "dataset: complete"


def test_a_failed_deduplicating_preparation_leaves_no_dataset_and_its_rerun_makes_the_local_dataset(
    deployed, seeded, seeded_local, tmp_path, capsys, monkeypatch
):
    """MinHash across three instances, one lost: no merge, no dataset. The rerun redoes the lost
    instance's units and a complete unit whose signature file is missing, the merge finds the duplicates
    across every unit (the dataset's prefix its extra input), and the marker step removes what the
    dataset does not use (`.dedup/`, the shards the merge replaced) before it lists the files."""
    run = {"count": 3, "source": "raw-dups/", "options": seeded_options(seeded)}
    deployed.processing.lost = {(0, 1)}  # the first job's second instance is lost
    assert main(prepare(**run)) == 1
    err = capsys.readouterr().err
    assert "PreparationJobFailed" in err and LOST_REASON in err
    assert "it redoes only the work units whose shards are missing" in err
    assert not deployed.complete()  # shards of instances 0 and 2, and no manifest, no marker
    manifest = deployed.s3.list_objects_v2(
        Bucket=deployed.bucket, Prefix="teams/default/web/train/manifest.json"
    )
    assert manifest["KeyCount"] == 0
    assert len(deployed.processing.requests) == 1  # no merge job after a failed shards job
    [failed] = deployed.harness.notifications()
    assert failed["Subject"] == "llmtrain: dataset web Failed"
    first = deployed.processing.instance_units[deployed.processing.requests[0]["ProcessingJobName"]]
    assert first == [["00000.json", "00003.json"], [], ["00002.json", "00005.json"]]
    signatures = {k.split("signatures/")[-1] for k in deployed.keys() if k.startswith(".dedup/signatures/")}
    assert "bucket_005/00003.minhash.sig" in signatures
    # `data ls` lists the stopped preparation with how far it got, never as a dataset.
    assert main(["data", "ls", "--env", "dev", "--json"]) == 0
    [listed] = [d for d in json.loads(capsys.readouterr().out) if d["name"] == "web"]
    assert listed["complete"] is False
    assert listed["preparation"]["units"] == 6 and listed["preparation"]["units_done"] == 4
    assert listed["preparation"]["tokens"] > 0
    assert main(["data", "ls", "--env", "dev"]) == 0
    assert "preparing: 4 of 6 work units" in capsys.readouterr().out
    # One signature file of a complete unit never reached the prefix: its unit is redone with the lost ones.
    deployed.s3.delete_object(
        Bucket=deployed.bucket, Key="teams/default/web/.dedup/signatures/bucket_005/00003.minhash.sig"
    )

    monkeypatch.setattr("llmtrain.commands.data_cloud.datetime", _Later)  # the rerun's jobs get new names
    assert main(prepare(**run)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "resuming: the" in out and "Dataset web: Completed" in out
    rerun, merge = deployed.processing.requests[1:]
    assert "--previous" in rerun["AppSpecification"]["ContainerArguments"]
    assert deployed.processing.instance_units[rerun["ProcessingJobName"]] == [
        ["00003.json"],
        ["00001.json", "00004.json"],
        [],
    ]
    inputs = {i["InputName"]: i["S3Input"]["S3Uri"] for i in merge["ProcessingInputs"]}
    assert inputs["shards"] == f"{deployed.platform.datasets_uri}web/"
    assert merge["AppSpecification"]["ContainerArguments"][-2:] == ["--shards", SHARDS_PATH]
    local = {split: _documents(seeded_local / split) for split in SPLITS}
    assert deployed.dataset(tmp_path / "cloud") == local and deployed.complete()

    # Each step's removals, as the local preparation reports them: printed, notified, in data status.
    report = json.loads((seeded_local / "preparation.json").read_text())
    removed = next(step for step in report["steps"] if step["step"] == "dedup-minhash")
    assert removed["removed_documents"] == len(seeded.copies) + len(seeded.variants)
    line = f"dedup-minhash removed 5 document(s) ({removed['removed_tokens']:,} tokens)"
    assert line in out.splitlines()
    [completed] = deployed.harness.notifications()  # the failure's was read above
    assert completed["Subject"] == "llmtrain: dataset web Completed"
    assert line in completed["Message"].splitlines()
    # The dataset keeps only what it uses: no signatures, no shard that the merge replaced.
    keys = deployed.keys()
    assert not [k for k in keys if k.startswith(".dedup/")]
    manifests = {split: read_manifest(tmp_path / "cloud" / split) for split in SPLITS}
    listed = {f"{split}/{shard.path.name}" for split, found in manifests.items() for shard in found.shards}
    assert {k for k in keys if "/shard_" in k} == listed and any("_dedup.bin" in k for k in listed)
    marker = deployed.s3.get_object(Bucket=deployed.bucket, Key=f"teams/default/web/{DATASET_MANIFEST}")
    files = json.loads(marker["Body"].read())["files"]
    assert sorted(f["path"] for f in files) == sorted(set(keys) - {DATASET_MANIFEST})

    assert main(["data", "status", "web", "--env", "dev"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in lines[:2]] == ["FAILED", "SUCCEEDED"]
    assert line in lines and lines[-1] == "dataset: complete"


class _Later:
    """datetime, an hour on: the rerun's stamp differs from the first attempt's."""

    @staticmethod
    def now(tz=None):
        from datetime import datetime, timedelta

        return datetime.now(tz) + timedelta(hours=1)


def _start(deployed, data) -> object:
    arn = deployed.harness.sfn.start_execution(
        stateMachineArn=deployed.harness.state_machine_arn,
        name=f"bad-{uuid.uuid4().hex[:8]}",
        input=json.dumps(data),
    )["executionArn"]
    return deployed.harness.wait(arn)


def test_input_that_fails_validation_creates_no_processing_job(deployed):
    """The state machine checks what it is given, whoever started it: nothing here went through the CLI."""
    platform = deployed.platform
    deployed.s3.put_object(
        Bucket=deployed.bucket, Key="teams/default/web/.preparation-code/sourcedir.tar.gz", Body=b"code"
    )
    good = Preparation(
        name="web",
        input_uri=f"{platform.datasets_uri}raw/",
        tokenizer_uri=f"{platform.datasets_uri}tok/",
        instance_type="ml.c5.xlarge",
        instance_count=2,
        options=OPTIONS,
        owner="alice",
        input_bytes=0,
        stamp="20261128120000",
    )
    cases = {
        "another team's input": (
            dataclasses.replace(good, input_uri=f"s3://{platform.datasets_bucket}/teams/other/raw/"),
            "outside team 'default''s datasets prefix",
        ),
        "a GPU instance type": (
            dataclasses.replace(good, instance_type="ml.p4d.24xlarge"),
            "tokenizes on CPUs",
        ),
        "more instances than files": (
            dataclasses.replace(good, instance_count=4),
            "more than the 3 input file(s)",
        ),
        "a refused option": (
            dataclasses.replace(good, options=("--preference",)),
            "--preference is not offered with --cloud",
        ),
        "an abbreviation of an option the platform reads": (
            dataclasses.replace(good, options=("--ded", "exact")),
            "--ded: write the option in full (--dedup)",
        ),
        "the platform's option": (
            dataclasses.replace(good, options=("--output=/tmp",)),
            "the platform sets it",
        ),
    }
    for case, (preparation, message) in cases.items():
        run = _start(deployed, PreparationInput(preparation, "gpt2-ddp@latest").to_dict())
        assert run.status == "FAILED" and run.error == "PreparationError", (case, run.cause)
        assert message in run.cause, (case, run.cause)
    shapeless = _start(deployed, {"template": "gpt2-ddp@latest", "preparation": {"name": 3}})
    assert shapeless.status == "FAILED" and "'name' must be a string" in shapeless.cause
    assert "'input_uri' is missing" in shapeless.cause
    unknown = _start(deployed, PreparationInput(good, "nosuch@1.0.0").to_dict())
    assert unknown.status == "FAILED" and "nosuch" in unknown.cause
    assert deployed.processing_jobs() == [] and deployed.processing.requests == []
    notes = deployed.harness.notifications()
    assert len(notes) == len(cases) + 2 and {n["MessageAttributes"]["status"]["Value"] for n in notes} == {
        "Rejected"
    }


def test_the_command_checks_estimates_and_prints_the_requests(deployed, capsys):
    assert main(prepare("--dry-run", "--dedup", "exact")) == 0
    out = capsys.readouterr().out
    assert "3 input file(s)" in out and "estimated" in out and "6 MB in 14.2 s" in out
    requests = json.loads(out[out.index("[") :])
    assert [r["ProcessingResources"]["ClusterConfig"]["InstanceCount"] for r in requests] == [2, 1]
    assert [len(r["ProcessingInputs"]) for r in requests] == [3, 4]  # the merge reads the shards to rewrite
    assert main(prepare("--dry-run", count=4)) == 2
    assert "--instance-count 4 is more than the 3 input file(s)" in capsys.readouterr().err
    assert (
        deployed.processing_jobs() == []
        and deployed.s3.list_objects_v2(Bucket=deployed.bucket, Prefix="teams/default/web/")["KeyCount"] == 0
    )
