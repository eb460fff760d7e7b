"""The construct library's conventions, for every construct it exports: one frozen props record that
validates itself, the platform's storage and network passed whole, `existing_*` for what a caller
brings, and one name for one thing."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pkgutil
import re

import aws_cdk as cdk
import pytest
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk.assertions import Template
from constructs import Construct
from infra_helpers import ENV, ROOT, resources_of_type

import training_constructs
from training_constructs import (
    DeployedEnvironmentRecord,
    DeployedEnvironmentRecordProps,
    ExistingNetwork,
    ExistingStorage,
    JobTemplate,
    JobTemplateProps,
    PreparationLauncher,
    PreparationLauncherProps,
    PropsError,
    TeamSpec,
    TrainingAccess,
    TrainingAccessProps,
    TrainingDebugging,
    TrainingDebuggingProps,
    TrainingLauncher,
    TrainingLauncherProps,
    TrainingMlflow,
    TrainingMlflowProps,
    TrainingNetwork,
    TrainingNetworkProps,
    TrainingOperations,
    TrainingOperationsProps,
    TrainingPackages,
    TrainingPackagesProps,
    TrainingQueues,
    TrainingQueuesProps,
    TrainingStorage,
    TrainingStorageProps,
)
from training_constructs.notifications import encrypted_topic

CONSTRUCTS = {
    name: value
    for name, value in vars(training_constructs).items()
    if name in training_constructs.__all__ and isinstance(value, type) and issubclass(value, Construct)
}
# What a construct used to take one by one, or under another name: the storage and network records
# (`storage.data_key`, `storage.code_bucket`, `network.subnets` ...) and `existing_*` replace them.
ZONES = ("us-east-1a", "us-east-1b")
KEY_ID = "11111111-2222-3333-4444-555555555555"
RETIRED_FIELDS = {
    "key", "data_key", "encryption_key", "log_encryption_key", "flow_log_key", "key_alias",
    "datasets_bucket", "checkpoints_bucket", "artifacts_bucket", "code_bucket",
    "vpc", "subnets", "security_groups", "endpoint_security_group", "notification_topic",
}


def _props_type(construct: type) -> type:
    parameters = list(inspect.signature(construct.__init__).parameters)
    assert parameters == ["self", "scope", "construct_id", "props"], (construct.__name__, parameters)
    # `<Construct>Props`, the README's rule (constructs/README.md, "Conventions"), with no exception.
    return getattr(inspect.getmodule(construct), f"{construct.__name__}Props")


def test_the_library_exports_its_constructs():
    assert sorted(CONSTRUCTS) == [
        "DeployedEnvironmentRecord", "JobTemplate", "PreparationLauncher", "TeamAccess", "TrainingAccess",
        "TrainingDebugging", "TrainingLauncher", "TrainingMlflow", "TrainingNetwork", "TrainingOperations",
        "TrainingPackages", "TrainingQueues", "TrainingStorage",
    ]


@pytest.mark.parametrize("name", sorted(CONSTRUCTS))
def test_every_construct_takes_one_frozen_self_validating_props_record(name):
    props = _props_type(CONSTRUCTS[name])
    assert dataclasses.is_dataclass(props) and props.__dataclass_params__.frozen, props
    assert "__post_init__" in vars(props), f"{props.__name__} validates nothing"
    fields = {field.name for field in dataclasses.fields(props)}
    assert not fields & RETIRED_FIELDS, (props.__name__, fields & RETIRED_FIELDS)
    brought = {f for f in fields if f.startswith("existing_")}
    assert all(f.removeprefix("existing_") not in fields for f in brought), brought


def test_a_construct_refuses_anything_but_its_props_record_naming_it():
    stack = cdk.Stack(cdk.App(), "Wrong", env=ENV)
    with pytest.raises(PropsError, match=r"^TrainingStorage\(props=\.\.\.\): must be a TrainingStorageProps, "
                                         r"got dict"):
        TrainingStorage(stack, "Storage", {"data_key_alias": "alias/x"})
    props = TrainingStorageProps(data_key_alias="alias/x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        props.data_key_alias = "alias/y"


def _imported(stack: cdk.Stack, *, endpoint_group: bool) -> tuple[ExistingStorage, ExistingNetwork]:
    vpc = ec2.Vpc.from_vpc_attributes(
        stack, "Vpc", vpc_id="vpc-0123456789abcdef0", availability_zones=["us-east-1a", "us-east-1b"],
        private_subnet_ids=["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"],
    )
    network = ExistingNetwork(
        vpc=vpc,
        subnets=vpc.private_subnets,
        security_group=ec2.SecurityGroup.from_security_group_id(stack, "Jobs", "sg-0123456789abcdef0"),
        endpoint_security_group=(
            ec2.SecurityGroup.from_security_group_id(stack, "Endpoints", "sg-0fedcba987654321f")
            if endpoint_group
            else None
        ),
    )
    names = ("datasets", "checkpoints", "artifacts", "code")
    buckets = {f"{name}_bucket": s3.Bucket.from_bucket_name(stack, name, f"acme-{name}") for name in names}
    key = kms.Key.from_key_arn(stack, "Key", f"arn:aws:kms:us-east-1:111111111111:key/{KEY_ID}")
    return ExistingStorage(data_key=key, **buckets), network


# A field typed as several of something, as its annotation spells it.
SEQUENCE_TYPE = re.compile(r"^(Sequence|tuple|list)\[")


def _sequence_fields() -> list[tuple[type, str]]:
    """Every sequence-typed field of every record the library exports or a construct takes."""
    exported = {value for name, value in vars(training_constructs).items()
                if name in training_constructs.__all__ and dataclasses.is_dataclass(value)}
    records = exported | {_props_type(construct) for construct in CONSTRUCTS.values()}
    return sorted(((record, field.name) for record in records for field in dataclasses.fields(record)
                   if SEQUENCE_TYPE.match(field.type)), key=lambda pair: (pair[0].__name__, pair[1]))


@pytest.mark.parametrize(("record", "field"), _sequence_fields(), ids=lambda x: getattr(x, "__name__", x))
def test_a_string_where_a_sequence_is_expected_is_refused_naming_the_field(record, field):
    """`availability_zones="us-west-2a,us-west-2b"` is refused by name, never taken apart into
    characters (issue 36, item 12): for every sequence-typed field of every record."""
    required = {
        f.name: () if SEQUENCE_TYPE.match(f.type) else None
        for f in dataclasses.fields(record)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    with pytest.raises(PropsError, match=rf"\({field}=\.\.\.\): must be a list or tuple, got the str "
                                         r"'us-west-2a,us-west-2b' \(one item per element"):
        record(**{**required, field: "us-west-2a,us-west-2b"})


def test_the_network_refuses_zones_given_as_one_string():
    with pytest.raises(PropsError, match=r"^TrainingNetwork\(availability_zones=\.\.\.\): must be a list or "
                                         r"tuple, got the str 'us-west-2a,us-west-2b'"):
        TrainingNetworkProps(availability_zones="us-west-2a,us-west-2b")
    assert TrainingNetworkProps(availability_zones=["us-east-1a", "us-east-1b"]).availability_zones == ZONES


def test_constructs_take_existing_resources_a_caller_brings():
    stack = cdk.Stack(cdk.App(), "Imported", env=ENV)
    storage, network = _imported(stack, endpoint_group=True)
    mirror = TrainingPackages(stack, "Packages", TrainingPackagesProps(environment_name="e", network=network))
    template = JobTemplate(stack, "Gpt2", JobTemplateProps(template="gpt2-ddp@1.1.0", storage=storage))
    json = Template.from_stack(stack).to_json()
    endpoints = resources_of_type(json, "AWS::EC2::VPCEndpoint").values()
    assert sorted(mirror.endpoints) == ["CodeArtifactApi", "CodeArtifactRepositories"]
    assert {e["Properties"]["VpcId"] for e in endpoints} == {"vpc-0123456789abcdef0"}
    assert all(e["Properties"]["SecurityGroupIds"] == ["sg-0fedcba987654321f"] for e in endpoints)
    assert template.code_s3_uri == "s3://acme-code/templates/gpt2-ddp/1.1.0/sourcedir.tar.gz"
    [upload] = resources_of_type(json, "Custom::CDKBucketDeployment").values()
    assert upload["Properties"]["SystemMetadata"]["sse-kms-key-id"].endswith(f":key/{KEY_ID}")
    # A VPC that brings its own endpoints (no endpoint security group): none are added.
    other = cdk.Stack(cdk.App(), "OwnEndpoints", env=ENV)
    _, own = _imported(other, endpoint_group=False)
    assert TrainingDebugging(other, "Debugging", TrainingDebuggingProps(network=own)).endpoints == {}


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ExistingNetwork(vpc=None, subnets=[], security_group=None), r"ExistingNetwork\(subnets="),
        (lambda: TrainingPackagesProps(environment_name="e", network=object()), r"\(network=...\): must be"),
        (lambda: JobTemplateProps(template="gpt2-ddp", storage=None), r"JobTemplate\(storage=...\): must be"),
        (lambda: JobTemplateProps(template="", storage=None), r"JobTemplate\(template=...\)"),
    ],
)
def test_records_refuse_what_is_not_a_platform_resource(build, message):
    with pytest.raises(PropsError, match=message):
        build()


def test_a_launcher_with_an_existing_key_creates_none_and_encrypts_its_topic_and_logs_with_it():
    stack = cdk.Stack(cdk.App(), "Launcher", env=ENV)
    storage = TrainingStorage(stack, "Storage")
    zones = ["us-east-1a", "us-east-1b"]
    network = TrainingNetwork(stack, "Network", TrainingNetworkProps(availability_zones=zones))
    brought = kms.Key(stack, "Brought")
    team = TeamSpec(
        name="a", job_name_prefix="acme-a", instance_types=("ml.g5.12xlarge",), max_keep_alive_seconds=0
    )
    gpt2 = JobTemplate(stack, "Gpt2", JobTemplateProps(template="gpt2-ddp@1.1.0", storage=storage))
    role = iam.Role(stack, "Role", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"))
    launcher = TrainingLauncher(
        stack,
        "Launcher",
        TrainingLauncherProps(
            job_templates=[gpt2],
            team=team,
            execution_role=role,
            storage=storage,
            network=network,
            environment_name="acme",
            existing_encryption_key=brought,
        ),
    )
    assert launcher.encryption_key is brought and launcher.node.try_find_child("Key") is None
    json = Template.from_stack(stack).to_json()
    brought_arn = {"Fn::GetAtt": [stack.get_logical_id(brought.node.default_child), "Arn"]}
    [topic] = resources_of_type(json, "AWS::SNS::Topic").values()
    assert topic["Properties"]["KmsMasterKeyId"] == brought_arn
    groups = resources_of_type(json, "AWS::Logs::LogGroup")
    launcher_logs = [group for logical_id, group in groups.items() if logical_id.startswith("Launcher")]
    assert launcher_logs and all(g["Properties"]["KmsKeyId"] == brought_arn for g in launcher_logs)


def test_the_topic_helper_lets_alarms_use_a_key_it_creates_and_leaves_a_given_key_alone():
    stack = cdk.Stack(cdk.App(), "Topics", env=ENV)
    created = encrypted_topic(
        Construct(stack, "Own"), display_name="own", email="a@example.com", key_id="Key",
        key_description="a topic key of its own",
    )
    given_key = kms.Key(stack, "Given")
    given = encrypted_topic(
        Construct(stack, "Other"), display_name="given", email=None, key_id="Key",
        key_description="unused", existing_key=given_key,
    )
    assert created.created_key is created.key and given.created_key is None and given.key is given_key
    json = Template.from_stack(stack).to_json()
    policies = {
        logical_id: [s.get("Sid") for s in key["Properties"]["KeyPolicy"]["Statement"]]
        for logical_id, key in resources_of_type(json, "AWS::KMS::Key").items()
    }
    assert "CloudWatchAlarmsPublish" in policies[stack.get_logical_id(created.created_key.node.default_child)]
    assert "CloudWatchAlarmsPublish" not in policies[stack.get_logical_id(given_key.node.default_child)]
    assert len(resources_of_type(json, "AWS::SNS::Subscription")) == 1


# -- constructs/README.md tells the truth ------------------------------------------------------------------

README = (ROOT / "constructs" / "README.md").read_text()


def _readme_sections() -> dict[str, str]:
    sections = {}
    for chunk in README.split("\n### `")[1:]:
        name, _, body = chunk.partition("`")
        sections[name] = body.split("\n## ")[0]
    return sections


def _documented_props(section: str) -> list[str]:
    return [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]


def _documented_attributes(section: str) -> list[str]:
    [line] = [line for line in section.splitlines() if line.startswith("**Attributes**:")]
    first_sentence = line.split(". ")[0]
    return [name.split("(")[0] for name in re.findall(r"`([^`]+)`", first_sentence)]


def test_the_readme_documents_every_construct_with_exactly_its_props():
    sections = _readme_sections()
    assert set(sections) == set(CONSTRUCTS) - {"TeamAccess"}  # TrainingAccess builds those, one per team
    for name, section in sections.items():
        fields = [field.name for field in dataclasses.fields(_props_type(CONSTRUCTS[name]))]
        assert _documented_props(section) == fields, name


@pytest.fixture(scope="module")
def one_of_each() -> dict[str, Construct]:
    """One of every construct, in one stack, as the README's examples build them."""
    stack = cdk.Stack(cdk.App(), "Each", env=ENV)
    storage = TrainingStorage(stack, "Storage")
    network = TrainingNetwork(stack, "Network", TrainingNetworkProps(availability_zones=ZONES))
    team = TeamSpec(
        name="a", job_name_prefix="each-a", instance_types=("ml.g5.12xlarge",), max_keep_alive_seconds=0
    )
    access = TrainingAccess(stack, "Access", TrainingAccessProps(
        storage=storage, network=network, teams=[team], max_keep_alive_seconds=0))
    gpt2 = JobTemplate(stack, "Gpt2", JobTemplateProps(template="gpt2-ddp@1.1.0", storage=storage))
    launcher = TrainingLauncher(stack, "Launcher", TrainingLauncherProps(
        job_templates=[gpt2], team=team, execution_role=access.teams["a"].execution_role, storage=storage,
        network=network, environment_name="each"))
    return {
        "TrainingStorage": storage,
        "TrainingNetwork": network,
        "TrainingAccess": access,
        "JobTemplate": gpt2,
        "TrainingLauncher": launcher,
        "PreparationLauncher": PreparationLauncher(stack, "Preparations", PreparationLauncherProps(
            launcher=launcher, guardrail_policy=access.guardrail_policy)),
        "TrainingOperations": TrainingOperations(stack, "Operations", TrainingOperationsProps(
            environment_name="each", job_name_prefix="each", instance_types=["ml.g5.12xlarge"],
            quota_alarm_threshold_percent=80, warm_pool_idle_budget_seconds=0, existing_topic=launcher.topic,
        )),
        "TrainingPackages": TrainingPackages(stack, "Packages", TrainingPackagesProps(
            environment_name="each", network=network)),
        "TrainingMlflow": TrainingMlflow(stack, "Mlflow", TrainingMlflowProps(
            environment_name="each", size="Small", storage=storage, network=network)),
        "TrainingDebugging": TrainingDebugging(stack, "Debugging", TrainingDebuggingProps(network=network)),
        "TrainingQueues": TrainingQueues(stack, "Queues", TrainingQueuesProps(
            environment_name="each", teams=[team], max_instances=4,
            job_queues=[training_constructs.JobQueueSpec(name="standard")])),
        "DeployedEnvironmentRecord": DeployedEnvironmentRecord(
            stack,
            "Record",
            DeployedEnvironmentRecordProps.for_launchers(
                [launcher], environment_name="each", job_name_prefix="each-a", enabled_templates=["gpt2-ddp"]
            ),
        ),
    }


