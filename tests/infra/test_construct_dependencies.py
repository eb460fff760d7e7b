"""The construct library's dependency surface (constructs/README.md, "What it depends on").

`training_constructs` imports only the documented part of `llmtrain`, and importing it loads none of
the CLI's modules; the functions' settings reach their environments only through their records'
`to_environment()`, so no construct spells a variable name.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from llmtrain.core.function_settings import (
    ALL_SETTINGS,
    JobEventSettings,
    LauncherSettings,
    PreparationSettings,
    QuotaSettings,
    ReaperSettings,
    WatchSettings,
)

ROOT = Path(__file__).resolve().parents[2]
CONSTRUCTS = ROOT / "constructs" / "training_constructs"
# The construct library imports llmtrain's torch-free core only (constructs/README.md, "What it depends
# on"; import-linter's `constructs-on-core` contract checks the same at `make lint`).
CORE = "llmtrain.core"
# What the CLI, the local runner and the functions' own modules are: never loaded by a synth.
NOT_LOADED = (
    "llmtrain.cli",
    "llmtrain.commands",
    "llmtrain.client.launcher",
    "llmtrain.client.run_views",
    "llmtrain.client.job_telemetry",
    "llmtrain.local",
    "llmtrain.client.datasets",
    "llmtrain.client.aws",
    "llmtrain.core.environments",
    "llmtrain.core.environment_model",
    "llmtrain.core.environment_sections",
    "llmtrain.core.environment_teams",
    "llmtrain.core.config_reader",
    "llmtrain.core.stack_outputs",
    "llmtrain.planner",
    "llmtrain.handlers",
    "llmtrain.operations",
    "llmtrain.core.runs",
)


def _imported_modules(path: Path) -> set[str]:
    """The llmtrain modules a file imports (`from llmtrain import x` counts as `llmtrain.x` when x is a
    module, else `llmtrain`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            for alias in node.names:
                if (ROOT / node.module.replace(".", "/") / f"{alias.name}.py").is_file():
                    found.add(f"{node.module}.{alias.name}")
    return {name for name in found if name == "llmtrain" or name.startswith("llmtrain.")}


def test_the_constructs_import_only_the_core_of_llmtrain():
    imported = {path.name: _imported_modules(path) for path in sorted(CONSTRUCTS.glob("*.py"))}
    allowed = ("llmtrain", CORE)
    outside = {name: sorted(m for m in modules if m not in allowed and not m.startswith(CORE + "."))
               for name, modules in imported.items()}
    assert {name: modules for name, modules in outside.items() if modules} == {}
    # The table in constructs/README.md names every core module they import.
    readme = (ROOT / "constructs" / "README.md").read_text()
    table = readme.split("## What it depends on", 1)[1].split("## ", 1)[0]
    used = set().union(*imported.values()) - {"llmtrain", CORE}
    assert [module for module in sorted(used) if f"`{module}`" not in table] == [], table


def _requirements(pyproject: Path, extra: str | None = None) -> set[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    listed = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {re.split(r"[<>=!~\[ @;]", requirement, maxsplit=1)[0].lower() for requirement in listed}


def test_the_construct_library_depends_on_what_the_core_needs_and_the_cdk():
    """What `pip install llmtrain-constructs` brings: the CDK, and of the platform's distribution only
    its core's dependencies (the CLI's come with its extras)."""
    assert _requirements(ROOT / "pyproject.toml") == {"boto3", "botocore", "pyyaml", "regex"}
    assert {"rich", "psutil"} <= _requirements(ROOT / "pyproject.toml", "cli")
    assert _requirements(ROOT / "constructs" / "pyproject.toml") == {
        "llm-sagemaker-platform", "aws-cdk-lib", "constructs", "pyyaml", "packaging"}


def test_a_synth_loads_none_of_the_cli_and_no_training_packages():
    probe = (
        "import sys, json\n"
        "import training_constructs, training_constructs.launcher, training_constructs.operations\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    path = os.pathsep.join(filter(None, (str(ROOT), str(ROOT / "constructs"), os.environ.get("PYTHONPATH"))))
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": path})
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert [m for m in loaded if m.startswith(NOT_LOADED)] == []
    assert [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "numpy", "matplotlib")] == []


@pytest.mark.parametrize(
    "settings",
    [
        LauncherSettings(
            platform_context={"team": "nlp", "subnet_ids": ["subnet-1"]},
            request_layouts={"all": ["A", "B"]},
            templates_dir="/var/task/templates",
        ),
        WatchSettings(platform_context={"team": "nlp", "queues": {"default_queue": "standard"}}),
        PreparationSettings(platform_context={"team": "nlp"}, processing_role_arn="arn:aws:iam::1:role/p",
                            templates_dir="/var/task/templates"),
        QuotaSettings(instance_types=("ml.p4d.24xlarge", "ml.p5.48xlarge"), cache_ttl_seconds=600),
        ReaperSettings(job_name_prefix="llmtrain-dev-", idle_budget_seconds=900, environment="dev",
                       instance_types=("ml.g5.2xlarge",), dry_run=True),
        JobEventSettings(job_name_prefix="llmtrain-dev-", environment="dev", topic_arn="arn:topic"),
    ],
    ids=lambda settings: type(settings).__name__,
)
def test_each_function_reads_back_the_environment_its_record_writes(settings):
    environment = settings.to_environment()
    assert all(isinstance(value, str) for value in environment.values())
    assert type(settings).from_environment(environment) == settings


def test_no_construct_spells_a_function_s_variable_name():
    samples = (
        LauncherSettings(platform_context={}, request_layouts={}, templates_dir="x"),
        WatchSettings(platform_context={}),
        PreparationSettings(platform_context={}, processing_role_arn="r", templates_dir="x"),
        QuotaSettings(instance_types=("ml.p4d.24xlarge",)),
        ReaperSettings(job_name_prefix="p-", idle_budget_seconds=1, environment="e"),
        JobEventSettings(job_name_prefix="p-", environment="e"),
    )
    assert {type(s) for s in samples} == set(ALL_SETTINGS)
    names = {name for settings in samples for name in settings.to_environment()}
    spelled = {
        (path.name, node.value)
        for path in CONSTRUCTS.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    }
    assert spelled == set()
