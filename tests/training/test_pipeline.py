"""Pipeline parallelism end to end, and a run resumed on another cluster shape.

Every pipeline run trains the 4-layer tiny Llama on the samples the single-process reference
trains on, in the same order: the same global batch, split into grad_accum_steps micro-batches that
flow through the stages. What each comparison may differ by, and why:
- exactly equal: pipeline-only with every schedule and with masked (fine-tuning) data against the
  single process (losses, evaluations and the exported weights). A stage computes the same
  operations on the same micro-batch as the whole model, each micro-batch's loss is divided by the
  number of micro-batches before its backward as in the reference, and gradients accumulate
  micro-batch by micro-batch in the same order.
- pipeline x DDP against DDP without stages: the same losses to the last bit, weights within 1e-6
  (from the first step on, the stages' DDP reductions leave the weights a few float32 ulps apart,
  too little to change a logged loss).
- within 1e-5: the data-parallel runs against the single process that trains their whole batch
  (a mean over two ranks' half-batches rounds apart from one mean over the batch), pipeline x FSDP2
  and x tensor parallel (reduce-scatters and split matmuls add in other orders), the 3-D mesh, and
  activation checkpointing with compile (inductor fuses operations, rounding them differently).
Resumed runs equal their uninterrupted runs exactly. The runs with gradient clipping off measure
the norm across stages without using it; clipping across stages is compared on its own.

Resume on another shape: one FSDP2 run and one pipeline x FSDP2 run keep global_batch_size=8 on
4, then 2, then 4 ranks (grad_accum_steps is derived: 2, 4, 2 for FSDP2), checkpointing at
steps 2 and 4: DCP reshards model and optimizer state, the data continues at the next sample of
the global order, the schedule at the next step, and the losses follow the uninterrupted 4-rank
runs within 1e-5 (the batch is summed over other rank splits).
"""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import (
    CORPUS,
    EIGHT_RANK_JOBS,
    PIPELINE_BASE,
    PIPELINE_PP,
    REPO,
    TINY,
    TOKENIZER,
    child_env,
    job_root,
    losses,
    outcome,
    run_jobs,
    train_records,
)

pytestmark = pytest.mark.slow

BASE, PP = PIPELINE_BASE, PIPELINE_PP
FIRST_HALF = {"max_steps": 3, "checkpoint_every_steps": 3}
RESHAPE = {**TINY, "model_overrides": {"num_hidden_layers": 4}, "micro_batch_size": 1,
           "grad_accum_steps": 1, "global_batch_size": 8, "max_steps": 6, "lr_decay_steps": 6,
           "checkpoint_every_steps": 2}
RESHAPED = {"fsdp": {"parallelism": "fsdp"},
            "pp_fsdp": {"parallelism": "fsdp", "pipeline_parallel_degree": 2}}
MASKED_RUNS = ("single_masked", "masked")

# One torchrun launch per process count and phase; names are job folders.
REFERENCES = {
    "single": {**BASE, "parallelism": "single"},
    "single_batch16": {**BASE, "parallelism": "single", "micro_batch_size": 4},
    "single_masked": {**BASE, "parallelism": "single", "max_steps": 4},
    "single_clipped": {**BASE, "parallelism": "single", "max_grad_norm": 0.5},
}
TWO = {
    "ddp": {**BASE, "parallelism": "ddp"},
    "gpipe": {**PP, "pipeline_schedule": "gpipe"},
    "1f1b": {**PP, "pipeline_schedule": "1f1b"},
    "interleaved_1f1b": {**PP, "pipeline_schedule": "interleaved_1f1b"},
    "zero_bubble": {**PP, "pipeline_schedule": "zero_bubble"},
    "masked": {**PP, "max_steps": 4},
    "checkpointed_compiled": {**PP, "activation_checkpointing": "full", "compile": True},
    "clipped": {**PP, "max_grad_norm": 0.5, "pipeline_split": "1,3"},
    "1f1b_first_half": {**PP, **FIRST_HALF},
}
FOUR = {
    "pp_ddp": {**PP, "micro_batch_size": 2},
    "pp_ddp_gpipe": {**PP, "micro_batch_size": 2, "pipeline_schedule": "gpipe"},  # refused
    "pp_fsdp": {**PP, "parallelism": "fsdp", "micro_batch_size": 2},
    "pp_tp": {**PP, "parallelism": "fsdp", "tensor_parallel_degree": 2, "micro_batch_size": 4},
    "pp_fsdp_first_half": {**PP, "parallelism": "fsdp", "micro_batch_size": 2, **FIRST_HALF},
    "pp_tp_first_half": {**PP, "parallelism": "fsdp", "tensor_parallel_degree": 2,
                         "micro_batch_size": 4, **FIRST_HALF},
    **{f"{name}_4_ranks": {**RESHAPE, **hps} for name, hps in RESHAPED.items()},
    **{f"{name}_reshaped": {**RESHAPE, **hps, "max_steps": 2} for name, hps in RESHAPED.items()},
}
EIGHT = {"3d": EIGHT_RANK_JOBS["3d"]}  # launched with test_scale's (conftest.eight_rank_runs)
RESUME_TWO = {"1f1b_first_half": PP,
              **{f"{name}_reshaped": {**RESHAPE, **hps, "max_steps": 4} for name, hps in RESHAPED.items()}}
