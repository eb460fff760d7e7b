"""Per-environment configuration of the platform: the typed model of ``config/<name>.yaml``.

One YAML file describes one deployment of the platform (an AWS account and region): its network,
which job templates it offers, its guard rails (quota alarms, warm-pool limits) and who is notified.
``app.py`` builds one CDK Stage per file; the launcher, the guard rails and the CLI read the same
objects, so every consumer sees the same validated values.

Everything here is pure Python (no aws_cdk): load with :func:`load_environments` or
:func:`load_environment`; invalid input raises :class:`EnvironmentConfigError` naming the file and
the field (``config/dev.yaml: network.vpc_cidr: ...``).

The file format, field by field, is documented in ``docs/infrastructure.md``.

This module loads files and assembles the environment; the parts are in their own modules (and the
records are importable from here too):
- llmtrain.core.environment_model: the records (`EnvironmentConfig` and its sections);
- llmtrain.core.environment_sections: reading the network, guard rails and features sections;
- llmtrain.core.environment_teams: reading the teams and the queues;
- llmtrain.core.config_reader: typed access to a mapping, errors naming file and field;
- llmtrain.core.stack_outputs: the stacks' output names (`StackOutput`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from llmtrain.core.config_reader import ConfigReader
from llmtrain.core.environment_model import (
    MAX_WARM_POOL_KEEP_ALIVE_SECONDS,
    BudgetConfig,
    EnvironmentConfig,
    EnvironmentConfigError,
    ExistingVpcConfig,
    JobQueueConfig,
    LogsConfig,
    MlflowConfig,
    NetworkConfig,
    NotificationConfig,
    PackagesConfig,
    QueuesConfig,
    QuotaConfig,
    TeamConfig,
    WarmPoolConfig,
)
from llmtrain.core.environment_sections import (
    read_account,
    read_budgets,
    read_features,
    read_job_name_prefix,
    read_logs,
    read_network,
    read_notifications,
    read_quotas,
    read_tags,
    read_template_names,
    read_warm_pools,
)
from llmtrain.core.environment_teams import read_queues, read_teams
from llmtrain.core.platform import (
    DEFAULT_TEAM,
    ENVIRONMENT_NAME_PATTERN,
    REGION_PATTERN,
    team_job_name_prefix,
)
from llmtrain.core.stack_outputs import StackOutput
from llmtrain.core.yaml_documents import load_document

__all__ = [
    "MAX_WARM_POOL_KEEP_ALIVE_SECONDS",
    "BudgetConfig",
    "EnvironmentConfig",
    "EnvironmentConfigError",
    "LogsConfig",
    "ExistingVpcConfig",
    "JobQueueConfig",
    "NetworkConfig",
    "MlflowConfig",
    "NotificationConfig",
    "PackagesConfig",
    "QueuesConfig",
    "QuotaConfig",
    "StackOutput",
    "TeamConfig",
    "WarmPoolConfig",
    "load_environment",
    "load_environments",
]


def load_environments(config_dir: str | Path) -> dict[str, EnvironmentConfig]:
    """Load every ``*.yaml`` file in ``config_dir``, keyed by environment name (sorted by name)."""
    directory = Path(config_dir)
    if not directory.is_dir():
        raise EnvironmentConfigError(f"{directory}: not a directory; expected a folder of <env>.yaml files")
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise EnvironmentConfigError(f"{directory}: no *.yaml environment files found")
    environments = [load_environment(path) for path in files]
    _check_unique(
        environments,
        "account",
        lambda env: (env.account, env.region),
        "two environments deploy to the same account and region; give each its own",
    )
    return {env.name: env for env in environments}


def load_environment(path: str | Path) -> EnvironmentConfig:
    """Load and validate one environment file; the file's stem must equal its ``name``."""
    path = Path(path)
    try:
        data = load_document(path.read_text())
    except OSError as error:
        raise EnvironmentConfigError(f"{path}: cannot read: {error}") from error
    except yaml.YAMLError as error:
        raise EnvironmentConfigError(f"{path}: not valid YAML: {error}") from error
    return parse_environment(data, source=path)


def parse_environment(data: Any, *, source: Path | None = None) -> EnvironmentConfig:
    """Validate a parsed environment document (what ``load_environment`` reads from a file)."""
    reader = ConfigReader(data, prefix="", origin=str(source) if source else "<environment>")
    config = _read_environment(reader, source)
    if source is not None and source.stem != config.name:
        reader.fail("name", f"must equal the file name {source.stem!r}, got {config.name!r}")
    return config


def _read_environment(reader: ConfigReader, source: Path | None) -> EnvironmentConfig:
    reader.only_keys(
        {
            "name",
            "account",
            "region",
            "network",
            "job_templates",
            "job_name_prefix",
            "quotas",
            "warm_pools",
            "notifications",
            "budgets",
            "logs",
            "tags",
            "teams",
            "packages",
            "mlflow",
            "training_plans",
            "remote_debug",
            "queues",
        }
    )
    region = reader.string("region", pattern=REGION_PATTERN, hint="an AWS region such as us-east-1")
    templates = reader.section("job_templates")
    templates.only_keys({"enabled"})
    enabled = read_template_names(templates)
    job_name_prefix = read_job_name_prefix(reader)
    warm_pools = read_warm_pools(reader.section("warm_pools", required=False))
    notifications = read_notifications(reader.section("notifications", required=False))
    budgets = read_budgets(reader.section("budgets", required=False))
    account = read_account(reader)
    network = read_network(reader.section("network"), region)
    defaults = TeamConfig(
        name=DEFAULT_TEAM,
        job_name_prefix=team_job_name_prefix(job_name_prefix, DEFAULT_TEAM),
        templates=enabled,
        max_keep_alive_seconds=warm_pools.max_keep_alive_seconds,
        notification_email=notifications.email,
        max_run_cost_usd=budgets.max_run_cost_usd,
    )
    queues_section = reader.section("queues", required=False)
    queues = read_queues(queues_section) if queues_section.present else None
    return EnvironmentConfig(
        name=reader.string(
            "name",
            pattern=ENVIRONMENT_NAME_PATTERN,
            hint="lowercase letters, digits and hyphens, starting with a letter, at most 20",
        ),
        account=account,
        region=region,
        network=network,
        enabled_templates=enabled,
        job_name_prefix=job_name_prefix,
        quotas=read_quotas(reader.section("quotas", required=False)),
        warm_pools=warm_pools,
        notifications=notifications,
        budgets=budgets,
        logs=read_logs(reader.section("logs", required=False)),
        tags=read_tags(reader, "tags"),
        teams=read_teams(reader, defaults, job_name_prefix, queues),
        source=source,
        queues=queues,
        **read_features(reader, region=region, account=account, network=network),
    )


def _check_unique(environments, what, key, message) -> None:
    seen: dict[Any, EnvironmentConfig] = {}
    for env in environments:
        other = seen.setdefault(key(env), env)
        if other is not env:
            raise EnvironmentConfigError(f"{env.source}: {what}: {message} (also used by {other.source})")
