"""The operations stack: quota alarms, the warm-pool reaper, job events and the dashboard."""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Stack
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from llmtrain.core.catalog import Catalog
from llmtrain.core.environments import EnvironmentConfig
from stacks._outputs import output
from training_constructs.operations import TemplateMetrics, TrainingOperations, TrainingOperationsProps

DASHBOARD_OUTPUT = "OperationsDashboardName"
TOPIC_OUTPUT = "OperationsTopicArn"


class OperationsStack(Stack):
    """Wires a ``TrainingOperations`` to the environment's configuration and its enabled templates.

    The instance types watched are those the enabled templates may run on (every version's own type,
    fallbacks and allowed overrides). Alarms and job notifications go to ``notification_topic`` (the
    launcher's) when given, else to a topic of this stack subscribed to the environment's e-mail.

    Attribute ``operations`` is the construct.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: EnvironmentConfig,
        catalog: Catalog | None = None,
        notification_topic: sns.ITopic | None = None,
        state_machines: Sequence[sfn.IStateMachine] = (),
    ) -> None:
        super().__init__(
            scope,
            construct_id,
            stack_name=config.stack_name("operations"),
            description=f"LLM training platform ({config.name}): quota alarms, warm-pool reaper, job events, "
            "operations dashboard",
        )
        catalog = catalog or Catalog.load()
        self.operations = TrainingOperations(
            self,
            "Operations",
            TrainingOperationsProps(
                environment_name=config.name,
                job_name_prefix=config.job_name_prefix,
                instance_types=catalog.instance_types(config.enabled_templates),
                quota_alarm_threshold_percent=config.quotas.alarm_threshold_percent,
                warm_pool_idle_budget_seconds=config.warm_pools.idle_budget_seconds,
                existing_topic=notification_topic,
                notification_email=None if notification_topic else config.notifications.email,
                state_machines=state_machines,
                template_metrics=latest_template_metrics(catalog, config.enabled_templates),
                training_log_retention_days=config.logs.training_jobs_retention_days,
            ),
        )
        output(self, DASHBOARD_OUTPUT, self.operations.dashboard.dashboard_name, "CloudWatch dashboard")
        if notification_topic is None:  # a given topic is its own stack's output already
            output(
                self, TOPIC_OUTPUT, self.operations.topic.topic_arn, "Where alarms and job notifications go"
            )


def latest_template_metrics(catalog: Catalog, enabled: tuple[str, ...]) -> list[TemplateMetrics]:
    """Loss and tokens/s metric names per enabled template, from its latest version's definitions."""
    return [
        TemplateMetrics.from_metric_definitions(name, {m.name: m.regex for m in catalog.latest(name).metrics})
        for name in sorted(enabled)
    ]
