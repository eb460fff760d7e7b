"""Security-check acknowledgments: every cdk-nag and checkov finding left in a construct is
acknowledged here, next to the resource, with its reason.

checkov reads skips from a resource's CloudFormation metadata (`Metadata.checkov.skip`, each with
its check id and comment); :func:`acknowledge_checkov` writes them.

cdk-nag v3 reads CDK's native ``Validations`` acknowledgments. A rule that reports several findings
on one resource (``AwsSolutions-IAM5``, wildcard permissions) needs one acknowledgment per finding,
named after the wildcard as it appears in the synthesized template, e.g.
``AwsSolutions-IAM5[Resource::<Bucket1234.Arn>/*]``. Those names contain logical IDs and, across
stacks, export names that only exist once CDK has resolved the references, so
:func:`acknowledge_wildcards` attaches the reason to the policy *statement* instead and names the
findings just before cdk-nag runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import jsii
from aws_cdk import Acknowledgment, CfnResource, Stack, Validations
from aws_cdk import aws_iam as iam
from constructs import IConstruct, IValidation

_MIN_REASON = 20


def acknowledge(scope: IConstruct, rule_id: str, reason: str) -> None:
    """Acknowledge one cdk-nag finding on ``scope`` (and its children) with a specific reason."""
    if len(reason) < _MIN_REASON:
        raise ValueError(f"acknowledgment of {rule_id} needs a specific reason, got {reason!r}")
    Validations.of(scope).acknowledge(Acknowledgment(id=rule_id, reason=reason))


def acknowledge_wildcards(scope: IConstruct, reasons: Mapping[str, str]) -> None:
    """Acknowledge the AwsSolutions-IAM5 findings of chosen statements in the policies under ``scope``.

    ``reasons`` maps a statement to why its wildcard is needed. A key matches a statement whose
    ``Sid`` equals it or, for statements CDK writes without a Sid (``bucket.grant_read``), one of
    whose actions equals it. A finding is acknowledged only when every Allow statement that
    produces it has a reason, so a new wildcard elsewhere in the same policy still fails cdk-nag.
    ``reasons`` is read when cdk-nag runs: a dict the caller keeps may gain the reasons of statements
    added later (each checked with :func:`checked_reasons`; ``TeamAccess`` does this).
    """
    checked_reasons(reasons)
    scope.node.add_validation(_WildcardAcknowledger(scope, reasons))


def checked_reasons(reasons: Mapping[str, str]) -> Mapping[str, str]:
    """``reasons``, once each is specific enough to be an acknowledgment's (ValueError otherwise)."""
    for key, reason in reasons.items():
        if len(reason) < _MIN_REASON:
            raise ValueError(f"the wildcard of statement {key} needs a specific reason, got {reason!r}")
    return reasons


def acknowledge_checkov(
    scope: IConstruct, reasons: Mapping[str, str], *, resource_type: str | None = None
) -> None:
    """Skip checkov checks (id -> specific reason) on the CloudFormation resources under ``scope``
    (only those of ``resource_type`` when given): written into each resource's metadata."""
    for check_id, reason in reasons.items():
        if len(reason) < _MIN_REASON:
            raise ValueError(f"the checkov skip of {check_id} needs a specific reason, got {reason!r}")
    for node in scope.node.find_all():
        if not isinstance(node, CfnResource):
            continue
        if resource_type is not None and node.cfn_resource_type != resource_type:
            continue
        skips = {skip["id"]: skip for skip in (node.get_metadata("checkov") or {}).get("skip", [])}
        skips.update({check_id: {"id": check_id, "comment": reason} for check_id, reason in reasons.items()})
        node.add_metadata("checkov", {"skip": list(skips.values())})


