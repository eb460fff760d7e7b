"""The launcher stack (stateless): the job-template registry, and per team a launcher and its topic."""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import ArnFormat, Stack
from constructs import Construct

from llmtrain.core.catalog import Catalog
from llmtrain.core.deployed import LAUNCHER_STACK_PART, LauncherOutput
from llmtrain.core.environments import EnvironmentConfig, StackOutput
from stacks._outputs import output
from training_constructs import TrainingAccess, TrainingNetwork, TrainingStorage
from training_constructs.deployed_environment import DeployedEnvironmentRecord, DeployedEnvironmentRecordProps
from training_constructs.job_template import JobTemplate, JobTemplateProps
from training_constructs.launcher import TrainingLauncher, TrainingLauncherProps
from training_constructs.preparation_launcher import PreparationLauncher, PreparationLauncherProps
from training_constructs.queues import JobQueueSpec, TrainingQueues, TrainingQueuesProps
from training_constructs.teams import TeamSpec


def state_machine_name(team: TeamSpec) -> str:
    """A fixed name, so other stacks (the engineers' policy) can build its ARN without a reference."""
    return f"{team.job_name_prefix}-launcher"


def preparations_state_machine_name(team: TeamSpec) -> str:
    """The fixed name of a team's preparation state machine (`llmtrain data prepare --cloud`)."""
    return f"{team.job_name_prefix}-preparations"


def state_machine_arn(stack: Stack, team: TeamSpec, name: str | None = None) -> str:
    """A team's launcher's ARN as seen from `stack` (same account and region), from its fixed name (or
    `name`: its preparation state machine's)."""
    return stack.format_arn(
        service="states",
        resource="stateMachine",
        resource_name=name or state_machine_name(team),
        arn_format=ArnFormat.COLON_RESOURCE_NAME,
    )


class LauncherStack(Stack):
    """Wires one ``TrainingLauncher`` per team, sharing one ``JobTemplate`` per version of every
    enabled template.

    Every version stays runnable (`name@1.0.0`, `name@latest`): each one's code is uploaded to the
    code bucket once, and each team's registry holds the versions of the templates it may run. The
    environment's record for the CLI (SSM, `/llmtrain/<env>/`, one entry per team) is written here
    too, readable by every team's engineers' policy.
    Where the environment has queues (`queues:`), its AWS Batch queues are here too: they hold no
    data (a queued run resumes from its checkpoints when started again), and the launchers that
    submit to them are their only users.
    Beside each launcher, the team's ``PreparationLauncher`` (`llmtrain data prepare --cloud`), which
    publishes to the launcher's topic.
    Attributes: ``launchers`` (by team), ``preparations`` (by team), ``job_templates`` (by
    `name@version`), ``queues`` (``TrainingQueues``, or None), ``environment_record``. Outputs: per team
    `Team<Name>StateMachineArn`, `Team<Name>NotificationTopicArn` and `Team<Name>PreparationStateMachineArn`;
    with a single team also the bare `StateMachineArn` and `NotificationTopicArn`.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: EnvironmentConfig,
        teams: Sequence[TeamSpec],
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
            "one launcher state machine per team, run notifications",
        )
        catalog = catalog or Catalog.load()
        self.job_templates = {
            f"{name}@{version}": JobTemplate(
                self,
                f"Template-{name}-{version}",
                JobTemplateProps(
                    template=f"{name}@{version}",
                    storage=storage,
                    catalog=catalog,
                    warm_pool_cap_seconds=config.warm_pools.max_keep_alive_seconds,
                ),
            )
            for name in config.enabled_templates
            for version in catalog.versions(name)
        }
        self.queues = _queues(self, config, teams)
        self.launchers = {
            team.name: self._launcher(config, team, network, storage, access) for team in teams
        }
        self.preparations = {team.name: self._preparations(team, access) for team in teams}
        record = DeployedEnvironmentRecordProps.for_launchers(
            list(self.launchers.values()),
            preparations=self.preparations,
            environment_name=config.name,
            job_name_prefix=config.job_name_prefix,
            enabled_templates=config.enabled_templates,
        )
        self.environment_record = DeployedEnvironmentRecord(self, "DeployedEnvironment", record)
        for team_access in access.teams.values():
            self.environment_record.grant_read(team_access.engineer_policy)

    def _launcher(
        self,
        config: EnvironmentConfig,
        team: TeamSpec,
        network: TrainingNetwork,
        storage: TrainingStorage,
        access: TrainingAccess,
    ) -> TrainingLauncher:
        launcher = TrainingLauncher(
            self,
            f"Launcher{team.construct_suffix}",
            TrainingLauncherProps(
                job_templates=[t for t in self.job_templates.values() if t.spec.name in team.templates],
                team=team,
                execution_role=access.teams[team.name].execution_role,
                storage=storage,
                network=network,
                environment_name=config.name,
                inter_container_traffic_encryption=config.network.inter_container_traffic_encryption,
                state_machine_name=state_machine_name(team),
                platform_features=config.platform_features(),
                queues=self.queues,
            ),
        )
        for key, value, description in (
            (LauncherOutput.STATE_MACHINE_ARN, launcher.state_machine.state_machine_arn,
             f"Team {team.name} starts runs here"),
            (LauncherOutput.TOPIC_ARN, launcher.topic.topic_arn,
             f"Team {team.name}'s run summaries (success and failure) are published here"),
        ):
            output(self, StackOutput.team_output(team.name, key), value, description)
            if len(config.teams) == 1:  # as before teams, for the clients that read the bare keys
                output(self, key, value, description)
        return launcher

    def _preparations(self, team: TeamSpec, access: TrainingAccess) -> PreparationLauncher:
        preparations = PreparationLauncher(
            self,
            f"Preparations{team.construct_suffix}",
            PreparationLauncherProps(
                launcher=self.launchers[team.name],
                guardrail_policy=access.guardrail_policy,
                state_machine_name=preparations_state_machine_name(team),
            ),
        )
        output(self, StackOutput.team_output(team.name, LauncherOutput.PREPARATION_STATE_MACHINE_ARN),
               preparations.state_machine.state_machine_arn,
               f"Team {team.name} starts its cloud data preparations here (llmtrain data prepare --cloud)")
        return preparations


def _queues(stack: Stack, config: EnvironmentConfig, teams: Sequence[TeamSpec]) -> TrainingQueues | None:
    queues = config.queues
    if queues is None:
        return None
    return TrainingQueues(
        stack,
        "Queues",
        TrainingQueuesProps(
            environment_name=config.name,
            teams=teams,
            max_instances=queues.max_instances,
            job_queues=[JobQueueSpec(name=q.name, priority=q.priority) for q in queues.job_queues],
            default_queue=queues.default_queue,
            share_decay_seconds=queues.share_decay_seconds,
            compute_reservation=queues.compute_reservation,
            capacity_wait_seconds=queues.capacity_wait_seconds,
            misconfiguration_wait_seconds=queues.misconfiguration_wait_seconds,
        ),
    )