RESUME_FOUR = {"pp_fsdp_first_half": FOUR["pp_fsdp"], "pp_tp_first_half": FOUR["pp_tp"],
               **{f"{name}_reshaped": {**RESHAPE, **hps} for name, hps in RESHAPED.items()}}


@pytest.fixture(scope="module")
def masked_data(tmp_path_factory):
    """The shipped prompt/completion examples with their loss mask, as prepare_data writes them."""
    import subprocess
    import sys

    output = tmp_path_factory.mktemp("sft") / "tiny_sft"
    result = subprocess.run(
        [sys.executable, "-m", "training_jobs.prepare_data", "--input",
         str(CORPUS.parent / "tiny_sft" / "train.jsonl"), "--tokenizer", str(TOKENIZER), "--output",
         str(output), "--workers", "1", "--completion-key", "completion", "--validation-fraction", "0.2"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return output


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data, masked_data, eight_rank_runs):
    base = tmp_path_factory.mktemp("pipeline")
    roots = {}

    def launch(nproc: int, jobs: dict[str, dict]) -> str:
        for name in jobs:
            if name not in roots:
                source = masked_data if name in MASKED_RUNS else tiny_data
                roots[name] = job_root(base / name, source, validation=True)
        return run_jobs(nproc, [(roots[name], hps) for name, hps in jobs.items()], base).output

    launch(1, REFERENCES)
    launch(2, TWO)
    launch(4, FOUR)
    roots.update({name: eight_rank_runs[name] for name in EIGHT})
    roots["resumed launch output"] = launch(2, RESUME_TWO) + launch(4, RESUME_FOUR)
    return roots


def test_every_run_finished(runs):
    for name in [*REFERENCES, *TWO, *FOUR, *EIGHT]:
        if name != "pp_ddp_gpipe":
            assert outcome(runs[name]) == {"ok": True}, name


def test_gpipe_with_ddp_replicated_stages_is_refused_before_training(runs):
    """torch's DDP fails GPipe's second step (every forward before any backward: "rebuilt parameter
    indices size is not same as original model parameters size"); the run stops at setup instead,
    naming the schedule that works, and the launch goes on to the next job."""
    refused = outcome(runs["pp_ddp_gpipe"])
    assert refused["error"] == "ConfigError"
    assert "pipeline_schedule" in refused["message"] and "use 1f1b" in refused["message"]
    metrics = runs["pp_ddp_gpipe"] / "output" / "data" / "metrics.jsonl"
    assert not metrics.exists() or not train_records(runs["pp_ddp_gpipe"])
    assert not list(runs["pp_ddp_gpipe"].rglob("*.distcp"))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
def test_every_schedule_trains_exactly_like_the_single_process(runs, name):
    reference = train_records(runs["single"])
    records = train_records(runs[name])
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]
    assert [r["lr"] for r in records] == [r["lr"] for r in reference]
    assert _eval_losses(runs[name]) == _eval_losses(runs["single"])  # evaluated through the stages
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference],
                                                              rel=1e-6)


def test_masked_fine_tuning_data_keeps_the_per_token_loss_exactly(runs):
    assert losses(runs["masked"]) == losses(runs["single_masked"])
    assert _eval_losses(runs["masked"]) == _eval_losses(runs["single_masked"])


