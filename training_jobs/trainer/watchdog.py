"""The hang watchdog: a thread per rank that ends a job in which nothing finishes any more.

A collective that never completes (a rank that died or stalled, a broken link) holds every other
rank inside the same collective until the process group's timeout, while the job keeps billing.
The training loop calls `beat()` whenever a step, an evaluation, a checkpoint or a roll-back
finishes; when `rule_hang_minutes` pass without one, the watchdog of each rank (they fire within
moments of each other: the ranks finished their last step together):

1. writes every thread's Python stack of its rank to the log and to
   `<output data>/hang/rank_NNNNN.txt` (uploaded with the job's output);
2. records the failure reason `HungCollective: ...` (the job's FailureReason; the launcher retries a
   run once after it, from its last checkpoint);
3. waits a moment for the other ranks' watchdogs to do the same, then exits the process with
   `HANG_EXIT_CODE`, so that torchrun tears the job down.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

from ..contract.failures import HANG_EXIT_CODE, HUNG_COLLECTIVE
from .errors import record_failure

# EX_TEMPFAIL (sysexits.h): a temporary failure, worth a retry.
FAILURE_PREFIX = HUNG_COLLECTIVE


def stacks_text(rank: int, skip: int | None = None) -> str:
    """Every thread's Python stack, innermost call last, named by thread (`skip`: a thread id)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- rank {rank}, thread {names.get(ident, ident)} ---\n{stack}")
    return "\n".join(parts)


class HangWatchdog:
    """Started when training starts, told of every finished step, stopped when training ends."""

    def __init__(self, minutes: float, output_dir: Path, rank: int, host: str) -> None:
        self.timeout = minutes * 60.0
        self.output_dir, self.rank, self.host = output_dir, rank, host
        # Check often enough that the ranks' watchdogs fire close together; never busy.
        self.poll = min(max(self.timeout / 20.0, 0.2), 5.0)
        self.last_beat = time.monotonic()
        self.last_done = "training started"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> None:
        self.last_beat = time.monotonic()
        self._thread.start()

    def beat(self, done: str) -> None:
        """Something finished (`done`, e.g. "step 120"): the clock starts again."""
        self.last_done = done
        self.last_beat = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            if time.monotonic() - self.last_beat > self.timeout:
                self._fire()

    def reason(self, stacks_file: Path) -> str:
        minutes = self.timeout / 60.0
        return (f"{FAILURE_PREFIX}: nothing finished for {minutes:g} minutes on rank {self.rank} (host "
                f"{self.host}) after {self.last_done}: a collective never completed (a rank died or "
                f"stalled, or a link failed). Every rank's Python stacks are in the log and in "
                f"{stacks_file.parent}/ (the job's output); the run resumes from its last checkpoint")

    def _fire(self) -> None:
        stacks = stacks_text(self.rank, skip=threading.get_ident())
        stacks_file = self.output_dir / "hang" / f"rank_{self.rank:05d}.txt"
        try:
            stacks_file.parent.mkdir(parents=True, exist_ok=True)
            stacks_file.write_text(stacks)
        except OSError as error:
            stacks += f"\n(could not write {stacks_file}: {error})"
        reason = self.reason(stacks_file)
        print(f"[error] {reason}\n[hang] Python stacks of rank {self.rank}:\n{stacks}", file=sys.stderr,
              flush=True)
        record_failure(reason)
        time.sleep(2 * self.poll)  # the other ranks' watchdogs fire within one poll of this one
        os._exit(HANG_EXIT_CODE)
