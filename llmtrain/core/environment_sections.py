"""Reading the sections of ``config/<name>.yaml`` other than its teams and queues.

The account, the network (a new VPC or an existing one), the enabled job templates and job-name
prefix, the guard rails (budgets, quotas, warm pools, log retention), notifications, tags and the
optional SageMaker features (package source, MLflow, training plans, remote debugging): each read
from its `ConfigReader` section into its record of llmtrain.core.environment_model, every invalid
value an `EnvironmentConfigError` that names the field and the fix.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from llmtrain.core.config_reader import ConfigReader
from llmtrain.core.environment_model import (
    MAX_WARM_POOL_KEEP_ALIVE_SECONDS,
    PACKAGE_SOURCES,
    BudgetConfig,
    ExistingVpcConfig,
    LogsConfig,
    MlflowConfig,
    NetworkConfig,
    NotificationConfig,
    PackagesConfig,
    QuotaConfig,
    WarmPoolConfig,
)
from llmtrain.core.platform import (
    ACCOUNT_PATTERN,
    EMAIL_PATTERN,
    JOB_NAME_PREFIX_PATTERN,
    LOG_RETENTION_DAYS,
    MAX_JOB_NAME_PREFIX,
    MLFLOW_SIZES,
    PREFIX_LIST_ID_PATTERN,
    ROUTE_TABLE_ID_PATTERN,
    SUBNET_ID_PATTERN,
    TRAINING_PLAN_ARN,
    TRAINING_PLAN_NAME,
    VPC_ID_PATTERN,
)

# Template names follow the catalog's rule: lowercase words joined by hyphens.
TEMPLATE_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_TAG_KEY = re.compile(r"^[\w.:/=+\-@ ]{1,128}$")
_TAG_VALUE = re.compile(r"^[\w.:/=+\-@ ]{0,256}$")


def read_features(
    reader: ConfigReader, *, region: str, account: str, network: NetworkConfig
) -> dict[str, Any]:
    """The optional SageMaker features: package source, MLflow, training plans, remote debugging."""
    packages = reader.section("packages", required=False)
    packages.only_keys({"source"})
    source = packages.raw("source", default="codeartifact")
    if source not in PACKAGE_SOURCES:
        packages.fail("source", f"must be one of {', '.join(PACKAGE_SOURCES)}, got {source!r}")
    # An existing VPC's routing is its own: it may well reach PyPI.
    if source == "pypi" and not network.nat_gateways and network.existing_vpc is None:
        packages.fail("source", "pypi needs a route to the internet: set network.nat_gateways >= 1, or use "
                                "codeartifact (a PyPI mirror reached through VPC endpoints)")
    mlflow = reader.section("mlflow", required=False)
    mlflow.only_keys({"tracking_server", "size"})
    size = mlflow.raw("size", default="Small")
    if size not in MLFLOW_SIZES:
        mlflow.fail("size", f"must be one of {', '.join(MLFLOW_SIZES)}, got {size!r}")
    debug = reader.section("remote_debug", required=False)
    debug.only_keys({"enabled"})
    return {
        "packages": PackagesConfig(source=source),
        "mlflow": MlflowConfig(tracking_server=mlflow.boolean("tracking_server", default=False), size=size),
        "training_plans": _read_training_plans(reader, region, account),
        "remote_debug": debug.boolean("enabled", default=False),
    }


def _read_training_plans(reader: ConfigReader, region: str, account: str) -> dict[str, str]:
    plans = reader.raw("training_plans", default={})
    if not isinstance(plans, dict):
        reader.fail("training_plans", "must map plan names to training plan ARNs")
    for name, arn in plans.items():
        if not isinstance(name, str) or not TRAINING_PLAN_NAME.fullmatch(name):
            reader.fail(f"training_plans.{name}", "is not a training plan name (letters, digits, dashes)")
        if not isinstance(arn, str) or not TRAINING_PLAN_ARN.fullmatch(arn):
            reader.fail(f"training_plans.{name}", f"expected a training plan ARN "
                        f"(arn:aws:sagemaker:REGION:ACCOUNT:training-plan/NAME), got {arn!r}")
        if arn.split(":")[3:5] != [region, account]:
            reader.fail(f"training_plans.{name}", f"{arn} is not in this environment's account and region "
                        f"({account}, {region}): a job can only use a plan of its own account and region")
    return dict(plans)


def read_account(reader: ConfigReader) -> str:
    value = reader.raw("account")
    if isinstance(value, int):
        reader.fail(
            "account",
            "must be a quoted string (YAML reads an unquoted number and drops "
            f'leading zeros): write account: "{value:012d}"',
        )
    return reader.string("account", pattern=ACCOUNT_PATTERN, hint="a 12-digit AWS account id in quotes")


def read_network(reader: ConfigReader, region: str) -> NetworkConfig:
    reader.only_keys(
        {
            "vpc_cidr",
            "availability_zones",
            "nat_gateways",
            "inter_container_traffic_encryption",
            "s3_prefix_list_id",
            "existing_vpc",
        }
    )
    zones = reader.string_list("availability_zones", min_items=2)
    for zone in zones:
        if not re.fullmatch(re.escape(region) + r"[a-z]", zone):
            reader.fail(
                "availability_zones",
                f"{zone!r} is not an availability zone of {region} (expected e.g. {region}a)",
            )
    nat_gateways = reader.integer("nat_gateways", default=0, minimum=0, maximum=len(zones))
    existing = reader.section("existing_vpc", required=False)
    existing_vpc = _read_existing_vpc(existing, len(zones)) if existing.present else None
    if existing_vpc is not None and nat_gateways:
        reader.fail("nat_gateways", "must be 0 with existing_vpc: the existing VPC's routing is its own")
    if existing_vpc is not None and "vpc_cidr" in reader.data:
        reader.fail("vpc_cidr", "remove it: with existing_vpc, existing_vpc.vpc_cidr is used")
    return NetworkConfig(
        vpc_cidr=(existing_vpc.vpc_cidr if existing_vpc else _read_cidr(reader, "vpc_cidr")),
        availability_zones=zones,
        nat_gateways=nat_gateways,
        inter_container_traffic_encryption=reader.boolean(
            "inter_container_traffic_encryption", default=False
        ),
        s3_prefix_list_id=reader.optional_string(
            "s3_prefix_list_id", pattern=PREFIX_LIST_ID_PATTERN, hint="a prefix list id such as pl-63a5400a"
        ),
        existing_vpc=existing_vpc,
    )


def _read_existing_vpc(reader: ConfigReader, zone_count: int) -> ExistingVpcConfig:
    reader.only_keys({"vpc_id", "vpc_cidr", "subnet_ids", "route_table_ids", "create_endpoints"})
    subnet_ids = reader.string_list("subnet_ids", min_items=zone_count, pattern=SUBNET_ID_PATTERN)
    route_table_ids = reader.string_list("route_table_ids", min_items=zone_count,
                                         pattern=ROUTE_TABLE_ID_PATTERN)
    for key, ids in (("subnet_ids", subnet_ids), ("route_table_ids", route_table_ids)):
        if len(ids) != zone_count:
            reader.fail(key, f"needs one entry per availability zone ({zone_count}), got {len(ids)}")
    return ExistingVpcConfig(
        vpc_id=reader.string("vpc_id", pattern=VPC_ID_PATTERN, hint="a VPC id such as vpc-0123456789abcdef0"),
        vpc_cidr=_read_cidr(reader, "vpc_cidr"),
        subnet_ids=subnet_ids,
        route_table_ids=route_table_ids,
        create_endpoints=reader.boolean("create_endpoints", default=True),
    )


def _read_cidr(reader: ConfigReader, key: str) -> str:
    text = reader.string(key, hint="an IPv4 CIDR block such as 10.20.0.0/16")
    try:
        network = ipaddress.IPv4Network(text, strict=True)
    except ValueError as error:
        reader.fail(key, f"{text!r} is not an IPv4 network CIDR block ({error}); e.g. 10.20.0.0/16")
    if not 16 <= network.prefixlen <= 24:
        reader.fail(
            key,
            f"prefix /{network.prefixlen} is out of range: use /16 to /24 "
            "(a VPC allows /16 at most, and training nodes need addresses in every zone)",
        )
    return text


def read_template_names(reader: ConfigReader) -> tuple[str, ...]:
    names = reader.string_list("enabled", min_items=1, pattern=TEMPLATE_NAME)
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        reader.fail("enabled", f"lists {', '.join(duplicates)} more than once")
    return names


def read_job_name_prefix(reader: ConfigReader) -> str:
    prefix = reader.string(
        "job_name_prefix",
        pattern=JOB_NAME_PREFIX_PATTERN,
        hint="lowercase letters, digits and hyphens, e.g. llmtrain-dev",
    )
    if len(prefix) > MAX_JOB_NAME_PREFIX:
        reader.fail(
            "job_name_prefix",
            f"is {len(prefix)} characters; at most {MAX_JOB_NAME_PREFIX} "
            "leave room for the run name in SageMaker's 63-character job names",
        )
    return prefix


def read_budgets(reader: ConfigReader) -> BudgetConfig:
    reader.only_keys({"max_run_cost_usd"})
    return BudgetConfig(max_run_cost_usd=read_run_cost(reader, None))


def read_run_cost(reader: ConfigReader, default: float | None) -> float | None:
    """`max_run_cost_usd` of a section: a positive number of US dollars, or `default` when unset."""
    if reader.raw("max_run_cost_usd", default=None) is None:
        return default
    limit = reader.number("max_run_cost_usd", default=0)
    if limit <= 0:
        reader.fail("max_run_cost_usd", f"must be a positive number of US dollars, got {limit}")
    return float(limit)


def read_logs(reader: ConfigReader) -> LogsConfig:
    reader.only_keys({"training_jobs_retention_days"})
    days = reader.integer(
        "training_jobs_retention_days", default=LogsConfig.training_jobs_retention_days, minimum=1
    )
    if days not in LOG_RETENTION_DAYS:
        reader.fail(
            "training_jobs_retention_days",
            f"CloudWatch Logs keeps logs {', '.join(map(str, LOG_RETENTION_DAYS))} days; got {days}",
        )
    return LogsConfig(training_jobs_retention_days=days)


def read_quotas(reader: ConfigReader) -> QuotaConfig:
    reader.only_keys({"alarm_threshold_percent"})
    percent = reader.number("alarm_threshold_percent", default=QuotaConfig.alarm_threshold_percent)
    if not 0 < percent <= 100:
        reader.fail("alarm_threshold_percent", f"must be above 0 and at most 100, got {percent}")
    return QuotaConfig(alarm_threshold_percent=float(percent))


def read_warm_pools(reader: ConfigReader) -> WarmPoolConfig:
    reader.only_keys({"max_keep_alive_seconds", "idle_budget_seconds"})
    cap = reader.integer(
        "max_keep_alive_seconds",
        default=WarmPoolConfig.max_keep_alive_seconds,
        minimum=0,
        maximum=MAX_WARM_POOL_KEEP_ALIVE_SECONDS,
    )
    idle = reader.integer(
        "idle_budget_seconds", default=min(WarmPoolConfig.idle_budget_seconds, cap), minimum=0
    )
    if idle > cap:
        reader.fail(
            "idle_budget_seconds",
            f"{idle} exceeds max_keep_alive_seconds ({cap}); a pool "
            "never idles longer than the cap, so lower it to at most the cap",
        )
    return WarmPoolConfig(max_keep_alive_seconds=cap, idle_budget_seconds=idle)


def read_notifications(reader: ConfigReader) -> NotificationConfig:
    reader.only_keys({"email"})
    email = reader.optional_string("email", pattern=EMAIL_PATTERN, hint="an e-mail address")
    return NotificationConfig(email=email)


def read_tags(reader: ConfigReader, field_name: str) -> dict[str, str]:
    tags = reader.raw(field_name, default={})
    if not isinstance(tags, dict):
        reader.fail(field_name, "must be a mapping of tag key to string value")
    for key, value in tags.items():
        if not isinstance(key, str) or not _TAG_KEY.fullmatch(key) or key.lower().startswith("aws:"):
            reader.fail(
                f"{field_name}.{key}", "is not a valid tag key (1-128 characters, not starting with aws:)"
            )
        if not isinstance(value, str) or not _TAG_VALUE.fullmatch(value):
            reader.fail(f"{field_name}.{key}", "must be a string of at most 256 characters (quote numbers)")
    return dict(tags)
