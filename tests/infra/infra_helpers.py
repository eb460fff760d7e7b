"""Helpers for the infra tests: synthesize an app with cdk-nag once, then read its templates."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# jsii (and the CDK CLI the tests run) on the Node.js the project installs (package.json, `make setup`:
# a release they support), first on the PATH as the Makefile puts it, whatever node the system has.
PROJECT_NODE_BIN = Path(__file__).resolve().parents[2] / "node_modules" / ".bin"
os.environ["PATH"] = f"{PROJECT_NODE_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
os.environ.setdefault("CDK_DISABLE_VERSION_CHECK", "1")

import aws_cdk as cdk  # noqa: E402  (after the environment above, which jsii reads at import)
from aws_cdk.assertions import Template  # noqa: E402
from cdk_nag import AwsSolutionsChecks  # noqa: E402
from cfnlint.api import ManualArgs, lint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "config"
PARTS = ("network", "storage", "access", "services", "launcher", "operations")
ENV = cdk.Environment(account="111111111111", region="us-east-1")


@dataclass
class SynthesizedApp:
    """An app synthesized with cdk-nag: its templates, manifests and validation report."""

    app: cdk.App
    outdir: Path
    stacks: dict[tuple[str, str], cdk.Stack]
    synth_error: str | None
    stages: dict[str, Any] = field(default_factory=dict)
    _templates: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def template_json(self, scope: str, part: str) -> dict[str, Any]:
        key = (scope, part)
        if key not in self._templates:
            stack = self.stacks[key]
            stage_dir = Path(cdk.Stage.of(stack).outdir)
            self._templates[key] = json.loads((stage_dir / stack.template_file).read_text())
        return self._templates[key]

    def template(self, scope: str, part: str) -> Template:
        return Template.from_json(self.template_json(scope, part))

    def nag_violations(self) -> list[dict[str, Any]]:
        report = json.loads((self.outdir / "validation-report.json").read_text())
        return [violation for plugin in report["pluginReports"] for violation in plugin["violations"]]

    def all_templates(self):
        for (scope, part), stack in self.stacks.items():
            yield scope, part, stack, self.template_json(scope, part)


def synthesize(app: cdk.App, outdir: Path, stacks: dict[tuple[str, str], cdk.Stack]) -> SynthesizedApp:
    """Synthesize with cdk-nag; a nag failure is recorded (and asserted on by a test), not raised."""
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    try:
        app.synth()
        error = None
    except RuntimeError as failure:  # jsii surfaces "ValidationFailed" as a RuntimeError
        error = str(failure)
    return SynthesizedApp(app=app, outdir=outdir, stacks=stacks, synth_error=error)


def resources_of_type(template_json: dict[str, Any], resource_type: str) -> dict[str, dict[str, Any]]:
    return {
        logical_id: resource
        for logical_id, resource in template_json["Resources"].items()
        if resource["Type"] == resource_type
    }


def statements_by_sid(
    template_json: dict[str, Any], resource_type: str, logical_id_prefix: str = ""
) -> dict[str, dict[str, Any]]:
    """All policy statements with a Sid in resources of one type, keyed by Sid."""
    found: dict[str, dict[str, Any]] = {}
    for logical_id, resource in resources_of_type(template_json, resource_type).items():
        if not logical_id.startswith(logical_id_prefix):
            continue
        for statement in resource["Properties"]["PolicyDocument"]["Statement"]:
            if "Sid" in statement:
                found[statement["Sid"]] = statement
    return found


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


# cfn-lint warnings accepted, by (rule, logical ID prefix), each with its reason.
CFN_LINT_ACCEPTED_WARNINGS = {
    (
        "W3005",
        "CustomVpcRestrictDefaultSGCustomResourceProviderHandler",
    ): "aws-cdk-lib's own provider for restrict_default_security_group declares DependsOn on its role "
    "next to a GetAtt of it; redundant but harmless, and generated code we do not own",
    (
        "W3010",
        "NetworkVpctrainingSubnet",
    ): "the subnets' zones come from config/<env>.yaml on purpose: the app makes no context lookups, "
    "and the platform team picks the zones that hold their accelerator capacity",
    (
        "W3005",
        "CustomCDKBucketDeployment",
    ): "aws-cdk-lib's BucketDeployment provider (the launcher stack's JobTemplates) declares DependsOn on "
    "its role next to a GetAtt of it; redundant but harmless, and generated code we do not own",
    (
        "W3005",
        "AWS679f53fac002430cb0da5b7982bd2287",
    ): "aws-cdk-lib's AwsCustomResource function (the operations stack sets SageMaker's training log "
    "group's retention with it) declares DependsOn on its role next to a GetAtt of it; redundant but "
    "harmless, and generated code we do not own",
}


def cfn_lint_unexplained(template_json: dict[str, Any], region: str) -> list[str]:
    """cfn-lint's findings on a template: every error, and every warning not accepted above."""
    unexplained = []
    for match in lint(json.dumps(template_json), config=ManualArgs(regions=[region])):
        rule = match.rule.id
        logical_id = match.path[1] if len(match.path) > 1 else ""
        accepted = any(
            rule == accepted_rule and str(logical_id).startswith(prefix)
            for accepted_rule, prefix in CFN_LINT_ACCEPTED_WARNINGS
        )
        if rule.startswith("E") or not accepted:
            unexplained.append(f"{rule} {match.message} at {match.path}")
    return unexplained


