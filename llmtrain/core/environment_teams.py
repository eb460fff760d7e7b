"""Reading the teams of ``config/<name>.yaml`` and the environment's AWS Batch queues.

`teams:` maps team names to their settings (without it, the environment has one default team);
`queues:` declares the job queues every run goes through, and each team's place in them (share
weight, highest priority, queues). Each team is checked against the environment's own settings: its
templates among the enabled ones, its caps at most the environment's.
"""

from __future__ import annotations

import dataclasses
import re

from llmtrain.core import queue_policy
from llmtrain.core.config_reader import ConfigReader
from llmtrain.core.environment_model import JobQueueConfig, QueuesConfig, TeamConfig
from llmtrain.core.environment_sections import TEMPLATE_NAME, read_notifications, read_run_cost, read_tags
from llmtrain.core.platform import TEAM_NAME_PATTERN, team_job_name_prefix

_INSTANCE_TYPE = re.compile(r"^ml\.[a-z0-9]+\.[a-z0-9]+$")


def read_teams(
    reader: ConfigReader, defaults: TeamConfig, environment_prefix: str, queues: QueuesConfig | None
) -> tuple[TeamConfig, ...]:
    """`teams:` maps team names to their settings; without it the environment has the default team."""
    if reader.raw("teams", default=None) is None:
        return (defaults,)
    teams = reader.raw("teams")
    if not isinstance(teams, dict) or not teams:
        reader.fail("teams", "must map team names to their settings, e.g. teams: {nlp: {templates: [...]}}")
    read = []
    for name in teams:
        if not isinstance(name, str) or not TEAM_NAME_PATTERN.fullmatch(name):
            reader.fail(
                f"teams.{name}",
                "is not a valid team name: 1-12 lowercase letters and digits, starting with a letter (no "
                "hyphens: a team's jobs are named <job_name_prefix>-<team>-..., and IAM matches them by "
                "that prefix)",
            )
        section = reader.section("teams").section(name, required=False)
        team = _read_team(section, name, defaults, environment_prefix)
        read.append(_read_team_queues(section, team, queues))
    return tuple(read)


def _read_team(reader: ConfigReader, name: str, defaults: TeamConfig, environment_prefix: str) -> TeamConfig:
    reader.only_keys(
        {
            "templates",
            "instance_types",
            "max_instance_count",
            "max_keep_alive_seconds",
            "max_run_cost_usd",
            "notifications",
            "tags",
            "share_weight",
            "max_priority",
            "queues",
        }
    )
    templates = defaults.templates
    if reader.raw("templates", default=None) is not None:
        templates = reader.string_list("templates", min_items=1, pattern=TEMPLATE_NAME)
        outside = [t for t in templates if t not in defaults.templates]
        if outside:
            reader.fail(
                "templates",
                f"{', '.join(outside)} not enabled in this environment (job_templates.enabled: "
                f"{', '.join(defaults.templates)}); a team runs a subset of them",
            )
    instance_types = None
    if reader.raw("instance_types", default=None) is not None:
        instance_types = reader.string_list("instance_types", min_items=1, pattern=_INSTANCE_TYPE)
    cap = defaults.max_keep_alive_seconds
    keep_alive = reader.integer("max_keep_alive_seconds", default=cap, minimum=0)
    if keep_alive > cap:
        reader.fail(
            "max_keep_alive_seconds",
            f"{keep_alive} exceeds the environment's warm_pools.max_keep_alive_seconds ({cap}); a team's cap "
            "is at most the environment's",
        )
    max_instances = None
    if reader.raw("max_instance_count", default=None) is not None:
        max_instances = reader.integer("max_instance_count", default=1, minimum=1)
    notifications = read_notifications(reader.section("notifications", required=False))
    return TeamConfig(
        name=name,
        job_name_prefix=team_job_name_prefix(environment_prefix, name),
        templates=templates,
        instance_types=instance_types,
        max_instance_count=max_instances,
        max_keep_alive_seconds=keep_alive,
        notification_email=notifications.email or defaults.notification_email,
        max_run_cost_usd=read_run_cost(reader, defaults.max_run_cost_usd),
        tags=read_tags(reader, "tags"),
    )


