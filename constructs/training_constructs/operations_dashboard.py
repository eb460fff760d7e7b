"""The operations dashboard of one environment (part of ``TrainingOperations``).

Rows: launcher executions and job outcomes; quota utilisation per instance type; warm pools;
training metrics live (every running job of the platform) and final values per template; the
guard-rail functions' health.

Why two kinds of training-metric widgets: SageMaker publishes a job's metric definitions under
``/aws/sagemaker/TrainingJobs`` with the one dimension ``Host`` (``<job name>/algo-<n>``), and the
platform's job names (``<prefix>-<run>-a<n>``) do not carry the template. So the live widgets
SEARCH the platform's hosts by metric name, one line per job; the per-template widgets show the
final values that the job-events function republishes with a ``Template`` dimension.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from llmtrain.core import function_settings as functions
from llmtrain.core.failures import FailureClass
from llmtrain.core.function_settings import UsageKind

SAGEMAKER_TRAINING_NAMESPACE = "/aws/sagemaker/TrainingJobs"
# A metric line exactly as the training program prints it (docs/architecture.md, "Metric lines"):
# a template's metric definition that captures the loss (or the tokens/s) from it is that metric.
CONTRACT_METRIC_LINE = (
    "[metrics] step=10 loss=4.123456 lr=3.000e-04 grad_norm=1.2345 tokens_per_sec=12345.6 mfu=0.4123 "
    "step_time=0.532 memory_gb=1.23"
)
_CONTRACT_LOSS, _CONTRACT_TOKENS_PER_SECOND = "4.123456", "12345.6"
_HOUR = Duration.hours(1)
_RED = "#d62728"


@dataclass(frozen=True, kw_only=True)
class TemplateMetrics:
    """The names a template's metric definitions give to the training loss and to tokens/s."""

    template: str
    loss: str | None = None
    tokens_per_second: str | None = None

    @classmethod
    def from_metric_definitions(cls, template: str, definitions: Mapping[str, str]) -> TemplateMetrics:
        """Pick them from ``{name: regex}`` by what each regex captures from the contract's metric line."""
        loss = tokens_per_second = None
        for name, regex in definitions.items():
            match = re.search(regex, CONTRACT_METRIC_LINE)
            captured = match.group(1) if match and match.groups() else None
            if captured == _CONTRACT_LOSS and loss is None:
                loss = name
            elif captured == _CONTRACT_TOKENS_PER_SECOND and tokens_per_second is None:
                tokens_per_second = name
        return cls(template=template, loss=loss, tokens_per_second=tokens_per_second)


@dataclass(frozen=True, kw_only=True)
class OperationsDashboardProps:
    """What the dashboard shows (``TrainingOperations`` validates and passes these)."""

    environment_name: str
    job_name_prefix: str
    instance_types: Sequence[str]
    threshold_percent: float
    quota_interval: Duration
    state_machines: Sequence[sfn.IStateMachine]
    template_metrics: Sequence[TemplateMetrics]
    functions: Sequence[lambda_.IFunction]


