"""FSDP2's collectives for CPU give gloo's own results, and FSDP2 on CPU uses them: gathers handed
back pending, reduce-scatters deferred to the end of backward only where nothing reads them sooner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training_jobs.trainer.cpu_collectives import custom_collectives_supported

from .conftest import torchrun

# The classes under test plug into FSDP2's custom-collective hooks, which older torch releases (the
# PyTorch 2.8 container's, under `make test-container`) lack; there the program keeps FSDP2's own.
pytestmark = pytest.mark.skipif(not custom_collectives_supported(),
                                reason="this torch's FSDP2 has no custom-collective hooks")

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


def test_fsdp2_on_cpu_gathers_through_them(three_processes):
    # Two decoder layers and the root each all-gather in forward; layer 0 again in backward.
    assert three_processes["fsdp"]["first_backward"]["all_gather"] >= 4


def test_a_first_backward_defers_every_reduce_scatter(three_processes):
    first = three_processes["fsdp"]["first_backward"]
    assert (first["deferred"], first["at_once"]) == (3, 0)


def test_accumulating_into_existing_gradients_reduces_at_once(three_processes):
    # FSDP2 adds to a gradient that exists, reading the output at once: no deferral then.
    both = three_processes["fsdp"]["both_backwards"]
    assert (both["deferred"], both["at_once"]) == (3, 3)


def test_deferring_changes_no_gradient_bit(three_processes):
    assert three_processes["fsdp"]["gradients_identical"] is True


def test_outside_a_backward_pass_the_overlapped_reduce_scatter_reduces_at_once(three_processes):
    assert three_processes["overlapped_outside_backward"] is True


def test_a_sum_is_reduced_at_once_even_inside_a_backward_pass(three_processes):
    # FSDP2 divides a summed output right after the call (the experts' gradient divide factor).
    assert three_processes["overlapped_sum_in_backward"] is True


def test_a_gradient_that_no_longer_views_the_output_fails_loudly(three_processes):
    # The sum itself still lands in the output; the error names the file to review.
    assert "cpu_collectives.py" in three_processes["unaliased_gradient"]


def test_a_parameter_without_gradient_does_not_trip_that_check(three_processes):
    # FSDP2 leaves unused (or frozen) parameters out of the reduce-scatter; LoRA relies on this.
    assert three_processes["unused_parameter"] is True