# checkov's Lambda checks, with why the platform's functions (and aws-cdk-lib's providers) do not
# follow them: every function runs for a short call whose caller handles its failure. A function
# invoked asynchronously (the job-events function, by EventBridge) has a dead-letter queue instead.
DEAD_LETTER_CHECK = "CKV_AWS_116"
FUNCTION_CHECKOV_REASONS = {
    "CKV_AWS_115": "reserved concurrency would take from the account's unreserved pool (as low as 10 in new "
    "accounts, which fails the deployment); each call is one step of a run or one scheduled pass",
    "CKV_AWS_116": "invoked synchronously (Step Functions, CloudFormation) or on a schedule whose next run "
    "repeats the work: a dead-letter queue would hold nothing to act on",
    "CKV_AWS_117": "calls only AWS APIs (SageMaker, Service Quotas, CloudWatch, S3); it reaches no resource "
    "inside the training VPC, whose isolated subnets have no route for it",
    "CKV_AWS_173": "the environment holds no secret (resource names and ARNs); Lambda encrypts it at rest "
    "with its AWS managed key",
}


def wildcard_findings(statement: Mapping[str, Any]) -> list[str]:
    """The AwsSolutions-IAM5 findings of one resolved Allow statement, named as cdk-nag names them."""
    if statement.get("Effect") != "Allow":
        return []
    findings = [f"Action::{action}" for action in _as_list(statement.get("Action")) if "*" in action]
    for resource in _as_list(statement.get("Resource")):
        flat = flatten_reference(resource)
        if "*" in flat:
            findings.append(f"Resource::{flat}")
    return findings


def flatten_reference(node: Any) -> str:
    """A CloudFormation value as cdk-nag writes it in findings (``<Logical.Arn>``, ``<AWS::Partition>``)."""
    if node is None:
        return ""
    if isinstance(node, str):
        return node.replace("${", "<").replace("}", ">")
    if isinstance(node, dict):
        if "Fn::Join" in node:
            delimiter, items = node["Fn::Join"]
            return delimiter.join(flatten_reference(item) for item in items)
        if "Fn::Sub" in node:
            return flatten_reference(node["Fn::Sub"])
        if "Fn::GetAtt" in node:
            resource, attribute = node["Fn::GetAtt"]
            return f"<{flatten_reference(resource)}.{flatten_reference(attribute)}>"
        if "Fn::ImportValue" in node:
            return flatten_reference(node["Fn::ImportValue"])
        if "Ref" in node:
            return f"<{flatten_reference(node['Ref'])}>"
    return json.dumps(node, separators=(",", ":"))


@jsii.implements(IValidation)
class _WildcardAcknowledger:
    """Runs as a construct validation: after CDK resolved cross-stack references, before cdk-nag."""

    def __init__(self, scope: IConstruct, reasons: Mapping[str, str]) -> None:
        self._scope = scope
        self._reasons = reasons

    def validate(self) -> list[str]:
        for resource in _policy_resources(self._scope):
            for finding, reason in self._acknowledgeable(_statements(resource)).items():
                acknowledge(resource, f"AwsSolutions-IAM5[{finding}]", reason)
        return []

    def _acknowledgeable(self, statements: list[Mapping[str, Any]]) -> dict[str, str]:
        reasons: dict[str, str] = {}
        unexplained: set[str] = set()
        for statement in statements:
            reason = self._reason_for(statement)
            for finding in wildcard_findings(statement):
                if reason is None:
                    unexplained.add(finding)
                else:
                    reasons.setdefault(finding, reason)
        return {finding: reason for finding, reason in reasons.items() if finding not in unexplained}

    def _reason_for(self, statement: Mapping[str, Any]) -> str | None:
        sid = statement.get("Sid")
        if sid in self._reasons:
            return self._reasons[sid]
        for action in _as_list(statement.get("Action")):
            if action in self._reasons:
                return self._reasons[action]
        return None


def _policy_resources(scope: IConstruct) -> Iterator[CfnResource]:
    for node in scope.node.find_all():
        if isinstance(node, iam.CfnPolicy | iam.CfnManagedPolicy | iam.CfnRole):
            yield node


def _statements(resource: CfnResource) -> list[Mapping[str, Any]]:
    stack = Stack.of(resource)
    documents = []
    if isinstance(resource, iam.CfnRole):
        for policy in stack.resolve(resource.policies) or []:
            documents.append(policy.get("PolicyDocument") or policy.get("policyDocument") or {})
    else:
        documents.append(stack.resolve(resource.policy_document) or {})
    return [statement for document in documents for statement in _as_list(document.get("Statement"))]


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]
