"""FSDP2's collectives for CPU give gloo's own results, and FSDP2 on CPU uses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import torchrun

WORKER = Path(__file__).resolve().parent / "collectives_worker.py"


@pytest.fixture(scope="module")
def three_processes(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("collectives") / "results.json"
    completed = torchrun(3, WORKER, [str(out)])
    assert completed.returncode == 0, completed.output[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("check", ["all_gather_fp32", "all_gather_bf16", "all_gather_subgroup",
                                   "reduce_scatter_sum", "reduce_scatter_avg"])
def test_cpu_collectives_equal_gloos_own(three_processes, check):
    assert three_processes[check] is True


def test_reductions_other_than_sum_and_average_are_refused_by_name(three_processes):
    assert "sums or averages" in three_processes["refusal"]
    assert "MAX" in three_processes["refusal"]


def test_fsdp2_on_cpu_gathers_and_reduces_through_them(three_processes):
    # Two decoder layers and the root: each all-gathers in forward, and reduce-scatters in backward.
    assert three_processes["fsdp_calls"]["reduce_scatter"] == 3
    assert three_processes["fsdp_calls"]["all_gather"] >= 3
