"""What a run's training jobs report while they run: their logs and their CloudWatch metrics.

A training job's logs are SageMaker's log group of training jobs (`TRAINING_LOG_GROUP`), one stream
per host; its metrics are SageMaker's CloudWatch metrics (`TRAINING_METRIC_NAMESPACE`, dimension
Host). `llmtrain logs` and `llmtrain status` read them through llmtrain.client.launcher.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from llmtrain.client.aws import explained

TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TRAINING_METRIC_NAMESPACE = "/aws/sagemaker/TrainingJobs"


def _stream_events(logs, stream: str, limit: int) -> list[dict[str, Any]]:
    """The last `limit` events of one log stream of the training jobs (every event when 0), oldest
    first: GetLogEvents from the end of the stream, page by page backwards until enough (or the
    stream's start, where the token comes back unchanged)."""
    events: list[dict[str, Any]] = []
    token = None
    while True:
        page = logs.get_log_events(
            logGroupName=TRAINING_LOG_GROUP,
            logStreamName=stream,
            startFromHead=False,
            **({"nextToken": token} if token else {}),
        )
        events[:0] = [{**event, "logStreamName": stream} for event in page["events"]]
        enough = bool(limit) and len(events) >= limit
        if enough or not page["events"] or page.get("nextBackwardToken") in (None, token):
            return events[-limit:] if limit else events
        token = page["nextBackwardToken"]


def job_log_events(logs, job_name: str, limit: int) -> list[dict[str, Any]]:
    """The last `limit` log events of a training job, all its streams (every event when 0), oldest first."""
    with explained(f"reading the logs of {job_name}"):
        pages = logs.get_paginator("describe_log_streams").paginate(
            logGroupName=TRAINING_LOG_GROUP, logStreamNamePrefix=f"{job_name}/"
        )
        streams = [stream["logStreamName"] for page in pages for stream in page["logStreams"]]
        # GetLogEvents, stream by stream: the engineers' policy grants it on the team's streams
        # only, where FilterLogEvents would be authorized on the whole shared log group.
        events = [event for stream in streams for event in _stream_events(logs, stream, limit)]
    events.sort(key=lambda event: (event["timestamp"], event["logStreamName"]))
    return events[-limit:] if limit else events


def latest_metrics(client, job_name: str) -> dict[str, float]:
    """The latest value of each metric a running job published (SageMaker's CloudWatch metrics,
    dimension Host = <job>/algo-1); empty when there are none yet. `client` makes a boto3
    client of a service (`LauncherClient.client`)."""
    cloudwatch = client("cloudwatch")
    host = {"Name": "Host", "Value": f"{job_name}/algo-1"}
    names = [
        metric["MetricName"]
        for page in cloudwatch.get_paginator("list_metrics").paginate(
            Namespace=TRAINING_METRIC_NAMESPACE, Dimensions=[host]
        )
        for metric in page["Metrics"]
    ]
    if not names:
        return {}
    queries = [
        {
            "Id": f"m{index}",
            "Label": name,
            "ReturnData": True,
            "MetricStat": {
                "Metric": {
                    "Namespace": TRAINING_METRIC_NAMESPACE,
                    "MetricName": name,
                    "Dimensions": [host],
                },
                "Period": 60,
                "Stat": "Average",
            },
        }
        for index, name in enumerate(names[:100])
    ]
    created = client("sagemaker").describe_training_job(TrainingJobName=job_name)["CreationTime"]
    # A minute of slack either side: CloudWatch refuses an empty window, and clocks differ.
    response = cloudwatch.get_metric_data(
        MetricDataQueries=queries,
        StartTime=created - timedelta(minutes=1),
        EndTime=datetime.now(UTC) + timedelta(minutes=1),
        ScanBy="TimestampDescending",
    )
    return {
        result["Label"]: result["Values"][0]
        for result in response["MetricDataResults"]
        if result["Values"]
    }
