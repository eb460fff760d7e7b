"""The rules, each with its fault injected into a real CPU run (LLMTRAIN_TEST_FAULTS), each action.

One 2-rank torchrun launch runs the jobs of the loss, gradient and throughput rules side by side
(start-up costs more than a job); the hang watchdog kills its job, so it has a launch of its own. A
loss fault is injected on rank 1 only: the rules judge the global loss, and both ranks act alike.
The rules arm after 2 warm-up steps and 5 healthy steps (MIN_HISTORY); the faults hit step 10.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from training_jobs.trainer.faults import ENVIRONMENT_VARIABLE
from training_jobs.trainer.watchdog import HANG_EXIT_CODE

from .conftest import REPO, TINY, TRAIN, child_env, job_root, losses, outcome, run_jobs, train_records

pytestmark = pytest.mark.slow

FAULT_STEP = 10
BASE = {**TINY, "max_steps": 14, "rule_warmup_steps": 2, "checkpoint_every_steps": 8}
SPIKE_ON_RANK_1 = {"loss_spike": {"steps": [FAULT_STEP], "add": 50.0, "ranks": [1], "once": True}}
EXPLOSION = {"grad_explosion": {"steps": [FAULT_STEP], "factor": 1e4, "once": True}}


def _faults(spec: dict) -> dict:
    return {ENVIRONMENT_VARIABLE: json.dumps(spec)}


JOBS = {
    # name: (hyperparameters, faults)
    "healthy": ({**BASE}, {}),
    "spike_log": ({**BASE, "rule_loss_spike_action": "log"}, SPIKE_ON_RANK_1),
    "spike_skip": ({**BASE, "rule_loss_spike_action": "skip", "checkpoint_every_steps": 1,
                    "keep_checkpoints": 20}, SPIKE_ON_RANK_1),
    "spike_rollback": ({**BASE, "parallelism": "fsdp"}, SPIKE_ON_RANK_1),
    # What the roll-back must train: steps 1-8, then from step 8's state the batches after step 10's.
    "rollback_reference": ({**BASE, "parallelism": "fsdp"},
                           {"drop_batch": {"steps": [9], "batches": 2, "once": True}}),
    "spike_stop": ({**BASE, "rule_loss_spike_action": "stop"}, SPIKE_ON_RANK_1),
    "persistent_spike": ({**BASE, "rule_max_rollbacks": 2},
                         {"loss_spike": {"steps": [FAULT_STEP], "add": 50.0}}),
    "explosion_skip": ({**BASE, "rule_grad_norm_action": "skip"}, EXPLOSION),
    "explosion_stop": ({**BASE, "rule_grad_norm_action": "stop"}, EXPLOSION),
    # DeepSpeed measures the gradient norm only where it clips
    "deepspeed_rollback": ({**BASE, "parallelism": "deepspeed", "max_grad_norm": 1.0,
                            "rule_grad_norm_action": "rollback"}, EXPLOSION),
    # a 6 s stall against steps of 0.05-0.2 s: far below 0.05 x, which a busy machine never is
    "stall_stop": ({**BASE, "rule_throughput_action": "stop", "rule_throughput_fraction": 0.05},
                   {"stall": {"steps": [FAULT_STEP], "seconds": 6.0}}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    base = tmp_path_factory.mktemp("rules")
    roots = {name: job_root(base / name, tiny_data) for name in JOBS}
    run_jobs(2, [(roots[name], hps, _faults(faults) if faults else {})
                 for name, (hps, faults) in JOBS.items()], base)
    return roots


def rule_records(root) -> list[dict]:
    lines = (root / "output" / "data" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == "rule"]


def _acting(root) -> list[tuple[str, int, str]]:
    """(rule, step, action) of every verdict but a logged throughput drop: on this shared machine a
    window's speed varies, and logging it is all the default does."""
    return [(r["rule"], r["step"], r["action"]) for r in rule_records(root) if "action" in r
            and (r["rule"], r["action"]) != ("throughput_drop", "log")]


def _steps(root) -> list[int]:
    return [record["step"] for record in train_records(root)]


def test_a_run_without_a_fault_is_left_alone_by_the_default_rules(runs):
    assert outcome(runs["healthy"]) == {"ok": True}
    assert _acting(runs["healthy"]) == []
    assert _steps(runs["healthy"]) == list(range(1, 15))


def test_a_logged_loss_spike_is_reported_on_the_global_loss_and_training_goes_on(runs):
    root = runs["spike_log"]
    assert outcome(root) == {"ok": True}
    [verdict] = [r for r in rule_records(root) if r["rule"] == "loss_spike"]
    healthy = losses(runs["healthy"])
    # rank 1's loss + 50 is the global mean's + 25; the threshold is 3 x the healthy steps' mean
    assert verdict["step"] == FAULT_STEP and verdict["action"] == "log"
    assert verdict["value"] == pytest.approx(healthy[FAULT_STEP - 1] + 25.0, abs=1e-4)
    assert verdict["threshold"] == pytest.approx(3 * verdict["baseline"])
    assert _steps(root) == list(range(1, 15))
    # the spike changed no gradient: every step's loss is the healthy run's, but for the +25
    assert [loss - (25.0 if step == FAULT_STEP else 0.0) for step, loss in zip(_steps(root), losses(root),
                                                                               strict=True)] == \
        pytest.approx(healthy, abs=1e-5)


def _checkpoint(root, step: int, target) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(root / "checkpoints" / f"step_{step:08d}"), str(target))
    return torch.load(target, weights_only=False)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix: tree}