def test_every_attribute_the_readme_names_exists(one_of_each):
    for name, section in _readme_sections().items():
        missing = [a for a in _documented_attributes(section) if not hasattr(one_of_each[name], a)]
        assert missing == [], name
    team_access = one_of_each["TrainingAccess"].teams["a"]
    line = next(line for line in README.splitlines() if "Each `TeamAccess`" in line)
    members = re.findall(r"`([^`]+)`", line.split("Each `TeamAccess`")[1].split(". Functions")[0])
    assert [m for m in members[1:] if not hasattr(team_access, m.split("(")[0])] == []


def test_the_readmes_whole_environment_example_synthesizes(tmp_path):
    [example] = re.findall(r"## A whole environment\n\n```python\n(.*?)```", README, flags=re.S)
    code = example.replace("app = cdk.App()", f"app = cdk.App(outdir={str(tmp_path)!r})")
    exec(compile(code, "constructs/README.md", "exec"), {})  # noqa: S102 (our own documentation)
    template = json.loads((tmp_path / "MlTraining.template.json").read_text())
    assert resources_of_type(template, "AWS::StepFunctions::StateMachine")


def test_the_records_props_keep_their_old_name_with_a_deprecation_warning():
    """`DeployedEnvironmentProps` became `DeployedEnvironmentRecordProps` (`<Construct>Props`):
    an app written before still synthesizes, warned (constructs/CHANGELOG.md)."""
    with pytest.warns(DeprecationWarning, match="use DeployedEnvironmentRecordProps"):
        old = training_constructs.DeployedEnvironmentProps
    assert old is DeployedEnvironmentRecordProps
    assert "DeployedEnvironmentProps" not in training_constructs.__all__
    with pytest.raises(AttributeError):
        training_constructs.NoSuchProps  # noqa: B018