def test_pipeline_with_ddp_trains_like_ddp(runs):
    # The weights differ from DDP's by about 1e-7 from the first step on (the stages' gradients
    # are reduced in other buckets, so summed in another order): the losses follow within 1e-6.
    assert losses(runs["pp_ddp"]) == pytest.approx(losses(runs["ddp"]), abs=1e-6, rel=0)
    _assert_same_weights(runs["pp_ddp"], runs["ddp"], atol=1e-6)


@pytest.mark.parametrize("name", ["ddp", "pp_fsdp", "pp_tp", "3d", "checkpointed_compiled"])
def test_data_parallel_sharded_and_compiled_stages_within_1e_5(runs, name):
    reference = "single" if name == "checkpointed_compiled" else "single_batch16"
    assert losses(runs[name]) == pytest.approx(losses(runs[reference]), abs=1e-5, rel=0)
    assert _eval_losses(runs[name]) == pytest.approx(_eval_losses(runs[reference]), abs=1e-5, rel=0)


def test_gradient_clipping_measures_the_norm_over_every_stage(runs):
    clipped, reference = train_records(runs["clipped"]), train_records(runs["single_clipped"])
    assert max(r["grad_norm"] for r in reference) > 0.5  # clipping engaged
    assert losses(runs["clipped"]) == pytest.approx(losses(runs["single_clipped"]), abs=1e-5, rel=0)
    assert [r["grad_norm"] for r in clipped] == pytest.approx([r["grad_norm"] for r in reference],
                                                              rel=1e-5)


@pytest.mark.parametrize(("name", "uninterrupted"), [("1f1b_first_half", "1f1b"),
                                                     ("pp_fsdp_first_half", "pp_fsdp"),
                                                     ("pp_tp_first_half", "pp_tp")])
def test_a_resumed_pipeline_equals_the_uninterrupted_run_exactly(runs, name, uninterrupted):
    records = train_records(runs[name])
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == losses(runs[uninterrupted])
    assert f"resumed from {runs[name]}/checkpoints/step_00000003 at step 3" in \
        runs["resumed launch output"]


def test_the_export_is_one_ordinary_model_with_the_reference_outputs(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(str(runs["1f1b"] / "model")).eval()
    reference = AutoModelForCausalLM.from_pretrained(str(runs["single"] / "model")).eval()
    assert exported.config.num_hidden_layers == 4
    tokenizer = AutoTokenizer.from_pretrained(str(runs["1f1b"] / "model"))
    inputs = tokenizer(["The old farmer visits the green field slowly."], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(exported(**inputs).logits, reference(**inputs).logits)
    _assert_same_weights(runs["3d"], runs["single_batch16"], atol=1e-4)


@pytest.mark.parametrize("name", list(RESHAPED))
def test_a_run_resumed_on_2_then_4_ranks_follows_the_uninterrupted_4_rank_run(runs, name):
    reshaped, uninterrupted = runs[f"{name}_reshaped"], runs[f"{name}_4_ranks"]
    records = train_records(reshaped)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == pytest.approx(losses(uninterrupted), abs=1e-5, rel=0)
    assert [r["lr"] for r in records] == [r["lr"] for r in train_records(uninterrupted)]
    output = runs["resumed launch output"]
    data_parallel = 4 if name == "fsdp" else 2
    assert (f"resumed from {reshaped}/checkpoints/step_00000002 at step 2 (written by {data_parallel} "
            f"data-parallel ranks, resharded for {data_parallel // 2}; the data continues at sample 16 "
            "of the global order)") in output
    assert (f"resumed from {reshaped}/checkpoints/step_00000004 at step 4 (written by "
            f"{data_parallel // 2} data-parallel ranks, resharded for {data_parallel}; the data "
            "continues at sample 32 of the global order)") in output
    state = json.loads((reshaped / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["data"]["consumed_samples"] == 6 * 8 and state["parallel"]["data_parallel"] == data_parallel


def _eval_losses(root) -> list[float]:
    lines = (root / "output" / "data" / "metrics.jsonl").read_text().splitlines()
    return [r["eval_loss"] for r in map(json.loads, lines) if r["kind"] == "eval"]


def _assert_same_weights(root, reference, *, atol: float) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(root / "model" / "model.safetensors"))
    expected = load_file(str(reference / "model" / "model.safetensors"))
    assert weights.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(weights[key], tensor, atol=atol, rtol=0)
