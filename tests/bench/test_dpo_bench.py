"""The DPO benchmark (bench.dpo) keeps working: our program and TRL's DPOTrainer each run a few DPO
steps of the tiny model on the shipped pairs, in the `tiny` mode, and the result and its report line
are well formed. No timing assertions: benchmarks are not tests."""

from __future__ import annotations

import json
import math

import pytest

from bench import report
from bench.derive import lookup
from bench.dpo import main
from bench.timing import step_cpu_times


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_cpu_seconds_per_step_come_from_the_step_lines_after_the_warm_up():
    lines = [(0.0, "loading"), (1.0, "[metrics] step=1 loss=1"), (2.0, "noise"), (3.0, "[bench] step=2"),
             (4.0, "[bench] step=4")]
    cpu = [0.5, 2.0, 2.5, 5.0, 9.0]
    assert step_cpu_times(lines, cpu, warmup_steps=0) == [3.0, 2.0]
    assert step_cpu_times(lines, cpu, warmup_steps=2) == [2.0]


@pytest.mark.slow
def test_dpo_bench_runs_both_sides_and_reports_the_ratio(tmp_path):
    out = tmp_path / "dpo.json"
    assert main(["--mode", "tiny", "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["status"] == "ok"
    for side in ("ours", "trl"):
        record = result[side]
        assert record["status"] == "ok", record.get("error")
        assert _positive(record["step_time_s"]) and _positive(record["pairs_per_s"])
        assert record["step_times_s"] and all(_positive(t) for t in record["step_times_s"])
        assert len(record["cpu_step_times_s"]) == len(record["step_times_s"])
        assert all(_positive(t) for t in record["cpu_step_times_s"])
        assert math.isfinite(record["final_loss"])
    # each side trained DPO: its loss starts at log 2 (policy = reference) and is a DPO loss, not LM's
    assert 0 < result["ours"]["final_loss"] < 2 and 0 < result["trl"]["final_loss"] < 2
    assert result["ratio"] == pytest.approx(result["trl"]["step_time_s"] / result["ours"]["step_time_s"])
    assert len(result["ratio_by_round"]) == 1 and lookup(result, "ratio") == result["ratio"]
    ours_cpu, trl_cpu = result["ours"]["cpu_step_time_s"], result["trl"]["cpu_step_time_s"]
    assert result["cpu_ratio"] == pytest.approx(trl_cpu / ours_cpu)
    line = report.dpo_line(result)
    assert "TRL's DPOTrainer" in line and f"{result['ratio']:.2f}x" in line
    assert f"{result['cpu_ratio']:.2f}x" in line