def test_the_readme_says_which_module_each_function_it_names_lives_in():
    """A function is named with its module ("Functions (`training_constructs.queues`): ..."), and a
    snippet calling one that `training_constructs` does not export imports it."""
    clauses = re.findall(r"Functions( \(`[\w.]+`[^)]*\))?: (.*)", README)
    assert len(clauses) >= 2
    for module, text in clauses:
        assert module, f"Functions of no module: {text[:80]}"
        where = importlib.import_module(module.split("`")[1])
        assert [name for name in re.findall(r"`(\w+)\(", text) if not hasattr(where, name)] == [], module
    modules = [importlib.import_module(f"training_constructs.{m.name}")
               for m in pkgutil.iter_modules(training_constructs.__path__)]
    functions = {name: module.__name__ for module in modules for name, value in vars(module).items()
                 if inspect.isfunction(value) and value.__module__ == module.__name__ and name[0] != "_"}
    unexported = set(functions) - set(training_constructs.__all__)
    for snippet in re.findall(r"```python\n(.*?)```", README, flags=re.S):
        for name in set(re.findall(r"(?<![\w.])([a-z_]\w*)\(", snippet)) & unexported:
            assert re.search(rf"from {functions[name]} import [^\n]*\b{name}\b", snippet), (name, snippet)
