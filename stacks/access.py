"""The access stack: per team a SageMaker execution role and an ML engineers' policy; the guard rail."""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Stack
from constructs import Construct

from llmtrain.core.environments import EnvironmentConfig, StackOutput
from stacks._outputs import output
from training_constructs import TrainingAccess, TrainingAccessProps, TrainingNetwork, TrainingStorage
from training_constructs.teams import TeamSpec


class AccessStack(Stack):
    """Wires a ``TrainingAccess`` to the environment's storage and network, one team per ``TeamSpec``.

    Attribute ``access`` is the construct (``teams[name].execution_role``, ``guardrail_policy`` ...).
    Outputs: per team `Team<Name>ExecutionRoleArn` and `Team<Name>EngineerPolicyArn`; with a single
    team also the bare `ExecutionRoleArn` and `EngineerPolicyArn`; and `GuardrailPolicyArn`.
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
    ) -> None:
        super().__init__(
            scope,
            construct_id,
            stack_name=config.stack_name("access"),
            description=f"LLM training platform ({config.name}): per-team SageMaker execution roles and "
            "ML engineer policies, the guard rail",
        )
        self.access = TrainingAccess(
            self,
            "Access",
            TrainingAccessProps(
                storage=storage,
                network=network,
                teams=teams,
                max_keep_alive_seconds=config.warm_pools.max_keep_alive_seconds,
                inter_container_traffic_encryption=config.network.inter_container_traffic_encryption,
            ),
        )
        single = len(self.access.teams) == 1
        for name, team in self.access.teams.items():
            for key, value, description in (
                (StackOutput.EXECUTION_ROLE_ARN, team.execution_role.role_arn,
                 f"RoleArn for CreateTrainingJob (team {name})"),
                (StackOutput.ENGINEER_POLICY_ARN, team.engineer_policy.managed_policy_arn,
                 f"Attach to team {name}'s ML engineers' roles or permission sets"),
            ):
                output(self, StackOutput.team_output(name, key), value, description)
                if single:  # as before teams, for the clients that read the bare keys
                    output(self, key, value, description)
        output(
            self,
            StackOutput.GUARDRAIL_POLICY_ARN,
            self.access.guardrail_policy.managed_policy_arn,
            "Attach to any other role that calls SageMaker directly",
        )
