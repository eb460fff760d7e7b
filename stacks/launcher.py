"""The launcher stack (stateless): the job-template registry, the launcher state machine, its topic."""

from __future__ import annotations

from aws_cdk import ArnFormat, Stack
from constructs import Construct

from llmtrain.catalog import Catalog
from llmtrain.environments import EnvironmentConfig
from llmtrain.launcher_client import LAUNCHER_STACK_PART, LauncherOutput
from stacks._outputs import output
from training_constructs import TrainingAccess, TrainingNetwork, TrainingStorage
from training_constructs.job_template import JobTemplate
from training_constructs.launcher import TrainingLauncher


def state_machine_name(config: EnvironmentConfig) -> str:
    """A fixed name, so other stacks (the engineers' policy) can build its ARN without a reference."""
    return f"{config.job_name_prefix}-launcher"


def state_machine_arn(stack: Stack, config: EnvironmentConfig) -> str:
    """The launcher's ARN as seen from `stack` (same account and region), from its fixed name."""
    return stack.format_arn(
        service="states",
        resource="stateMachine",
        resource_name=state_machine_name(config),
        arn_format=ArnFormat.COLON_RESOURCE_NAME,
    )


class LauncherStack(Stack):
    """Wires a ``TrainingLauncher`` with one ``JobTemplate`` per version of every enabled template.

    Every version stays runnable (`name@1.0.0`, `name@latest`): each one's code is uploaded to the
    code bucket and its YAML bundled into the launcher's registry. Attributes: ``launcher`` (the
    construct), ``job_templates`` (by `name@version`).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: EnvironmentConfig,
        network: TrainingNetwork,
        storage: TrainingStorage,
        access: TrainingAccess,
        catalog: Catalog | None = None,
    ) -> None:
        super().__init__(
            scope,
            construct_id,
            stack_name=config.stack_name(LAUNCHER_STACK_PART),
            description=f"LLM training platform ({config.name}): job-template registry, "
            "launcher state machine, run notifications",
        )
        catalog = catalog or Catalog.load()
        cap = config.warm_pools.max_keep_alive_seconds
        self.job_templates = {
            f"{name}@{version}": JobTemplate(
                self,
                f"Template-{name}-{version}",
                template=f"{name}@{version}",
                catalog=catalog,
                code_bucket=storage.code_bucket,
                encryption_key=storage.key,
                warm_pool_cap_seconds=cap,
            )
            for name in config.enabled_templates
            for version in catalog.versions(name)
        }
        self.launcher = TrainingLauncher(
            self,
            "Launcher",
            job_templates=list(self.job_templates.values()),
            execution_role=access.execution_role,
            datasets_bucket=storage.datasets_bucket,
            checkpoints_bucket=storage.checkpoints_bucket,
            artifacts_bucket=storage.artifacts_bucket,
            code_bucket=storage.code_bucket,
            data_key=storage.key,
            subnets=network.subnets,
            security_groups=[network.security_group],
            environment_name=config.name,
            job_name_prefix=config.job_name_prefix,
            warm_pool_cap_seconds=cap,
            state_machine_name=state_machine_name(config),
            notification_email=config.notifications.email,
            platform_features=config.platform_features(),
        )
        output(
            self,
            LauncherOutput.STATE_MACHINE_ARN,
            self.launcher.state_machine.state_machine_arn,
            "Start runs here (llmtrain start finds it by this output)",
        )
        output(
            self,
            LauncherOutput.TOPIC_ARN,
            self.launcher.topic.topic_arn,
            "Run summaries (success and failure) are published here",
        )
