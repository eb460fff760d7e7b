"""The teams of an environment as the constructs take them: `config/<env>.yaml` plus the catalog."""

from __future__ import annotations

from llmtrain.core.catalog import Catalog
from llmtrain.core.environments import EnvironmentConfig, TeamConfig
from training_constructs.teams import TeamSpec


def team_specs(config: EnvironmentConfig, catalog: Catalog) -> list[TeamSpec]:
    """One TeamSpec per team of the environment (the implicit `default` team without `teams:`)."""
    return [_team_spec(team, catalog) for team in config.teams]


def _team_spec(team: TeamConfig, catalog: Catalog) -> TeamSpec:
    # Without instance_types, a team may use every type its templates may run on (every version's
    # own type, its fallbacks and the choices a run may pick).
    types = team.instance_types or catalog.instance_types(team.templates)
    return TeamSpec(
        name=team.name,
        job_name_prefix=team.job_name_prefix,
        instance_types=types,
        max_keep_alive_seconds=team.max_keep_alive_seconds,
        max_instance_count=team.max_instance_count,
        templates=team.templates,
        notification_email=team.notification_email,
        max_run_cost_usd=team.max_run_cost_usd,
        tags=team.tags,
        share_weight=team.share_weight,
        max_priority=team.max_priority,
        queues=team.queues or (),
    )
