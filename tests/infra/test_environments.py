"""llmtrain.core.environments: the committed files load, and every invalid field is named in the error."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from infra_helpers import CONFIG_DIR

import app as cdk_app
from llmtrain.core.environments import (
    MAX_WARM_POOL_KEEP_ALIVE_SECONDS,
    EnvironmentConfigError,
    load_environment,
    load_environments,
    parse_environment,
)

CATALOG_TEMPLATES = {
    "llama-pretrain-fsdp",
    "llama-pretrain-hsdp-tp",
    "llama-pretrain-smp",
    "llama-finetune-deepspeed",
    "llama-finetune-qlora",
    "llama-finetune-lora",
    "gpt2-ddp",
    "byo-script",
}


def valid_document() -> dict:
    return yaml.safe_load((CONFIG_DIR / "dev.yaml").read_text())


def write(directory: Path, name: str, document: dict) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_committed_environments_load_with_their_values():
    environments = load_environments(CONFIG_DIR)
    assert list(environments) == ["dev", "prod"]
    dev, prod = environments["dev"], environments["prod"]
    assert (dev.account, dev.region) == ("111111111111", "us-east-1")
    assert (prod.account, prod.region) == ("222222222222", "us-west-2")
    assert dev.network.availability_zones == ("us-east-1a", "us-east-1b")
    assert len(prod.network.availability_zones) == 3
    assert dev.network.vpc_cidr == "10.40.0.0/16" and dev.network.nat_gateways == 0
    assert (
        prod.network.inter_container_traffic_encryption and not dev.network.inter_container_traffic_encryption
    )
    assert set(dev.enabled_templates) == CATALOG_TEMPLATES
    assert set(prod.enabled_templates) == CATALOG_TEMPLATES - {"byo-script"}
    assert dev.warm_pools.max_keep_alive_seconds == 3600 and dev.warm_pools.idle_budget_seconds == 1800
    assert prod.quotas.alarm_threshold_percent == 90.0
    assert dev.notifications.email == "ml-platform-dev@example.com"
    assert (dev.budgets.max_run_cost_usd, prod.budgets.max_run_cost_usd) == (20000.0, 250000.0)
    assert dev.job_name_prefix == "llmtrain-dev"
    assert dev.tags["environment"] == "dev"
    assert dev.stack_name("storage") == "llmtrain-dev-storage"
    assert dev.source == CONFIG_DIR / "dev.yaml"


def test_without_teams_an_environment_has_one_team_named_default():
    dev = load_environments(CONFIG_DIR)["dev"]
    [team] = dev.teams
    assert (team.name, team.job_name_prefix) == ("default", "llmtrain-dev-default")
    assert team.templates == dev.enabled_templates
    assert team.instance_types is None and team.max_instance_count is None  # the templates' own
    assert team.max_keep_alive_seconds == dev.warm_pools.max_keep_alive_seconds
    assert team.notification_email == dev.notifications.email
    assert team.max_run_cost_usd == dev.budgets.max_run_cost_usd == 20000.0
    assert dev.team("default") is team


def test_prod_is_shared_by_two_teams_with_their_limits():
    prod = load_environments(CONFIG_DIR)["prod"]
    assert [t.name for t in prod.teams] == ["pretrain", "finetune"]
    pretrain, finetune = prod.teams
    assert pretrain.job_name_prefix == "llmtrain-prod-pretrain"
    assert set(pretrain.templates) == {"llama-pretrain-fsdp", "llama-pretrain-hsdp-tp", "llama-pretrain-smp"}
    assert pretrain.instance_types == ("ml.p4d.24xlarge", "ml.p4de.24xlarge", "ml.p5.48xlarge")
    assert (pretrain.max_instance_count, finetune.max_instance_count) == (32, 4)
    assert finetune.max_keep_alive_seconds == prod.warm_pools.max_keep_alive_seconds  # the default
    # Its own run budget, and the environment's for the team that sets none.
    assert (finetune.max_run_cost_usd, pretrain.max_run_cost_usd) == (25000.0, 250000.0)
    assert finetune.notification_email == "ml-finetuning@example.com"
    assert finetune.tags == {"cost-center": "ml-finetuning"}
    with pytest.raises(EnvironmentConfigError, match="has no team 'nlp'; its teams: pretrain, finetune"):
        prod.team("nlp")


def test_a_team_takes_the_environments_defaults(tmp_path):
    document = valid_document()
    document["teams"] = {
        "nlp": None,
        "vision": {"templates": ["gpt2-ddp"], "max_keep_alive_seconds": 600, "max_run_cost_usd": 900000},
    }
    config = load_environment(write(tmp_path, "dev", document))
    nlp, vision = config.teams
    # A team's budget is its own, above or below the environment's, which is the default.
    assert (nlp.max_run_cost_usd, vision.max_run_cost_usd) == (config.budgets.max_run_cost_usd, 900000.0)
    assert nlp.templates == config.enabled_templates and nlp.instance_types is None
    assert (nlp.max_keep_alive_seconds, vision.max_keep_alive_seconds) == (3600, 600)
    assert vision.templates == ("gpt2-ddp",) and vision.job_name_prefix == "llmtrain-dev-vision"


def test_optional_sections_take_documented_defaults(tmp_path):
    document = valid_document()
    for optional in ("quotas", "warm_pools", "notifications", "budgets", "tags"):
        del document[optional]
    del document["network"]["nat_gateways"], document["network"]["inter_container_traffic_encryption"]
    config = load_environment(write(tmp_path, "dev", document))
    assert config.quotas.alarm_threshold_percent == 80.0
    assert (config.warm_pools.max_keep_alive_seconds, config.warm_pools.idle_budget_seconds) == (3600, 1800)
    assert config.notifications.email is None and dict(config.tags) == {}
    assert config.budgets.max_run_cost_usd is None
    assert config.network.nat_gateways == 0 and not config.network.inter_container_traffic_encryption
    assert config.logs.training_jobs_retention_days == 365


def test_existing_vpc_replaces_the_cidr(tmp_path):
    document = valid_document()
    network = document["network"]
    del network["vpc_cidr"]
    network["existing_vpc"] = {
        "vpc_id": "vpc-0123456789abcdef0",
        "vpc_cidr": "10.9.0.0/16",
        "subnet_ids": ["subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb"],
        "route_table_ids": ["rtb-0aaaaaaaaaaaaaaaa", "rtb-0bbbbbbbbbbbbbbbb"],
    }
    config = load_environment(write(tmp_path, "dev", document))
    assert config.network.vpc_cidr == "10.9.0.0/16"
    assert config.network.existing_vpc.subnet_ids == ("subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb")
    assert config.network.existing_vpc.create_endpoints is True


def _set(path: str, value, **also):
    def change(document):
        *parents, leaf = path.split(".")
        target = document
        for key in parents:
            target = target.setdefault(key, {})
        if value is _DELETE:
            del target[leaf]
        else:
            target[leaf] = value
        document.update(copy.deepcopy(also))

    return change


_DELETE = object()
_EXISTING = {
    "vpc_id": "vpc-0123456789abcdef0",
    "vpc_cidr": "10.9.0.0/16",
    "subnet_ids": ["subnet-0aaaaaaaaaaaaaaaa"],
    "route_table_ids": ["rtb-0aaaaaaaaaaaaaaaa"],
}

INVALID = [
    # (change, field named in the message, words of the explanation)
    (_set("account", 111111111111), "account", "quoted string"),
    (_set("account", "1234"), "account", "12-digit"),
    (_set("account", _DELETE), "account", "is required"),
    (_set("region", "mars-1"), "region", "AWS region"),
    (_set("name", "Dev_1"), "name", "lowercase"),
    (_set("name", "qa"), "name", "file name"),
    (_set("colour", "blue"), "colour", "unknown field"),
    (_set("network.vpc_cidr", "10.40.0.1/16"), "network.vpc_cidr", "IPv4 network"),
    (_set("network.vpc_cidr", "10.0.0.0/8"), "network.vpc_cidr", "/16 to /24"),
    (_set("network.vpc_cidr", "fd00::/64"), "network.vpc_cidr", "IPv4"),
    (_set("network.availability_zones", ["us-east-1a"]), "network.availability_zones", "at least 2"),
    (
        _set("network.availability_zones", ["us-west-2a", "us-west-2b"]),
        "network.availability_zones",
        "us-east-1",
    ),
    (_set("network.nat_gateways", 3), "network.nat_gateways", "at most 2"),
    (_set("network.nat_gateways", True), "network.nat_gateways", "whole number"),
    (
        _set("network.inter_container_traffic_encryption", "yes"),
        "network.inter_container_traffic_encryption",
        "true or false",
    ),
    (_set("network.s3_prefix_list_id", "s3"), "network.s3_prefix_list_id", "prefix list"),
    (_set("network.existing_vpc", _EXISTING), "network.existing_vpc.subnet_ids", "at least 2"),
    (
        _set(
            "network.existing_vpc",
            {
                **_EXISTING,
                "vpc_id": "vpc-1",
                "subnet_ids": ["subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb"],
                "route_table_ids": ["rtb-0aaaaaaaaaaaaaaaa", "rtb-0bbbbbbbbbbbbbbbb"],
            },
        ),
        "network.existing_vpc.vpc_id",
        "VPC id",
    ),
    (
        _set(
            "network.existing_vpc",
            {
                **_EXISTING,
                "subnet_ids": ["subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb"],
                "route_table_ids": ["rtb-0aaaaaaaaaaaaaaaa", "rtb-0bbbbbbbbbbbbbbbb"],
            },
        ),
        "network.vpc_cidr",
        "existing_vpc.vpc_cidr is used",
    ),
    (_set("job_templates.enabled", []), "job_templates.enabled", "at least 1"),
    (_set("job_templates.enabled", ["gpt2-ddp", "gpt2-ddp"]), "job_templates.enabled", "more than once"),
    (_set("job_templates.enabled", ["Llama 7B"]), "job_templates.enabled", "not valid"),
    (_set("job_name_prefix", "LLMTrain"), "job_name_prefix", "lowercase"),
    (_set("job_name_prefix", "a" * 25), "job_name_prefix", "at most 24"),
    (_set("quotas.alarm_threshold_percent", 120), "quotas.alarm_threshold_percent", "at most 100"),
    (_set("budgets.max_run_cost_usd", 0), "budgets.max_run_cost_usd", "positive number of US dollars"),
    (_set("budgets.max_run_cost_usd", "lots"), "budgets.max_run_cost_usd", "a number"),
    (_set("logs", {"training_jobs_retention_days": 100}), "logs.training_jobs_retention_days",
     "keeps logs 1, 3, 5"),
    (_set("logs", {"training_jobs_retention_days": True}), "logs.training_jobs_retention_days",
     "whole number"),
    (_set("logs", {"training_days": 30}), "logs.training_days", "unknown field"),
    (_set("quotas.alarm_threshold_percent", "high"), "quotas.alarm_threshold_percent", "a number"),
    (
        _set("warm_pools.max_keep_alive_seconds", MAX_WARM_POOL_KEEP_ALIVE_SECONDS + 1),
        "warm_pools.max_keep_alive_seconds",
        "at most 21600",
    ),
    (_set("warm_pools.max_keep_alive_seconds", -1), "warm_pools.max_keep_alive_seconds", "at least 0"),
    (_set("warm_pools.idle_budget_seconds", 7200), "warm_pools.idle_budget_seconds", "exceeds"),
    (_set("notifications.email", "not-an-address"), "notifications.email", "e-mail"),
    (_set("tags", ["a", "b"]), "tags", "mapping"),
    (_set("tags.aws:owner", "me"), "tags.aws:owner", "tag key"),
    (_set("tags.cost-center", 42), "tags.cost-center", "string"),
    (_set("network", "10.0.0.0/16"), "network", "mapping"),
    (_set("teams", []), "teams", "must map team names"),
    (_set("teams", {"ml-a": {}}), "teams.ml-a", "no hyphens"),
    (_set("teams", {"Nlp": {}}), "teams.Nlp", "lowercase letters and digits"),
    (_set("teams", {"nlp": {"colour": "blue"}}), "teams.nlp.colour", "unknown field"),
    (
        _set("teams", {"nlp": {"templates": ["no-such"]}}),
        "teams.nlp.templates",
        "not enabled in this environment",
    ),
    (_set("teams", {"nlp": {"templates": []}}), "teams.nlp.templates", "at least 1"),
    (_set("teams", {"nlp": {"instance_types": ["p4d"]}}), "teams.nlp.instance_types", "not valid"),
    (_set("teams", {"nlp": {"max_instance_count": 0}}), "teams.nlp.max_instance_count", "at least 1"),
    (_set("teams", {"nlp": {"max_run_cost_usd": -5}}), "teams.nlp.max_run_cost_usd", "positive number"),
    (_set("teams", {"nlp": {"max_run_cost_usd": "cheap"}}), "teams.nlp.max_run_cost_usd", "a number"),
    (
        _set("teams", {"nlp": {"max_keep_alive_seconds": 7200}}),
        "teams.nlp.max_keep_alive_seconds",
        "exceeds the environment's warm_pools.max_keep_alive_seconds (3600)",
    ),
    (_set("teams", {"nlp": {"notifications": {"email": "x"}}}), "teams.nlp.notifications.email", "e-mail"),
    (_set("teams", {"nlp": {"tags": {"aws:x": "y"}}}), "teams.nlp.tags.aws:x", "tag key"),
    # Queues: every field named, and a team's queue settings only where the environment has queues.
    (_set("queues", {"job_queues": {"standard": {}}}), "queues.max_instances", "is required"),
    (_set("queues", {"max_instances": 0, "job_queues": {"a": {}}}), "queues.max_instances", "at least 1"),
    (_set("queues", {"max_instances": 8, "job_queues": {}}), "queues.job_queues", "map queue names"),
    (_set("queues", {"max_instances": 8, "job_queues": {"Std-1": {}}}), "queues.job_queues.Std-1",
     "not a queue name"),
    (_set("queues", {"max_instances": 8, "job_queues": {"a": {"priority": 1001}}}),
     "queues.job_queues.a.priority", "at most 1000"),
    (_set("queues", {"max_instances": 8, "job_queues": {"a": {"weight": 1}}}),
     "queues.job_queues.a.weight", "unknown field"),
    (_set("queues", {"max_instances": 8, "job_queues": {"a": {}}, "default_queue": "b"}),
     "queues.default_queue", "not one of job_queues (a)"),
    (_set("queues", {"max_instances": 8, "job_queues": {"a": {}}, "compute_reservation": 100}),
     "queues.compute_reservation", "at most 99"),
    (_set("queues", {"max_instances": 8, "job_queues": {"a": {}}, "share_decay_seconds": 604801}),
     "queues.share_decay_seconds", "at most 604800"),
    (_set("queues", {"max_instances": 8, "job_queues": {"a": {}}, "capacity_wait_seconds": 60}),
     "queues.capacity_wait_seconds", "at least 600"),
    (_set("teams", {"nlp": {"share_weight": 2}}), "teams.nlp.share_weight", "the environment has no queues"),
    (_set("teams", {"nlp": {"max_priority": 2}}), "teams.nlp.max_priority", "the environment has no queues"),
]

QUEUES = {"max_instances": 8, "job_queues": {"standard": {"priority": 1}, "urgent": {"priority": 9}}}
INVALID += [
    (_set("queues", QUEUES, teams={"nlp": {"share_weight": 0}}), "teams.nlp.share_weight", "from 1 to 999"),
    (_set("queues", QUEUES, teams={"nlp": {"share_weight": 1.5}}), "teams.nlp.share_weight", "whole number"),
    (_set("queues", QUEUES, teams={"nlp": {"max_priority": 10000}}), "teams.nlp.max_priority",
     "at most 9999"),
    (_set("queues", QUEUES, teams={"nlp": {"queues": ["fast"]}}), "teams.nlp.queues",
     "fast not among the environment's queues.job_queues (standard, urgent)"),
    (_set("queues", QUEUES, teams={"nlp": {"max_instance_count": 9}}), "teams.nlp.max_instance_count",
     "exceeds queues.max_instances (8)"),
]


@pytest.mark.parametrize(
    ("change", "field", "explanation"),
    INVALID,
    ids=[f"{field}-{explanation}" for _, field, explanation in INVALID],
)
def test_an_invalid_field_is_named_with_the_file(tmp_path, change, field, explanation):
    document = copy.deepcopy(valid_document())
    change(document)
    path = write(tmp_path, "dev", document)
    with pytest.raises(EnvironmentConfigError) as raised:
        load_environment(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: {field}:"), message
    assert explanation in message, message


def test_unreadable_and_malformed_files_are_reported(tmp_path):
    bad_yaml = tmp_path / "dev.yaml"
    bad_yaml.write_text("name: [dev\n")
    with pytest.raises(EnvironmentConfigError, match="not valid YAML"):
        load_environment(bad_yaml)
    with pytest.raises(EnvironmentConfigError, match="cannot read"):
        load_environment(tmp_path / "missing.yaml")
    with pytest.raises(EnvironmentConfigError, match="the document: must be a mapping"):
        parse_environment(["dev"])


def test_a_config_folder_needs_files_with_distinct_targets(tmp_path):
    with pytest.raises(EnvironmentConfigError, match="no \\*.yaml environment files"):
        load_environments(tmp_path)
    with pytest.raises(EnvironmentConfigError, match="not a directory"):
        load_environments(tmp_path / "nope")
    write(tmp_path, "dev", valid_document())
    clash = {**valid_document(), "name": "qa"}
    write(tmp_path, "qa", clash)
    with pytest.raises(EnvironmentConfigError, match="same account and region"):
        load_environments(tmp_path)


def test_app_selects_environments_by_name(environments):
    assert [env.name for env in cdk_app.select_environments(environments, None)] == ["dev", "prod"]
    assert [env.name for env in cdk_app.select_environments(environments, " prod ,")] == ["prod"]
    with pytest.raises(EnvironmentConfigError, match="no environment file for staging"):
        cdk_app.select_environments(environments, "dev,staging")


def test_prod_queues_its_runs_and_dev_does_not():
    environments = load_environments(CONFIG_DIR)
    dev, prod = environments["dev"], environments["prod"]
    assert dev.queues is None and dev.team_queues(dev.teams[0]) == ()
    queues = prod.queues
    assert queues.max_instances == 48 and queues.default_queue == "standard"
    assert [(q.name, q.priority) for q in queues.job_queues] == [("standard", 10), ("urgent", 100)]
    assert (queues.share_decay_seconds, queues.compute_reservation) == (86400, 10)
    assert (queues.capacity_wait_seconds, queues.misconfiguration_wait_seconds) == (14400, 600)
    pretrain, finetune = prod.teams
    # Two teams with different weights; the urgent queue is pretraining's alone.
    assert (pretrain.share_weight, finetune.share_weight) == (3, 1)
    assert (pretrain.max_priority, finetune.max_priority) == (100, 10)
    assert prod.team_queues(pretrain) == ("standard", "urgent")
    assert prod.team_queues(finetune) == ("standard",)


def test_queue_settings_take_documented_defaults(tmp_path):
    document = valid_document()
    document["queues"] = {"max_instances": 4, "job_queues": {"only": None}}
    document["teams"] = {"nlp": None}
    config = load_environment(write(tmp_path, "dev", document))
    queues = config.queues
    assert queues.default_queue == "only" and queues.job_queues[0].priority == 0
    assert (queues.share_decay_seconds, queues.compute_reservation) == (86400, 0)
    assert (queues.capacity_wait_seconds, queues.misconfiguration_wait_seconds) == (14400, 600)
    [nlp] = config.teams
    assert (nlp.share_weight, nlp.max_priority, nlp.queues) == (1, 0, None)
    assert config.team_queues(nlp) == ("only",)


def test_the_readmes_configuration_example_is_a_valid_environment_with_queues():
    readme = (CONFIG_DIR.parent / "README.md").read_text()
    example = readme.split("### Environment configuration")[1].split("```yaml\n")[1].split("```")[0]
    config = parse_environment(yaml.safe_load(example))
    nlp, vision = config.teams
    assert config.queues.queue_names == ("standard", "urgent") and config.queues.max_instances == 16
    assert (nlp.share_weight, nlp.max_priority, vision.share_weight) == (3, 50, 1)
    assert config.team_queues(vision) == ("standard",)
