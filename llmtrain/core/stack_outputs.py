"""The CloudFormation outputs the platform's stacks publish, by name: `StackOutput`.

The contract between the stacks (stacks/, which create the outputs) and the ``llmtrain`` CLI (which
reads them with ``DescribeStacks``); a part's stack is ``EnvironmentConfig.stack_name(part)``
(llmtrain.core.environment_model).
"""

from __future__ import annotations


class StackOutput:
    """Names of the CloudFormation outputs the platform stacks publish.

    This is the contract between the stacks (which create the outputs) and the ``llmtrain`` CLI
    (which reads them with ``DescribeStacks`` to build a platform context). The stack that holds
    each output is :meth:`EnvironmentConfig.stack_name` of the part named in the comment.
    """

    # stack "network"
    VPC_ID = "VpcId"
    SUBNET_IDS = "SubnetIds"  # comma-separated
    SECURITY_GROUP_ID = "TrainingSecurityGroupId"
    # stack "storage"
    KEY_ARN = "KeyArn"
    DATASETS_BUCKET = "DatasetsBucketName"
    CHECKPOINTS_BUCKET = "CheckpointsBucketName"
    ARTIFACTS_BUCKET = "ArtifactsBucketName"
    CODE_BUCKET = "CodeBucketName"
    ACCESS_LOGS_BUCKET = "AccessLogsBucketName"
    # stack "access": per team (team_output), and the environment's guard rail
    EXECUTION_ROLE_ARN = "ExecutionRoleArn"
    ENGINEER_POLICY_ARN = "EngineerPolicyArn"
    GUARDRAIL_POLICY_ARN = "GuardrailPolicyArn"

    @staticmethod
    def team_output(team: str, key: str) -> str:
        """A team's output key, e.g. `TeamNlpExecutionRoleArn`. An environment with a single team
        also publishes its outputs under the bare keys (`ExecutionRoleArn`), as before teams."""
        return f"Team{team.capitalize()}{key}"