class OperationsDashboard(Construct):
    """The CloudWatch dashboard; attribute ``dashboard``."""

    def __init__(self, scope: Construct, construct_id: str, props: OperationsDashboardProps) -> None:
        super().__init__(scope, construct_id)
        self._environment = props.environment_name
        self._prefix = props.job_name_prefix
        self.dashboard = cloudwatch.Dashboard(
            self,
            "Dashboard",
            dashboard_name=f"{props.job_name_prefix}-operations",
            default_interval=Duration.days(1),
        )
        self.dashboard.add_widgets(cloudwatch.TextWidget(markdown=self._header(), width=24, height=2))
        self.dashboard.add_widgets(self._launcher(props.state_machines), *self._job_outcomes())
        for row in _rows(
            [self._quota(t, props.threshold_percent, props.quota_interval) for t in props.instance_types]
            + [self._unreadable_quotas(props.quota_interval)],
            3,
        ):
            self.dashboard.add_widgets(*row)
        self.dashboard.add_widgets(*self._warm_pools(props.quota_interval))
        self.dashboard.add_widgets(*self._live_training(props.template_metrics))
        for row in _rows([self._template(m) for m in props.template_metrics], 3):
            self.dashboard.add_widgets(*row)
        self.dashboard.add_widgets(self._functions(props.functions))

    def _header(self) -> str:
        return (
            f"# LLM training platform: {self._environment}\n"
            f"Guard rails for training jobs named `{self._prefix}-*`: quotas, warm pools, job outcomes. "
            f"Usage against quotas from a shell: `llmtrain quotas --env {self._environment}`."
        )

    def _env_metric(self, namespace: str, name: str, label: str, **dimensions: str) -> cloudwatch.Metric:
        return cloudwatch.Metric(
            namespace=namespace,
            metric_name=name,
            label=label,
            statistic="Sum",
            period=_HOUR,
            dimensions_map={"Environment": self._environment, **dimensions},
        )

    @staticmethod
    def _launcher(state_machines: Sequence[sfn.IStateMachine]) -> cloudwatch.IWidget:
        if not state_machines:
            return cloudwatch.TextWidget(
                markdown="### Launcher executions\nNo launcher state machine was given.", width=8, height=6
            )
        # One line per outcome, summed over the teams' launchers.
        outcomes = {
            "started": "metric_started",
            "succeeded": "metric_succeeded",
            "failed": "metric_failed",
            "aborted": "metric_aborted",
            "timed out": "metric_timed_out",
        }
        if len(state_machines) == 1:
            left = [getattr(state_machines[0], method)(label=label) for label, method in outcomes.items()]
        else:
            left = [
                cloudwatch.MathExpression(
                    # Ids are unique within the graph: one set per outcome. A launcher without runs in a
                    # period has no data point, which would blank the sum: count it as 0.
                    expression=" + ".join(f"FILL({method[7:]}{i}, 0)" for i in range(len(state_machines))),
                    using_metrics={
                        f"{method[7:]}{i}": getattr(machine, method)()
                        for i, machine in enumerate(state_machines)
                    },
                    label=label,
                    period=_HOUR,
                )
                for label, method in outcomes.items()
            ]
        return cloudwatch.GraphWidget(
            title="Launcher executions", width=8, height=6, statistic="Sum", period=_HOUR, left=left
        )

    def _job_outcomes(self) -> list[cloudwatch.IWidget]:
        namespace = functions.JOB_NAMESPACE
        outcomes = [
            self._env_metric(namespace, f"Jobs{state}", state.lower()) for state in functions.END_STATES
        ]
        failures = [
            self._env_metric(namespace, "JobFailures", failure.value, FailureClass=failure.value)
            for failure in FailureClass
        ]
        return [
            cloudwatch.GraphWidget(title="Training jobs ended", width=8, height=6, left=outcomes),
            cloudwatch.GraphWidget(
                title="Job failures by class", width=8, height=6, stacked=True, left=failures
            ),
        ]

    @staticmethod
    def _quota(instance_type: str, threshold_percent: float, period: Duration) -> cloudwatch.IWidget:
        return cloudwatch.GraphWidget(
            title=f"{instance_type}: quota utilisation (%)",
            width=8,
            height=6,
            left=[
                cloudwatch.Metric(
                    namespace=functions.QUOTA_NAMESPACE,
                    metric_name="Utilization",
                    dimensions_map={"InstanceType": instance_type, "UsageKind": kind.value},
                    statistic="Maximum",
                    period=period,
                    label=kind.value,
                )
                for kind in UsageKind
            ],
            left_y_axis=cloudwatch.YAxisProps(min=0),
            left_annotations=[
                cloudwatch.HorizontalAnnotation(value=threshold_percent, label="alarm", color=_RED)
            ],
        )

    @staticmethod
    def _unreadable_quotas(period: Duration) -> cloudwatch.IWidget:
        return cloudwatch.GraphWidget(
            title="Quotas that could not be read",
            width=8,
            height=6,
            left=[
                cloudwatch.Metric(
                    namespace=functions.QUOTA_NAMESPACE,
                    metric_name="UnreadableQuotas",
                    statistic="Maximum",
                    period=period,
                    label="unreadable quotas",
                )
            ],
        )

    def _warm_pools(self, period: Duration) -> list[cloudwatch.IWidget]:
        seconds = int(period.to_seconds())
        in_use = cloudwatch.SearchExpression(
            expression=f"SEARCH('{{{functions.QUOTA_NAMESPACE},InstanceType,UsageKind}} "
            f'MetricName="InstancesInUse" UsageKind="warm-pool"\', \'Maximum\', {seconds})',
            label="",
            period=period,
        )
        namespace = functions.WARM_POOL_NAMESPACE
        retained = self._env_metric(
            namespace, "RetainedBillableSeconds", "retained billable instance-seconds"
        )
        reaped = [
            self._env_metric(namespace, "WarmPoolsOverBudget", "over the idle budget"),
            self._env_metric(namespace, "WarmPoolsEnded", "ended by the reaper"),
        ]
        return [
            cloudwatch.GraphWidget(
                title="Warm-pool instances in use (account)", width=8, height=6, left=[in_use]
            ),
            cloudwatch.GraphWidget(
                title="Warm pools: retained billable time",
                width=8,
                height=6,
                left=[retained.with_(statistic="Maximum", period=period)],
            ),
            cloudwatch.GraphWidget(title="Warm pools: reaper", width=8, height=6, left=reaped),
        ]

    def _live_training(self, template_metrics: Sequence[TemplateMetrics]) -> list[cloudwatch.IWidget]:
        losses = sorted({m.loss for m in template_metrics if m.loss})
        speeds = sorted({m.tokens_per_second for m in template_metrics if m.tokens_per_second})
        return [
            cloudwatch.GraphWidget(
                title=f"Training loss, live ({', '.join(losses) or 'no metric'})",
                width=12,
                height=6,
                left=[self._host_search(name) for name in losses],
            ),
            cloudwatch.GraphWidget(
                title=f"Tokens/s, live ({', '.join(speeds) or 'no metric'})",
                width=12,
                height=6,
                left=[self._host_search(name) for name in speeds],
            ),
        ]

    def _host_search(self, metric_name: str) -> cloudwatch.SearchExpression:
        # Host is "<job name>/algo-<n>": a partial match on the prefix keeps the platform's jobs.
        return cloudwatch.SearchExpression(
            expression=f'SEARCH(\'{{"{SAGEMAKER_TRAINING_NAMESPACE}",Host}} MetricName="{metric_name}" '
            f"Host={self._prefix}', 'Average', 300)",
            label="",
            period=Duration.minutes(5),
        )

    def _template(self, metrics: TemplateMetrics) -> cloudwatch.IWidget:
        def final(name: str | None, label: str) -> list[cloudwatch.IMetric]:
            if name is None:
                return []
            return [
                self._env_metric(
                    functions.TRAINING_NAMESPACE, name, label, Template=metrics.template
                ).with_(statistic="Average")
            ]

        return cloudwatch.GraphWidget(
            title=f"{metrics.template}: final loss and tokens/s per job",
            width=8,
            height=6,
            left=final(metrics.loss, f"final {metrics.loss}"),
            right=final(metrics.tokens_per_second, f"final {metrics.tokens_per_second}"),
        )

    @staticmethod
    def _functions(functions: Sequence[lambda_.IFunction]) -> cloudwatch.IWidget:
        return cloudwatch.GraphWidget(
            title="Guard-rail functions: errors",
            width=24,
            height=4,
            left=[
                f.metric_errors(label=f.node.id, statistic="Sum", period=Duration.minutes(5))
                for f in functions
            ],
        )


def _rows(widgets: list[cloudwatch.IWidget], per_row: int) -> list[list[cloudwatch.IWidget]]:
    return [widgets[start : start + per_row] for start in range(0, len(widgets), per_row)]
