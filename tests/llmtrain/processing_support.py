"""SageMaker Processing jobs, simulated as SageMaker runs them, for the preparation state machine's
`sagemaker:createProcessingJob.sync` (tests/llmtrain/launcher_harness.py) and the CLI's status.

CreateProcessingJob goes through a botocore client, which validates the request against SageMaker's
API model (types, required fields), and through `llmtrain.core.validate.input_problems` (the model's
min/max/pattern/enum metadata, which botocore's validator leaves out), into moto's SageMaker. Then the
job runs here, one instance after the other, each on a fresh machine with the paths of its `/opt/ml`:

- each input is downloaded as its `S3DataDistributionType` says: `FullyReplicated`, every object under
  the input's prefix to every instance; `ShardedByS3Key`, the objects (sorted by key) dealt to the
  instances in turn, instance i getting objects i, i + N, ...;
- SageMaker's resource config (`current_host`, `hosts`) is written for the instance, and the request's
  container arguments are run as the container would (`python -m training_jobs.prepare_data ...`, the
  container's paths mapped to the machine's folders; the code is the archive the job downloaded);
- the outputs are uploaded to their S3 URIs (both modes, at the instance's end: the simulation has no
  time within an instance).

An instance listed in `lost` (by job number, from 0, and instance index) never runs: the job ends
Failed as SageMaker reports a lost instance. moto's description lacks the job's cluster and times:
the simulation adds the request's ProcessingResources and an hour's run, so costs are computed as for
a real job.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
from moto.sagemaker.models import sagemaker_backends

from llmtrain.core.s3_uris import parse_s3_uri
from llmtrain.core.validate import input_problems
from training_jobs import prepare_data

ACCOUNT, REGION = "123456789012", "us-east-1"
LOST_REASON = "AlgorithmError: an instance was lost"


class ProcessingJobEnded(Exception):
    """A .sync processing job ended Failed or Stopped."""

    def __init__(self, description: dict[str, Any]):
        super().__init__(description.get("FailureReason"))
        self.description = description


class SimulatedProcessingJobs:
    """Processing jobs run here as SageMaker would run them (the module says how)."""

    def __init__(self, folder: Path, lost: set[tuple[int, int]] = frozenset()) -> None:
        self.folder = folder
        self.lost = set(lost)
        self.requests: list[dict[str, Any]] = []
        self.instance_units: dict[str, list[list[str]]] = {}
        self.instance_inputs: dict[str, list[dict[str, list[str]]]] = {}

    def create(self, request: dict[str, Any]) -> str:
        problems = input_problems("sagemaker", "CreateProcessingJob", request)
        assert not problems, problems
        s3 = boto3.client("s3", region_name=REGION)
        arn = boto3.client("sagemaker", region_name=REGION).create_processing_job(**request)[
            "ProcessingJobArn"
        ]
        name = request["ProcessingJobName"]
        number = len(self.requests)
        self.requests.append(request)
        cluster = request["ProcessingResources"]["ClusterConfig"]
        count = cluster["InstanceCount"]
        failed = False
        self.instance_units[name], self.instance_inputs[name] = [], []
        for index in range(count):
            if (number, index) in self.lost:
                failed = True  # this instance never ran; the job fails
                self.instance_units[name].append([])
                self.instance_inputs[name].append({})
                continue
            self._run_instance(s3, request, name, index, count)
        job = sagemaker_backends[ACCOUNT][REGION].processing_jobs[name]
        job.processing_resources = request["ProcessingResources"]
        job.processing_start_time = datetime(2026, 11, 28, 12, tzinfo=UTC)
        job.processing_end_time = datetime(2026, 11, 28, 13, tzinfo=UTC)
        job.processing_job_status = "Failed" if failed else "Completed"
        if failed:
            job.failure_reason = LOST_REASON
        return arn

    def finish(self, name: str) -> dict[str, Any]:
        """The job's description once ended (it has: the instances ran in `create`)."""
        description = boto3.client("sagemaker", region_name=REGION).describe_processing_job(
            ProcessingJobName=name
        )
        description = json.loads(
            json.dumps(description, default=lambda v: v.isoformat() if isinstance(v, datetime) else str(v))
        )
        description.pop("ResponseMetadata", None)
        if description["ProcessingJobStatus"] != "Completed":
            raise ProcessingJobEnded(description)
        return description

    def _run_instance(self, s3, request: dict[str, Any], name: str, index: int, count: int) -> None:
        root = self.folder / "machine"  # a fresh machine, with the paths of every instance's /opt/ml
        shutil.rmtree(root, ignore_errors=True)
        received: dict[str, list[str]] = {}
        for item in request["ProcessingInputs"]:
            spec = item["S3Input"]
            received[item["InputName"]] = self._download(
                s3,
                spec["S3Uri"],
                root / spec["LocalPath"].lstrip("/"),
                spec["S3DataDistributionType"],
                index,
                count,
            )
        self.instance_inputs[name].append(received)
        code = next(root.glob("opt/ml/processing/input/code/*.tar.gz"))
        with tarfile.open(fileobj=io.BytesIO(code.read_bytes())) as tar:  # the code the job would unpack
            assert "training_jobs/data_pipeline/instances.py" in tar.getnames()
        config = root / "resourceconfig.json"
        hosts = [f"algo-{i + 1}" for i in range(count)]
        config.write_text(json.dumps({"current_host": hosts[index], "hosts": hosts}))
        arguments = []
        for argument in request["AppSpecification"]["ContainerArguments"]:
            arguments.append(
                str(root / argument.lstrip("/")) if argument.startswith("/opt/ml/") else argument
            )
            if argument == "--host-config":
                arguments.append(str(config))
        assert prepare_data.main([*arguments, "--workers", "1"]) == 0
        for item in request["ProcessingOutputConfig"]["Outputs"]:
            self._upload(s3, root / item["S3Output"]["LocalPath"].lstrip("/"), item["S3Output"]["S3Uri"])
        units = root / "opt/ml/processing/output/state/units"
        self.instance_units[name].append(sorted(p.name for p in units.iterdir()) if units.is_dir() else [])

    @staticmethod
    def _download(s3, uri: str, local: Path, distribution: str, index: int, count: int) -> list[str]:
        location = parse_s3_uri(uri)
        keys = sorted(
            obj["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket=location.bucket, Prefix=location.key
            )
            for obj in page.get("Contents", [])
        )
        if distribution == "ShardedByS3Key":
            keys = keys[index::count]
        else:
            assert distribution == "FullyReplicated", distribution
        for key in keys:
            target = (
                local / key[len(location.key) :].lstrip("/")
                if not uri.endswith(".tar.gz")
                else local / Path(key).name
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(location.bucket, key, str(target))
        local.mkdir(parents=True, exist_ok=True)
        return keys

    @staticmethod
    def _upload(s3, local: Path, uri: str) -> None:
        location = parse_s3_uri(uri)
        for path in sorted(local.rglob("*")):
            if path.is_file():
                s3.upload_file(str(path), location.bucket, location.key + path.relative_to(local).as_posix())
