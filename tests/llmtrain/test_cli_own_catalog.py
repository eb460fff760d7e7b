"""A team's own catalog from the CLI: another account's CDK app (examples/cdk_consumer) registers a
template of its own catalog beside one of the platform's; its engineer, with only the CLI, lists and
starts it.

The example's stacks are synthesized here for moto's account and region, its launcher runs in moto
(tests/llmtrain/launcher_harness.py: the real definition and handlers), and the environment's record
is what its synthesized `DeployedEnvironmentRecord` writes, resolved as CloudFormation would and put
into moto's SSM. No file of the example's catalog is read by the CLI.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import aws_cdk as cdk
import boto3
import pytest
from launcher_harness import ACCOUNT, REGION, JobOutcome, launcher_in_moto
from test_cli_deployed import _deploy_record, llmtrain

from llmtrain.core.catalog import Catalog
from llmtrain.core.deployed import from_parameters

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cdk_consumer"
STACK = "AcmeTraining"


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    """The example's app for moto's account and region: its assembly folder, launcher stack, templates."""
    module_path = pytest.MonkeyPatch()
    module_path.syspath_prepend(str(EXAMPLE))  # acme_training, the app's stacks
    try:
        spec = importlib.util.spec_from_file_location("acme_app", EXAMPLE / "app.py")
        acme_app = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(acme_app)
        from acme_training import AcmeDataStack, AcmeTrainingStack

        environment = dataclasses.replace(
            acme_app.acme_environment(ACCOUNT), region=REGION, availability_zones=("us-east-1a", "us-east-1b")
        )
        app = cdk.App(outdir=str(tmp_path_factory.mktemp("cdk.out")))
        where = cdk.Environment(account=ACCOUNT, region=REGION)
        data = AcmeDataStack(app, "AcmeTrainingData", environment=environment, env=where)
        AcmeTrainingStack(app, STACK, environment=environment, storage=data.storage, env=where)
        assembly = app.synth()
    finally:
        module_path.undo()
    return Path(assembly.directory), STACK, {stack.stack_name: stack.template for stack in assembly.stacks}


def test_a_team_lists_and_starts_a_template_of_its_own_catalog(synthesized, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no catalog folder here: the CLI reads the record
    own = Catalog.load(root=EXAMPLE / "templates", repo_root=EXAMPLE).get("acme-charlm", "1.0.0")
    assert "acme-charlm" not in Catalog.load().names()
    _, stack, templates = synthesized
    with launcher_in_moto(*synthesized, outcomes=[JobOutcome()]) as harness:
        values = _deploy_record(harness, stack, templates)
        assert "/llmtrain/acme/templates/acme-charlm/1.0.0" in values
        record = from_parameters("acme", values)
        assert record.own_templates == {own.ref: own}  # the spec, as the team's catalog holds it
        team = record.team("research")
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=team.datasets_bucket)
        s3.put_object(Bucket=team.datasets_bucket, Key="teams/research/text/train/notes.txt", Body=b"hello")

        code, out, err = llmtrain(capsys, "templates", "--env", "acme", "--team", "research", "--json")
        assert code == 0, err
        rows = {(row["name"], row["version"]): row for row in json.loads(out)}
        assert rows["acme-charlm", "1.0.0"]["catalog"] == "own" and rows["acme-charlm", "1.0.0"]["latest"]
        assert rows["gpt2-ddp", "1.1.0"]["catalog"] == "platform"
        code, out, _ = llmtrain(capsys, "templates", "--env", "acme", "--team", "research")
        lines = out.splitlines()
        assert any(line.startswith("acme-charlm") and line.endswith("own catalog") for line in lines)

        code, _, err = llmtrain(capsys, "start", "acme-charlm@2.0.0", "--run-name", "r1", "--env", "acme")
        assert code == 2 and "template 'acme-charlm' has no version '2.0.0'; available: 1.0.0" in err
        code, _, err = llmtrain(capsys, "start", "acme-charlm", "--run-name", "r1", "--env", "acme",
                                "--set", "max_steps=lots")
        assert code == 2 and "max_steps" in err and not harness.jobs.requests

        code, out, err = llmtrain(capsys, "start", "acme-charlm", "--run-name", "r1", "--env", "acme",
                                  "--set", "max_steps=50")
        assert code == 0, err
        assert "started run r1 (acme-charlm@1.0.0)" in out
        run = harness.wait(out.split("execution ", 1)[1].split()[0])
        assert run.status == "SUCCEEDED", run.cause
        assert run.output["template"] == "acme-charlm@1.0.0"
        (request,) = harness.jobs.requests
        tags = {tag["Key"]: tag["Value"] for tag in request["Tags"]}
        assert (tags["llmtrain:template"], tags["llmtrain:template-version"]) == ("acme-charlm", "1.0.0")
        assert json.loads(request["HyperParameters"]["max_steps"]) == 50
