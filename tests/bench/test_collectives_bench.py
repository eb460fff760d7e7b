"""`python -m bench.collectives` keeps working: a tiny run through torchrun (no timing assertions)."""

from __future__ import annotations

import json
import math

from bench.collectives import main


def test_tiny_run_reports_every_collective_and_step_variant(tmp_path):
    out = tmp_path / "collectives.json"
    assert main(["--megabytes", "0.05", "--calls", "2", "--rounds", "1", "--steps", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["processes"] == 2
    assert sorted(report["median_ms"]) == [
        "all_gather_gloo_ms", "all_gather_ours_ms", "fsdp2_step_gloo_ms", "fsdp2_step_ours_blocking_ms",
        "fsdp2_step_ours_ms", "reduce_scatter_gloo_ms", "reduce_scatter_ours_ms"]
    assert all(math.isfinite(value) and value > 0 for value in report["median_ms"].values())