# checkov lives in its own virtual environment (`make setup`; it pins an older boto3 than ours).
CHECKOV = Path(
    os.environ.get("CHECKOV", ROOT / ".venv-checkov" / "bin" / "checkov")
)


@dataclass(frozen=True)
class CheckovReport:
    """checkov's report on one folder of templates (a cloud assembly)."""

    folder: Path
    report: dict[str, Any]

    @property
    def failed(self) -> list[str]:
        return [f"{self.folder.name}{r['file_path']} {r['resource']} {r['check_id']} {r['check_name']}"
                for r in self.report["results"]["failed_checks"]]

    @property
    def skipped(self) -> list[dict[str, Any]]:
        return self.report["results"]["skipped_checks"]

    @property
    def passed(self) -> int:
        return self.report["summary"]["passed"]

    @property
    def scanned(self) -> list[str]:
        """The templates with a check's result, by file name (not those with no resource checkov checks)."""
        results = self.report["results"]
        checks = [*results["passed_checks"], *results["failed_checks"], *results["skipped_checks"]]
        return sorted({Path(check["file_abs_path"]).name for check in checks})

    @property
    def read_every_resource(self) -> bool:
        """Whether checkov read as many resources as the folder's templates hold (and some)."""
        held = sum(len(json.loads(path.read_text()).get("Resources", {}))
                   for path in self.folder.glob("*.template.json"))
        return held > 0 and self.report["summary"]["resource_count"] == held


def checkov_reports(folders: list[Path]) -> list[CheckovReport]:
    """checkov over each folder of CloudFormation templates in a run of its own, offline (no Prisma
    Cloud download). One run per folder: given several `--directory` flags, checkov 3.3.30 scans only
    the first and reports it once per flag, so the other folders were never read (issue 36)."""
    assert CHECKOV.exists(), f"{CHECKOV} is missing: `make setup` installs checkov into .venv-checkov"
    return [CheckovReport(folder, _checkov(folder)) for folder in folders]


def _checkov(folder: Path) -> dict[str, Any]:
    command = [str(CHECKOV), "--framework", "cloudformation", "--output", "json", "--skip-download",
               "--compact", "--directory", str(folder)]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    assert result.returncode in (0, 1), result.stderr[-2000:]  # 1: checks failed (asserted by the caller)
    report = json.loads(result.stdout)
    [report] = report if isinstance(report, list) else [report]  # the cloudformation framework only
    return report
