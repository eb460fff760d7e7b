"""Shared fixtures: the platform app synthesized once per session, with cdk-nag, from config/.

Tests read the synthesized templates (``platform.template_json("dev", "network")``) instead of
synthesizing again, which keeps the infra suite fast on a 2-core machine.
"""

from __future__ import annotations

import aws_cdk as cdk
import pytest
from infra_helpers import CONFIG_DIR, PARTS, SynthesizedApp, synthesize

from llmtrain.core.environments import EnvironmentConfig, load_environments
from stacks import add_platform_stages


@pytest.fixture(scope="session")
def environments() -> dict[str, EnvironmentConfig]:
    return load_environments(CONFIG_DIR)


@pytest.fixture(scope="session")
def platform(environments, tmp_path_factory) -> SynthesizedApp:
    """The real app, as app.py builds it, from every file in config/."""
    outdir = tmp_path_factory.mktemp("cdk.out")
    app = cdk.App(outdir=str(outdir))
    stages = add_platform_stages(app, environments.values())
    stacks = {(stage.config.name, part): getattr(stage, part) for stage in stages for part in PARTS}
    synthesized = synthesize(app, outdir, stacks)
    synthesized.stages = {stage.config.name: stage for stage in stages}
    return synthesized
