"""Checkpoints: atomic, sharded, self-resuming; and the SIGTERM / time triggers that write them.

Layout under the checkpoint folder (/opt/ml/checkpoints, which SageMaker syncs with S3):

    step_00000100/            one complete checkpoint
        COMPLETE              written last: JSON with the step and the size of every file
        trainer_state.json    step, data position, LR scheduler, hyperparameters
        rng/rank_00000.pt     each rank's RNG states
        ...                   the strategy's files (torch.distributed.checkpoint shards, or DeepSpeed's)
    .tmp-step_00000200/       being written; never read

A checkpoint is written into a temporary folder, renamed when every rank has finished, and only
then marked COMPLETE; on start the job resumes from the newest folder whose COMPLETE marker lists
files that are all present with their sizes, so a checkpoint cut short (a killed job, a partial S3
sync) is never picked up.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .errors import CheckpointError, TrainingError
from .strategies import Strategy

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"


def folder_name(step: int) -> str:
    return f"step_{step:08d}"


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _files_with_sizes(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(folder)): path.stat().st_size for path in sorted(folder.rglob("*"))
            if path.is_file() and path.name != MARKER and not path.name.endswith(".tmp")}


def is_complete(folder: Path, *, this_host_only: bool = False) -> bool:
    """The marker exists and every file it lists is present with the recorded size.

    `this_host_only` accepts listed files that are absent: on several hosts without a shared file
    system each host holds only its own ranks' files until SageMaker merges them in S3.
    """
    try:
        listed = json.loads((folder / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((folder / name).stat().st_size == size if (folder / name).is_file() else this_host_only
               for name, size in listed.items())


@dataclass(frozen=True)
class Found:
    complete: list[tuple[int, Path]]
    incomplete: list[Path]


def scan(root: Path, *, this_host_only: bool = False) -> Found:
    complete, incomplete = [], []
    if root.is_dir():
        for child in root.iterdir():
            match = _NAME.match(child.name)
            if child.name.startswith(TMP_PREFIX) or (
                    match and not is_complete(child, this_host_only=this_host_only)):
                incomplete.append(child)
            elif match:
                complete.append((int(match[1]), child))
    return Found(sorted(complete), sorted(incomplete))


def latest_complete(root: Path) -> Path | None:
    found = scan(root)
    return found.complete[-1][1] if found.complete else None


# --- RNG ----------------------------------------------------------------------------------------

def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_path(folder: Path, rank: int) -> Path:
    return folder / "rng" / f"rank_{rank:05d}.pt"


# --- writing and reading ------------------------------------------------------------------------

@dataclass(frozen=True)
class PendingSave:
    """A checkpoint being written in the background, committed once every rank has finished."""

    step: int
    temporary: Path
    final: Path
    writes: Future


class CheckpointStore:
    """Writes and finds checkpoints in one folder.

    Each host writes its ranks' files to its own /opt/ml/checkpoints (SageMaker merges the hosts'
    folders in S3 and gives every host the union on the next start), so the local rank 0 of each
    host renames its folder and writes a marker listing every host's files. When the folder is on
    a shared file system (every rank's files appear in it), only rank 0 does.

    With `background_writes`, a save returns once the strategy has copied its state to host memory;
    the files are written by DCP in a thread over a process group of their own (collectives of two
    threads on one group would interleave differently on different ranks), and the checkpoint is
    committed (renamed and marked COMPLETE) at the first step at which every rank's writes are done.
    """

    def __init__(self, root: Path, keep: int, rank: int, local_main: bool, *,
                 background_writes: bool = False) -> None:
        self.root, self.keep, self.rank, self.local_main = root, keep, rank, local_main
        # Every rank builds its store at the same point, as new_group requires.
        self.writer_group = dist.new_group(backend="gloo") if background_writes else None
        self.pending: PendingSave | None = None

    def save(self, step: int, strategy: Strategy, trainer_state: dict, *, wait: bool = True) -> Path:
        """Write checkpoint `step`; with wait=False (and background writes) return before the
        strategy's files are written. A save in flight is finished first. A collective."""
        self.finish_pending()
        final = self.root / folder_name(step)
        temporary = self.root / (TMP_PREFIX + folder_name(step))
        if self.local_main:
            shutil.rmtree(temporary, ignore_errors=True)  # left over from an earlier attempt
            temporary.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        writes = None
        if wait or self.writer_group is None:
            strategy.save_checkpoint(temporary)
        else:
            writes = strategy.save_checkpoint(temporary, self.writer_group)
        _rng_path(temporary, self.rank).parent.mkdir(exist_ok=True)
        torch.save(rng_state(), _rng_path(temporary, self.rank))
        if self.local_main:
            _write_atomically(temporary / STATE_FILE, json.dumps(trainer_state, indent=1))
        if writes is not None:
            self.pending = PendingSave(step, temporary, final, writes)
        else:
            self._commit_everywhere(step, temporary, final)
        return final

    def poll_pending(self) -> Path | None:
        """Commit the save in flight if every rank's writes are done; returns its folder then.
        A collective while a save is in flight (every rank has one then, or none)."""
        if self.pending is None:
            return None
        if not _all_ranks(self.pending.writes.done()):
            return None
        return self.finish_pending()

    def finish_pending(self) -> Path | None:
        """Wait for the save in flight and commit it; returns its folder. A collective."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            pending.writes.result()
            failure = None
        except Exception as error:  # the writer thread's own error (disk full, permissions, ...)
            failure = error
        if not _all_ranks(failure is None):  # every rank stops, not only the one that failed
            reason = f"this rank: {failure}" if failure else "another rank (its log has the error)"
            raise CheckpointError(f"writing checkpoint step {pending.step} into {pending.temporary} "
                                  f"failed on {reason}; the previous complete checkpoint is kept. "
                                  "Check the free space of the checkpoint folder") from failure
        self._commit_everywhere(pending.step, pending.temporary, pending.final)
        return pending.final

    def abandon_pending(self, timeout_s: float = 300.0) -> None:
        """On a job that stops with an error: let the writes in flight end (without committing:
        that would be a collective, and another rank may be gone) before the process group goes."""
        pending, self.pending = self.pending, None
        if pending is not None:
            wait([pending.writes], timeout=timeout_s)

    def _commit_everywhere(self, step: int, temporary: Path, final: Path) -> None:
        dist.barrier()
        files = self._all_hosts_files(temporary)
        if self.local_main and (self.rank == 0 or not self._shared(temporary)):
            self._commit(temporary, final, step, files)
            self.prune()
        dist.barrier()

    def _all_hosts_files(self, temporary: Path) -> dict[str, int]:
        mine = _files_with_sizes(temporary) if self.local_main else {}
        gathered: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return {name: size for files in gathered if files for name, size in files.items()}

    @staticmethod
    def _shared(temporary: Path) -> bool:
        return len(list((temporary / "rng").glob("rank_*.pt"))) == dist.get_world_size()

    @staticmethod
    def _commit(temporary: Path, final: Path, step: int, files: dict[str, int]) -> None:
        shutil.rmtree(final, ignore_errors=True)  # an incomplete folder of the same step
        os.replace(temporary, final)
        _write_atomically(final / MARKER, json.dumps({"step": step, "files": files,
                                                      "written_at": time.time()}))

    def prune(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop abandoned and damaged folders. Judged
        by this host's files: the other hosts' shards of a committed checkpoint are not here."""
        found = scan(self.root, this_host_only=True)
        for _, folder in found.complete[:-self.keep]:
            shutil.rmtree(folder, ignore_errors=True)
        for folder in found.incomplete:
            shutil.rmtree(folder, ignore_errors=True)

    def newest_readable_everywhere(self) -> Path | None:
        """The newest complete checkpoint that every rank finds whole on its own disk (for a roll-back
        in the running job); None when there is none, as on several hosts without a shared file
        system, where each host holds only its own ranks' files. A collective."""
        mine = [step for step, _ in scan(self.root).complete]
        gathered: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        common = set.intersection(*(set(steps or ()) for steps in gathered))
        return self.root / folder_name(max(common)) if common else None

    def load(self, folder: Path, strategy: Strategy) -> None:
        """Restore the strategy's state and this rank's RNG (a rank the checkpoint's job did not
        have keeps its own: the data order does not depend on it)."""
        strategy.load_checkpoint(folder)
        rng_file = _rng_path(folder, self.rank)
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))


