"""Checkpoints: save at step k, stop, resume == uninterrupted; incomplete checkpoints are ignored;
SIGTERM writes a checkpoint and exits cleanly.

The interrupted runs stop at step 3 by max_steps with the schedule's horizon pinned
(lr_decay_steps=6), so the learning rate of every step is that of the 6-step run; the resumed runs
start in fresh processes, as a restarted SageMaker job would. The `_longer` runs train 3 steps on a
3-step schedule (no lr_decay_steps) and resume with max_steps=6: from the first resumed step they
follow the 6-step schedule.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from .conftest import REPO, TINY, TRAIN, child_env, job_root, losses, outcome, run_jobs, train_records

pytestmark = pytest.mark.slow

SIX = {**TINY, "max_steps": 6, "lr_decay_steps": 6, "checkpoint_every_steps": 3}
THREE = {**SIX, "max_steps": 3}
# Another schedule length on resume: max_steps 3 -> 6 without lr_decay_steps.
SHORT, LONGER = {**TINY, "max_steps": 3, "checkpoint_every_steps": 3}, {**TINY, "max_steps": 6}
STRATEGIES = {"fsdp": {"parallelism": "fsdp"},
              "deepspeed": {"parallelism": "deepspeed", "zero_stage": 2}}


def _damage(root):
    """Leave behind what a job killed while checkpointing leaves: a newer folder without its COMPLETE
    marker, one whose files do not match the marker, and a temporary folder."""
    checkpoints = root / "checkpoints"
    good = checkpoints / "step_00000003"
    shutil.copytree(good, checkpoints / "step_00000005")
    (checkpoints / "step_00000005" / "COMPLETE").unlink()
    shutil.copytree(good, checkpoints / "step_00000004")
    victim = max((p for p in (checkpoints / "step_00000004").rglob("*") if p.is_file()
                  and p.name != "COMPLETE"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    (checkpoints / ".tmp-step_00000006").mkdir()
    (checkpoints / ".tmp-step_00000006" / "partial.distcp").write_bytes(b"\0" * 100)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    base = tmp_path_factory.mktemp("resume")
    roots = {}
    first = []
    for name, hps in STRATEGIES.items():
        roots[f"{name}_full"] = job_root(base / f"{name}_full", tiny_data)
        roots[f"{name}_parts"] = job_root(base / f"{name}_parts", tiny_data)
        roots[f"{name}_longer"] = job_root(base / f"{name}_longer", tiny_data)
        first += [(roots[f"{name}_full"], {**SIX, **hps}), (roots[f"{name}_parts"], {**THREE, **hps}),
                  (roots[f"{name}_longer"], {**SHORT, **hps})]
    roots["timed"] = job_root(base / "timed", tiny_data)
    first.append((roots["timed"], {**THREE, "parallelism": "ddp", "checkpoint_every_steps": 0,
                                   "checkpoint_every_minutes": 1e-6, "keep_checkpoints": 2}))
    launch = run_jobs(2, first, base)
    roots["first launch output"] = launch.output
    first_losses = {name: losses(roots[name]) for name in roots if name.endswith(("_full", "_parts"))}
    # the synchronous save that ended fsdp_parts, before its resumed run prunes it
    roots["fsdp_parts step 3"] = shutil.copytree(roots["fsdp_parts"] / "checkpoints" / "step_00000003",
                                                 base / "fsdp_parts_step_3")
    for name in STRATEGIES:
        _damage(roots[f"{name}_parts"])
    run_jobs(2, [job for name, hps in STRATEGIES.items()
                 for job in ((roots[f"{name}_parts"], {**SIX, **hps, "keep_checkpoints": 1}),
                             (roots[f"{name}_longer"], {**LONGER, **hps}))], base)
    return roots, first_losses


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_resumed_run_equals_uninterrupted_run_exactly(runs, strategy):
    roots, first = runs
    uninterrupted = first[f"{strategy}_full"]
    assert len(uninterrupted) == 6 and first[f"{strategy}_parts"] == uninterrupted[:3]
    resumed = train_records(roots[f"{strategy}_parts"])
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # metrics.jsonl is appended
    assert [r["loss"] for r in resumed][3:] == uninterrupted[3:]


def _checkpoint_state(folder, target):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(target))
    return torch.load(target, weights_only=False)


def test_a_checkpoint_written_in_the_background_holds_the_state_of_its_step(runs, tmp_path):
    """fsdp_full saved step 3 in the background while steps 4-6 trained; fsdp_parts saved the same
    step synchronously before stopping: the two hold the same weights and optimizer state."""
    roots, _ = runs
    assert "checkpoint step=3 " in roots["first launch output"]
    assert "(writing in the background)" in roots["first launch output"]
    background = _checkpoint_state(roots["fsdp_full"] / "checkpoints" / "step_00000003", tmp_path / "a.pt")
    synchronous = _checkpoint_state(roots["fsdp_parts step 3"], tmp_path / "b.pt")
    flat_a, flat_b = _flatten(background), _flatten(synchronous)
    assert flat_a.keys() == flat_b.keys() and any("exp_avg" in key for key in flat_a)
    for key, value in flat_a.items():
        assert torch.equal(value, flat_b[key]) if isinstance(value, torch.Tensor) else \
            value == flat_b[key], key


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix: tree}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_data_position_and_schedule_were_restored(runs, strategy):
    roots, _ = runs
    state = json.loads((roots[f"{strategy}_parts"] / "checkpoints" / "step_00000006" /
                        "trainer_state.json").read_text())
    global_batch = 2 * TINY["micro_batch_size"] * TINY["grad_accum_steps"]
    assert state["step"] == 6 and state["data"]["consumed_samples"] == 6 * global_batch
    full = train_records(roots[f"{strategy}_full"])
    assert [r["lr"] for r in train_records(roots[f"{strategy}_parts"])] == [r["lr"] for r in full]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_resuming_with_another_schedule_length_trains_at_the_new_schedules_rate(runs, strategy):
    """The first resumed step's rate is the 6-step schedule's (the uninterrupted 6-step run's and a
    fresh schedule's), not the 3-step schedule's end (0)."""
    from training_jobs.contract.hyperparameters import from_hyperparameters
    from training_jobs.trainer.optim import lr_multiplier

    roots, _ = runs
    longer = train_records(roots[f"{strategy}_longer"])
    assert outcome(roots[f"{strategy}_longer"]) == {"ok": True}
    assert [r["step"] for r in longer] == [1, 2, 3, 4, 5, 6]
    fresh = lr_multiplier(from_hyperparameters(LONGER), TINY["lr"])
    uninterrupted = train_records(roots[f"{strategy}_full"])  # lr_decay_steps=6: the same schedule
    for record, step in zip(longer[3:], range(3, 6), strict=True):
        assert record["lr"] == pytest.approx(TINY["lr"] * fresh(step), rel=1e-3)
        assert record["lr"] == uninterrupted[step]["lr"]
    assert longer[3]["lr"] > 0


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_incomplete_checkpoints_are_ignored_and_pruned(runs, strategy):
    roots, _ = runs
    assert outcome(roots[f"{strategy}_parts"]) == {"ok": True}
    # keep_checkpoints=1: only the final checkpoint is left; the damaged and temporary ones are gone.
    assert sorted(p.name for p in (roots[f"{strategy}_parts"] / "checkpoints").iterdir()) == \
        ["step_00000006"]


def _workers(launcher: subprocess.Popen) -> list[psutil.Process]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = psutil.Process(launcher.pid).children(recursive=True)
        workers = [c for c in children if "train.py" in " ".join(c.cmdline())]
        if len(workers) == 2:
            return workers
        time.sleep(0.2)
    raise AssertionError("the workers did not start")


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_data, tmp_path):
    root = job_root(tmp_path / "job", tiny_data)
    hps = {**TINY, "max_steps": 100000, "parallelism": "fsdp", "checkpoint_every_steps": 0}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(TRAIN)],
        env=child_env(SAGEMAKER_BASE_DIR=str(root), SM_HPS=json.dumps(hps)), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        workers = _workers(launcher)
        output = []
        for line in launcher.stdout:
            output.append(line)
            if line.startswith("[metrics] step=3 "):
                for worker in workers:  # what a spot interruption or StopTrainingJob delivers
                    os.kill(worker.pid, signal.SIGTERM)
                break
        output.append(launcher.stdout.read())
        assert launcher.wait(timeout=120) == 0, "".join(output)[-4000:]
    finally:
        launcher.kill()
    text = "".join(output)
    stopped_at = int(text.split("stop signal received: saved step ")[1].split()[0])
    assert stopped_at >= 3
    checkpoints = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert checkpoints == [f"step_{stopped_at:08d}"]
    assert (root / "checkpoints" / checkpoints[0] / "COMPLETE").is_file()
    assert not (root / "model" / "config.json").exists()  # interrupted: no export


def test_checkpoints_by_time_and_keep_the_last_k(runs):
    roots, _ = runs
    assert sorted(p.name for p in (roots["timed"] / "checkpoints").iterdir()) == \
        ["step_00000002", "step_00000003"]
    for step in (1, 2, 3):  # the time trigger fired after every step
        assert f"[train] checkpoint step={step} path={roots['timed']}" in roots["first launch output"]
