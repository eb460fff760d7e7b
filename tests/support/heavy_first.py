"""Orders the collected tests so that the files with the longest launches start first.

`make test` runs every test file on one of two workers (pytest-xdist, `--dist loadfile
--no-loadscope-reorder`); the workers take files in collection order. Started last, one of these
files would run alone on one core at the end: longest first keeps both cores busy to the end. The
order is a clean-clone run's `--durations` (2026-11-29, the second; docs/architecture.md gives its
total); a file missing from HEAVY keeps its place after them."""

from __future__ import annotations

HEAVY = (
    "tests/e2e/test_local_templates.py",
    "tests/training/test_pipeline.py",
    "tests/bench/test_plan_bench.py",
    "tests/training/test_scale.py",
    "tests/e2e/test_local_tune.py",
    "tests/training/test_equivalence.py",
    "tests/e2e/test_local_posttraining_templates.py",
    "tests/training/test_expert_parallel.py",
    "tests/bench/test_bench_smoke.py",
    "tests/llmtrain/test_cli_wheel.py",
    "tests/training/test_checkpoint_resume.py",
    "tests/training/test_preference_data.py",
    "tests/training/test_grpo.py",
    "tests/infra/test_consumer_example.py",
    "tests/training/test_dpo.py",
    "tests/training/test_lora.py",
    "tests/e2e/test_demo.py",
    "tests/infra/test_platform.py",
    "tests/training/test_rules.py",
    "tests/bench/test_moe_bench.py",
    "tests/infra/test_queues.py",
    "tests/training/test_data_pipeline.py",
    "tests/llmtrain/test_planner.py",
    "tests/infra/test_services.py",
    "tests/e2e/test_local_toolkit.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: index for index, path in enumerate(HEAVY)}

    def place(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(HEAVY))

    items.sort(key=place)  # stable: a file's tests keep their order