def read_trainer_state(folder: Path) -> dict:
    """Step, data position, schedule, mesh degrees and hyperparameters of a checkpoint."""
    return json.loads((folder / STATE_FILE).read_text())


def _all_ranks(flag: bool) -> bool:
    """True when `flag` holds on every rank (a MIN all-reduce on a CPU tensor; gloo)."""
    value = torch.tensor([int(flag)], dtype=torch.int32)
    if dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


# --- when to save ---------------------------------------------------------------------------------

class StopSignal:
    """Turns SIGTERM (spot interruption, StopTrainingJob) into a flag the loop checks each step."""

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class Triggers:
    """Agree across ranks, once per step, on whether to checkpoint and whether to stop.

    Each rank sees its own SIGTERM and its own clock; a MAX all-reduce of two flags on a CPU tensor
    (gloo, no device synchronisation) makes every rank take the same decision at the same step.
    """

    def __init__(self, every_steps: int, every_minutes: float, stop: StopSignal) -> None:
        self.every_steps, self.every_seconds = every_steps, every_minutes * 60
        self.stop = stop
        self.last_save = time.monotonic()
        self.flags = torch.zeros(2, dtype=torch.int32)

    def poll(self, step: int) -> tuple[bool, bool]:
        """(save now, stop now) after optimizer step `step`."""
        by_time = self.every_seconds > 0 and time.monotonic() - self.last_save >= self.every_seconds
        self.flags[0], self.flags[1] = int(self.stop.received), int(by_time)
        if dist.get_world_size() > 1:
            dist.all_reduce(self.flags, op=dist.ReduceOp.MAX)
        stop, timed = bool(self.flags[0]), bool(self.flags[1])
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        return stop or timed or by_steps, stop

    def saved(self) -> None:
        self.last_save = time.monotonic()


def check_resumable(state: dict, config_flat: dict) -> None:
    """Refuse to resume into a different model: the shapes would not fit anyway, say why."""
    saved = state.get("hyperparameters", {})
    for name in ("model_preset", "model_overrides", "lora_r", "lora_target_modules"):
        if name in saved and saved[name] != config_flat[name]:
            raise TrainingError(f"the checkpoint in the checkpoint folder was written with {name}="
                                f"{saved[name]!r} but this job has {name}={config_flat[name]!r}: use "
                                "a new checkpoint location (CheckpointConfig.S3Uri) for a new model")
