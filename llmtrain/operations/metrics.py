"""Publishing the platform's custom CloudWatch metrics (one shape shared by every function)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# PutMetricData takes at most 1000 data points per request; smaller batches keep each request far
# from the 1 MB payload limit too.
_BATCH_SIZE = 500


@dataclass(frozen=True)
class Metric:
    """One data point: a name, a value in a CloudWatch unit, and its dimensions."""

    name: str
    value: float
    unit: str
    dimensions: Mapping[str, str] = field(default_factory=dict)

    def to_datum(self, timestamp: datetime) -> dict[str, Any]:
        return {
            "MetricName": self.name,
            "Value": float(self.value),
            "Unit": self.unit,
            "Timestamp": timestamp,
            "Dimensions": [{"Name": key, "Value": value} for key, value in sorted(self.dimensions.items())],
        }


def put_metrics(cloudwatch: Any, namespace: str, metrics: Sequence[Metric], timestamp: datetime) -> None:
    """Publish `metrics` under `namespace`, all stamped with `timestamp`."""
    data = [metric.to_datum(timestamp) for metric in metrics]
    for start in range(0, len(data), _BATCH_SIZE):
        cloudwatch.put_metric_data(Namespace=namespace, MetricData=data[start : start + _BATCH_SIZE])
