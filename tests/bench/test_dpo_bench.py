"""The DPO benchmark's pure parts (bench.dpo). Its run (our program and TRL's DPOTrainer, a few DPO
steps each of the tiny model on the shipped pairs) is checked where `bench.run` already makes it:
tests/bench/test_bench_smoke.py, `test_the_dpo_side_by_side_is_well_formed`."""

from __future__ import annotations

from bench.timing import step_cpu_times


def test_cpu_seconds_per_step_come_from_the_step_lines_after_the_warm_up():
    lines = [(0.0, "loading"), (1.0, "[metrics] step=1 loss=1"), (2.0, "noise"), (3.0, "[bench] step=2"),
             (4.0, "[bench] step=4")]
    cpu = [0.5, 2.0, 2.5, 5.0, 9.0]
    assert step_cpu_times(lines, cpu, warmup_steps=0) == [3.0, 2.0]
    assert step_cpu_times(lines, cpu, warmup_steps=2) == [2.0]