def test_a_skipped_step_leaves_weights_and_optimizer_as_they_were(runs, tmp_path):
    root = runs["spike_skip"]
    assert outcome(root) == {"ok": True}
    assert _acting(root) == [("loss_spike", FAULT_STEP, "skip")]
    before = _flatten(_checkpoint(root, FAULT_STEP - 1, tmp_path / "before.pt"))
    skipped = _flatten(_checkpoint(root, FAULT_STEP, tmp_path / "skipped.pt"))
    after = _flatten(_checkpoint(root, FAULT_STEP + 1, tmp_path / "after.pt"))
    tensors = [key for key, value in before.items() if isinstance(value, torch.Tensor)]
    assert any(key.startswith("model.") for key in tensors) and any("exp_avg" in key for key in tensors)
    assert all(torch.equal(before[key], skipped[key]) for key in tensors)
    assert not all(torch.equal(skipped[key], after[key]) for key in tensors)  # the next step updates
    # the step counted: the schedule moved on, the run trained max_steps steps
    assert _steps(root) == list(range(1, 15))


def test_a_rollback_reloads_the_last_checkpoint_and_continues_after_the_spike(runs):
    root = runs["spike_rollback"]
    assert outcome(root) == {"ok": True}
    [verdict, rolled] = [r for r in rule_records(root) if r["rule"] == "loss_spike"]
    assert (verdict["step"], verdict["action"]) == (FAULT_STEP, "rollback")
    assert rolled["rolled_back_to"] == 8 and rolled["checkpoint"].endswith("step_00000008")
    assert _steps(root) == [*range(1, FAULT_STEP + 1), *range(9, 15)]
    # the reloaded model, optimizer and schedule trained the batches after the spike's, exactly as a
    # run that had skipped steps 9 and 10's batches
    reference = losses(runs["rollback_reference"])
    assert losses(root)[FAULT_STEP:] == reference[8:]
    assert losses(root)[:8] == reference[:8]
    state = json.loads((root / "checkpoints" / "step_00000014" / "trainer_state.json").read_text())
    global_batch = 2 * TINY["micro_batch_size"] * TINY["grad_accum_steps"]
    assert state["step"] == 14 and state["data"]["consumed_samples"] == 16 * global_batch


def test_a_stop_fails_the_job_with_the_rule_and_saves_nothing_more(runs):
    root = runs["spike_stop"]
    result = outcome(root)
    assert result["error"] == "RuleTriggered"
    assert result["message"].startswith(f"loss_spike at step {FAULT_STEP}: loss ")
    assert "Starting the run again resumes from step_00000008" in result["message"]
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step_00000008"]
    assert _steps(root)[-1] == FAULT_STEP


def test_a_persistent_fault_stops_after_the_allowed_rollbacks(runs):
    root = runs["persistent_spike"]
    result = outcome(root)
    assert result["error"] == "RuleTriggered"
    assert "after 2 roll-back(s) in a row without a new checkpoint: the fault persists" in result["message"]
    assert [r["rolled_back_to"] for r in rule_records(root) if "rolled_back_to" in r] == [8, 8]


def test_an_exploding_gradient_is_skipped_or_stops_the_job(runs):
    skipped = runs["explosion_skip"]
    assert outcome(skipped) == {"ok": True}
    assert _acting(skipped) == [("grad_norm_explosion", FAULT_STEP, "skip")]
    assert _steps(skipped) == list(range(1, 15))
    stopped = outcome(runs["explosion_stop"])
    assert stopped["error"] == "RuleTriggered"
    assert stopped["message"].startswith(f"grad_norm_explosion at step {FAULT_STEP}: gradient norm ")


def test_deepspeed_rolls_back_in_the_running_job(runs):
    root = runs["deepspeed_rollback"]
    assert outcome(root) == {"ok": True}, outcome(root)
    assert [r["rolled_back_to"] for r in rule_records(root) if "rolled_back_to" in r] == [8]
    assert _steps(root)[-6:] == list(range(9, 15))


def test_a_throughput_drop_stops_the_job(runs):
    result = outcome(runs["stall_stop"])
    assert result["error"] == "RuleTriggered"
    assert result["message"].startswith(f"throughput_drop at step {FAULT_STEP}: tokens/s ")
    assert "is below 0.05 x its running median" in result["message"]


def test_a_hung_collective_dumps_every_ranks_stacks_and_fails_the_job(tiny_data, tmp_path):
    """Rank 1 sleeps before step 4 while rank 0 waits in the step's collectives: both watchdogs
    write their rank's stacks, the job's failure reason is the hang's, the ranks exit with the
    watchdog's code, and torchrun fails the job."""
    root = job_root(tmp_path / "hung", tiny_data)
    (root / "output").mkdir()
    hyperparameters = {**TINY, "max_steps": 8, "rule_hang_minutes": 0.1}
    env = child_env(SAGEMAKER_BASE_DIR=str(root), SM_OUTPUT_DIR=str(root / "output"),
                    SM_HPS=json.dumps(hyperparameters),
                    **_faults({"hang": {"step": 4, "rank": 1, "seconds": 300}}))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(TRAIN)]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and f"exitcode  : {HANG_EXIT_CODE}" in output, output[-3000:]
    failure = (root / "output" / "failure").read_text()
    assert failure.startswith("HungCollective: nothing finished for 0.1 minutes on rank ")
    assert "after step 3" in failure
    stacks = {rank: (root / "output" / "data" / "hang" / f"rank_{rank:05d}.txt").read_text()
              for rank in (0, 1)}
    assert "in before_step" in stacks[1] and "time.sleep(hang" in stacks[1]  # the stalled rank
    assert "in train_step" in stacks[0] and "before_step" not in stacks[0]  # waiting in a collective
    assert "[hang] Python stacks of rank 0" in output and "[hang] Python stacks of rank 1" in output
    assert "thread MainThread" in stacks[0]
    assert os.path.getsize(root / "output" / "failure") <= 1024