def read_queues(reader: ConfigReader) -> QueuesConfig:
    reader.only_keys({"max_instances", "job_queues", "default_queue", "share_decay_seconds",
                      "compute_reservation", "capacity_wait_seconds", "misconfiguration_wait_seconds"})
    queues = reader.raw("job_queues")
    if not isinstance(queues, dict) or not queues:
        reader.fail("job_queues", "must map queue names to their settings, e.g. job_queues: {standard: "
                                  "{priority: 10}, urgent: {priority: 100}}")
    job_queues = []
    for name in queues:
        if not isinstance(name, str) or not queue_policy.QUEUE_NAME_PATTERN.fullmatch(name):
            reader.fail(f"job_queues.{name}", "is not a queue name: 1-16 lowercase letters and digits, "
                                              "starting with a letter")
        section = reader.section("job_queues").section(name, required=False)
        section.only_keys({"priority"})
        priority = section.integer("priority", default=0, minimum=0, maximum=queue_policy.MAX_QUEUE_PRIORITY)
        job_queues.append(JobQueueConfig(name=name, priority=priority))
    names = tuple(queue.name for queue in job_queues)
    default_queue = reader.raw("default_queue", default=names[0])
    if default_queue not in names:
        reader.fail("default_queue", f"{default_queue!r} is not one of job_queues ({', '.join(names)})")
    if reader.raw("max_instances", default=None) is None:
        reader.fail("max_instances", "is required: the most instances the environment's runs use at once")
    limits = (queue_policy.MIN_TIME_LIMIT_SECONDS, queue_policy.MAX_TIME_LIMIT_SECONDS)
    return QueuesConfig(
        max_instances=reader.integer("max_instances", default=1, minimum=1),
        job_queues=tuple(job_queues),
        default_queue=default_queue,
        share_decay_seconds=reader.integer("share_decay_seconds", default=QueuesConfig.share_decay_seconds,
                                           minimum=0, maximum=queue_policy.MAX_SHARE_DECAY_SECONDS),
        compute_reservation=reader.integer("compute_reservation", default=0, minimum=0,
                                           maximum=queue_policy.MAX_COMPUTE_RESERVATION),
        capacity_wait_seconds=reader.integer("capacity_wait_seconds",
                                             default=QueuesConfig.capacity_wait_seconds,
                                             minimum=limits[0], maximum=limits[1]),
        misconfiguration_wait_seconds=reader.integer("misconfiguration_wait_seconds",
                                                     default=QueuesConfig.misconfiguration_wait_seconds,
                                                     minimum=limits[0], maximum=limits[1]),
    )


def _read_team_queues(reader: ConfigReader, team: TeamConfig, queues: QueuesConfig | None) -> TeamConfig:
    """A team's place in the environment's queues: its share weight, highest priority and queues."""
    asked = [key for key in ("share_weight", "max_priority", "queues") if key in reader.data]
    if queues is None:
        if asked:
            reader.fail(asked[0], "the environment has no queues: add a queues: section to the environment, "
                                  "or remove this field")
        return team
    weight = reader.raw("share_weight", default=1)
    problem = queue_policy.share_weight_problem(weight)
    if problem:
        reader.fail("share_weight", problem)
    max_priority = reader.integer("max_priority", default=0, minimum=0,
                                  maximum=queue_policy.MAX_SCHEDULING_PRIORITY)
    own = None
    if "queues" in reader.data:
        own = reader.string_list("queues", min_items=1)
        unknown = [name for name in own if name not in queues.queue_names]
        if unknown:
            reader.fail("queues", f"{', '.join(unknown)} not among the environment's queues.job_queues "
                                  f"({', '.join(queues.queue_names)})")
    if team.max_instance_count is not None and team.max_instance_count > queues.max_instances:
        reader.fail("max_instance_count", f"{team.max_instance_count} exceeds queues.max_instances "
                                          f"({queues.max_instances}): such a run could never leave the queue")
    return dataclasses.replace(team, share_weight=weight, max_priority=max_priority, queues=own)
