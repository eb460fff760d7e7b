"""The access stack: the SageMaker execution role, the ML engineers' policy, the warm-pool guard rail."""

from __future__ import annotations

from aws_cdk import Stack
from constructs import Construct

from llmtrain.environments import EnvironmentConfig, StackOutput
from stacks._outputs import output
from training_constructs import TrainingAccess, TrainingNetwork, TrainingStorage


class AccessStack(Stack):
    """Wires a ``TrainingAccess`` to the environment's storage and network.

    Attribute ``access`` is the construct (``execution_role``, ``engineer_policy`` ...).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: EnvironmentConfig,
        network: TrainingNetwork,
        storage: TrainingStorage,
    ) -> None:
        super().__init__(
            scope,
            construct_id,
            stack_name=config.stack_name("access"),
            description=f"LLM training platform ({config.name}): SageMaker execution role, "
            "ML engineer policy, warm-pool guard rail",
        )
        self.access = TrainingAccess(
            self,
            "Access",
            datasets_bucket=storage.datasets_bucket,
            checkpoints_bucket=storage.checkpoints_bucket,
            artifacts_bucket=storage.artifacts_bucket,
            code_bucket=storage.code_bucket,
            key=storage.key,
            job_name_prefix=config.job_name_prefix,
            max_keep_alive_seconds=config.warm_pools.max_keep_alive_seconds,
            subnets=network.subnets,
            security_groups=[network.security_group],
        )
        output(
            self,
            StackOutput.EXECUTION_ROLE_ARN,
            self.access.execution_role.role_arn,
            "RoleArn for CreateTrainingJob",
        )
        output(
            self,
            StackOutput.ENGINEER_POLICY_ARN,
            self.access.engineer_policy.managed_policy_arn,
            "Attach to ML engineers' roles or permission sets",
        )
        output(
            self,
            StackOutput.WARM_POOL_GUARDRAIL_POLICY_ARN,
            self.access.warm_pool_guardrail_policy.managed_policy_arn,
            "Attach to any other role that calls SageMaker directly",
        )
