"""Shared helpers of the job-template tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from llmtrain.core.catalog import Catalog
from llmtrain.core.platform import PlatformContext
from llmtrain.core.sourcedir import SNAPSHOT_FOLDER
from llmtrain.core.team_context import PlatformResources, TeamSettings, team_context

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_NAMES = (
    "byo-script",
    "gpt2-ddp",
    "llama-dpo",
    "llama-finetune-deepspeed",
    "llama-finetune-lora",
    "llama-finetune-qlora",
    "llama-grpo",
    "llama-pretrain-3d",
    "llama-pretrain-fsdp",
    "llama-pretrain-hsdp-tp",
    "llama-pretrain-smp",
    "llama3-405b",
    "llama3-70b",
    "llama3-8b-long-context",
    "moe-tiny-local",
    "qwen3-moe-finetune",
    "qwen3-moe-pretrain",
)
# The contract's example lines (docs/architecture.md, "Metric lines").
METRIC_LINE = (
    "[metrics] step=10 loss=4.123456 lr=3.000e-04 grad_norm=1.2345 tokens_per_sec=12345.6 "
    "mfu=0.4123 step_time=0.532 memory_gb=1.23"
)
EVAL_LINE = "[eval] step=100 eval_loss=3.987654"


def platform_context(**changes) -> PlatformContext:
    context = team_context(
        environment="test",
        region="us-east-1",
        account="123456789012",
        resources=PlatformResources(
            execution_role_arn="arn:aws:iam::123456789012:role/llmtrain-test-execution",
            datasets_bucket="llmtrain-test-datasets",
            checkpoints_bucket="llmtrain-test-checkpoints",
            artifacts_bucket="llmtrain-test-artifacts",
            code_bucket="llmtrain-test-code",
            kms_key_arn="arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab",
            subnet_ids=("subnet-0aaaaaaaaaaaaaaa1", "subnet-0aaaaaaaaaaaaaaa2"),
            security_group_ids=("sg-0bbbbbbbbbbbbbbb1",),
        ),
        team=TeamSettings(job_name_prefix="llmtrain-test", warm_pool_cap_seconds=3600),
    )
    return dataclasses.replace(context, **changes)


def catalog() -> Catalog:
    return Catalog.load()


def copy_catalog(destination: Path, names: tuple[str, ...] = TEMPLATE_NAMES) -> Path:
    """A copy of templates/ (the chosen templates and the whole lock) to change in a test."""
    folder = destination / "templates"
    folder.mkdir(parents=True)
    for name in names:
        shutil.copytree(REPO_ROOT / "templates" / name, folder / name)
    shutil.copy(REPO_ROOT / "templates" / "catalog.lock", folder / "catalog.lock")
    shutil.copytree(REPO_ROOT / "templates" / SNAPSHOT_FOLDER, folder / SNAPSHOT_FOLDER)
    return folder
