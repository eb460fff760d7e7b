"""Sequence parallel, loss parallel and context parallel end to end: every run trains the samples the
single-process reference trains on, in the same order (global_batch_size 8 on every shape), and
follows its losses, evaluations and gradient norms within 1e-4 (measured: within 1e-6;
tensor-parallel matmuls, vocabulary-sharded log-sum-exps and context-parallel attention add in
other orders).

One launch per process count: the references (1), tensor parallel with and without sequence
parallel, with selective checkpointing, and context parallel (2), their compositions with FSDP and
with pipeline stages, and the resumed runs (4), and pipeline x context x tensor (8, three steps).

Resharded resume: a tensor-parallel run with sequence parallel (2 ranks) and a context-parallel run
(2 ranks) stop at step 3 with a checkpoint; they resume on 4 ranks, the first as 2 data-parallel x
2 tensor-parallel ranks without sequence parallel, the second with context_parallel_degree 4 (the
parameters and optimizer state are resharded by DCP), and the whole runs still follow the
reference within 1e-4.
"""

from __future__ import annotations

import json

import pytest

from .conftest import (
    EIGHT_RANK_JOBS,
    SCALE_BASE,
    SCALE_FSDP,
    job_root,
    losses,
    outcome,
    run_jobs,
    train_records,
)

pytestmark = pytest.mark.slow

BASE, FSDP = SCALE_BASE, SCALE_FSDP
FIRST_HALF = {"max_steps": 3, "checkpoint_every_steps": 3}
KV4 = {"model_overrides": {"num_key_value_heads": 4}}  # 4 tensor-parallel ranks need 4 kv heads

REFERENCES = {"single": {**BASE, "parallelism": "single"},
              "single_kv4": {**BASE, "parallelism": "single", **KV4}}
TWO = {
    "tp2": {**FSDP, "tensor_parallel_degree": 2},
    "tp2_without_sp": {**FSDP, "tensor_parallel_degree": 2, "sequence_parallel": False},
    "tp2_selective": {**FSDP, "tensor_parallel_degree": 2, "activation_checkpointing": "selective"},
    "cp2": {**FSDP, "context_parallel_degree": 2},
    "cp2_selective": {**FSDP, "context_parallel_degree": 2, "activation_checkpointing": "selective"},
    "tp2_resharded": {**FSDP, "tensor_parallel_degree": 2, **FIRST_HALF},
    "cp2_resharded": {**FSDP, "context_parallel_degree": 2, **FIRST_HALF},
}
FOUR = {
    "cp2_tp2": {**FSDP, "context_parallel_degree": 2, "tensor_parallel_degree": 2},
    # eval_steps 1 on two data-parallel ranks: the reference's validation samples
    "dp2_cp2": {**FSDP, "context_parallel_degree": 2, "eval_steps": 1},
    "cp4": {**FSDP, "context_parallel_degree": 4},
    "tp4": {**FSDP, "tensor_parallel_degree": 4, **KV4},
    "pp2_tp2": {**FSDP, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2},
    "pp2_cp2": {**FSDP, "pipeline_parallel_degree": 2, "context_parallel_degree": 2},
}
RESUMED_FOUR = {
    "tp2_resharded": {**FSDP, "tensor_parallel_degree": 2, "sequence_parallel": False, "eval_steps": 1},
    "cp2_resharded": {**FSDP, "context_parallel_degree": 4},
}
EIGHT = {"pp2_cp2_tp2": EIGHT_RANK_JOBS["pp2_cp2_tp2"]}  # launched with test_pipeline's (conftest)
REFERENCE_OF = {"tp4": "single_kv4"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data, eight_rank_runs):
    base = tmp_path_factory.mktemp("scale")
    roots = {}

    def launch(nproc: int, jobs: dict[str, dict]) -> str:
        for name in jobs:
            if name not in roots:
                roots[name] = job_root(base / name, tiny_data, validation=True)
        return run_jobs(nproc, [(roots[name], hps) for name, hps in jobs.items()], base).output

    launch(1, REFERENCES)
    launch(2, TWO)
    roots["launch output"] = launch(4, {**FOUR, **RESUMED_FOUR})
    roots.update({name: eight_rank_runs[name] for name in EIGHT})
    return roots


def _eval_losses(root) -> list[float]:
    lines = (root / "output" / "data" / "metrics.jsonl").read_text().splitlines()
    return [r["eval_loss"] for r in map(json.loads, lines) if r["kind"] == "eval"]


def test_every_run_finished(runs):
    for name in [*REFERENCES, *TWO, *FOUR, *EIGHT]:
        assert outcome(runs[name]) == {"ok": True}, name


@pytest.mark.parametrize("name", [*TWO, *FOUR, *EIGHT])
def test_sequence_loss_and_context_parallel_follow_the_single_process_within_1e_4(runs, name):
    reference = runs[REFERENCE_OF.get(name, "single")]
    expected = losses(reference)[:len(losses(runs[name]))]
    assert len(expected) == (EIGHT.get(name) or BASE)["max_steps"]
    assert losses(runs[name]) == pytest.approx(expected, abs=1e-4, rel=0)
    records, reference_records = train_records(runs[name]), train_records(reference)[:len(expected)]
    assert [r["lr"] for r in records] == [r["lr"] for r in reference_records]
    # the global gradient norm sums every shard once (tensor, sequence, context and FSDP shards)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference_records],
                                                              rel=1e-4)
    evaluations = _eval_losses(runs[name])
    assert evaluations == pytest.approx(_eval_losses(reference)[:len(evaluations)], abs=1e-4, rel=0)


def test_the_reference_learns(runs):
    curve = losses(runs["single"])
    assert curve[-1] < curve[0] - 0.1


@pytest.mark.parametrize("name", list(RESUMED_FOUR))
def test_a_run_resumed_on_another_shape_follows_the_reference(runs, name):
    """tp2_resharded: written by tensor parallel x 2 with sequence parallel on 2 ranks, resumed on 2
    data-parallel x 2 tensor-parallel ranks without it; cp2_resharded: written with
    context_parallel_degree 2, resumed with 4. DCP reshards the parameters and optimizer state (FSDP
    shards over shard x context ranks), the data continues at the next sample."""
    records = train_records(runs[name])
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == pytest.approx(losses(runs["single"]), abs=1e-4, rel=0)
    assert f"resumed from {runs[name]}/checkpoints/step_00000003 at step 3" in runs["launch output"]
    state = json.loads((runs[name] / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["data"]["consumed_samples"] == 6 * 8
    assert state["parallel"]["context"] == (4 if name == "cp2_resharded" else 1)
