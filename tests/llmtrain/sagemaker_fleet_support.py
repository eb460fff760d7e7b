"""Training jobs in moto, in the states the guard-rail functions look at.

moto 5.2.5 creates every training job as Completed, keeps no warm-pool state and has no
UpdateTrainingJob. So jobs are created through the real CreateTrainingJob API (botocore validates the
request against SageMaker's shapes, moto stores it), and then this module:

- moves a job to the state a test needs (InProgress, or ended with an Available warm pool) by
  setting the fields of moto's own job record that DescribeTrainingJob returns;
- adds UpdateTrainingJob to moto's SageMaker responses (`install_update_training_job`), with
  SageMaker's documented effect on warm pools: a KeepAlivePeriodInSeconds of 0 ends an Available
  pool, and a pool that is not Available cannot be updated.

Everything the functions under test do still goes through boto3, botocore and moto's HTTP layer.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from moto.core.responses import ActionResult
from moto.sagemaker.exceptions import ValidationError
from moto.sagemaker.models import sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

ACCOUNT = "123456789012"
REGION = "us-east-1"
ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/training"
IMAGE = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.5.1-gpu-py311"


def install_update_training_job(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Teach moto UpdateTrainingJob; returns the list of requests it receives, in order."""
    requests: list[dict] = []

    def update_training_job(self: SageMakerResponse) -> ActionResult:
        name = self._get_param("TrainingJobName")
        resource_config = self._get_param("ResourceConfig") or {}
        requests.append({"TrainingJobName": name, "ResourceConfig": resource_config})
        job = self.sagemaker_backend.training_jobs.get(name)
        if job is None:
            raise ValidationError(message=f"Could not find training job '{name}'.")
        keep_alive = resource_config.get("KeepAlivePeriodInSeconds")
        if keep_alive is not None:
            pool = getattr(job, "warm_pool_status", None) or {}
            if pool.get("Status") != "Available":
                raise ValidationError(message=f"The warm pool of training job {name} is not Available.")
            job.resource_config["KeepAlivePeriodInSeconds"] = int(keep_alive)
            if int(keep_alive) == 0:
                job.warm_pool_status = {**pool, "Status": "Terminated"}
        return ActionResult({"TrainingJobArn": job.arn})

    monkeypatch.setattr(SageMakerResponse, "update_training_job", update_training_job, raising=False)
    return requests


class TrainingFleet:
    """Creates training jobs in moto and puts them in the states a test needs."""

    def __init__(self, sagemaker_client, account: str = ACCOUNT) -> None:
        self.client = sagemaker_client
        self.account = account

    def _record(self, name: str):
        return sagemaker_backends[self.account][REGION].training_jobs[name]

    def create(
        self,
        name: str,
        *,
        instance_type: str = "ml.p4d.24xlarge",
        count: int = 1,
        spot: bool = False,
        keep_alive_seconds: int = 0,
        instance_groups: list[dict] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        resource_config: dict = {"VolumeSizeInGB": 100, "KeepAlivePeriodInSeconds": keep_alive_seconds}
        if instance_groups:
            resource_config["InstanceGroups"] = instance_groups
        else:
            resource_config.update(InstanceType=instance_type, InstanceCount=count)
        stopping = {"MaxRuntimeInSeconds": 3600, **({"MaxWaitTimeInSeconds": 7200} if spot else {})}
        self.client.create_training_job(
            TrainingJobName=name,
            AlgorithmSpecification={"TrainingImage": IMAGE, "TrainingInputMode": "File"},
            RoleArn=ROLE_ARN,
            OutputDataConfig={"S3OutputPath": "s3://artifacts/out"},
            ResourceConfig=resource_config,
            StoppingCondition=stopping,
            EnableManagedSpotTraining=spot,
            **({"CheckpointConfig": {"S3Uri": f"s3://checkpoints/{name}"}} if spot else {}),
            Tags=[{"Key": key, "Value": value} for key, value in (tags or {}).items()],
        )

    def running(self, name: str, **kwargs) -> None:
        """A job that holds its instances now."""
        self.create(name, **kwargs)
        record = self._record(name)
        record.training_job_status, record.secondary_status = "InProgress", "Training"
        record.training_end_time = None

    def with_available_warm_pool(self, name: str, *, ended_at: datetime, now: datetime, **kwargs) -> None:
        """A job that ended at `ended_at` and whose warm pool has waited since."""
        self.create(name, keep_alive_seconds=kwargs.pop("keep_alive_seconds", 3600), **kwargs)
        record = self._record(name)
        record.training_end_time = ended_at
        record.warm_pool_status = {
            "Status": "Available",
            "ResourceRetainedBillableTimeInSeconds": int((now - ended_at).total_seconds()),
        }

    def with_ended_warm_pool(self, name: str, *, ended_at: datetime, **kwargs) -> None:
        """A job whose warm pool is gone already (it holds nothing)."""
        self.create(name, keep_alive_seconds=600, **kwargs)
        record = self._record(name)
        record.training_end_time = ended_at
        record.warm_pool_status = {"Status": "Terminated", "ResourceRetainedBillableTimeInSeconds": 600}

    def set_final_metrics(self, name: str, values: dict[str, float]) -> None:
        """What SageMaker keeps of a job's metric definitions once it ends: the last value of each."""
        self._record(name).final_metric_data_list = [
            {"MetricName": metric, "Value": value, "Timestamp": self._record(name).training_end_time}
            for metric, value in values.items()
        ]

    def warm_pool_status(self, name: str) -> str | None:
        return (self.client.describe_training_job(TrainingJobName=name).get("WarmPoolStatus") or {}).get(
            "Status"
        )


def minutes_ago(now: datetime, minutes: float) -> datetime:
    return now - timedelta(minutes=minutes)
