"""Keep a local job from outliving the `llmtrain` process that runs it.

The toolkits run in their own sessions (so a Ctrl-C reaches llmtrain alone, which then stops the job
the way StopTrainingJob does). If llmtrain itself dies without cleaning up (SIGKILL, the OOM
killer, a closed terminal), nothing would stop them. So llmtrain starts this small process first,
in a session of its own, and tells it each toolkit's process group through a pipe. When the pipe
closes without the word `release` (llmtrain died: the kernel closes its end), the reaper kills
every process group it was told about. torchrun's workers and their helpers stay in their toolkit's
process group, so the whole job goes.

    python -m llmtrain.local.reaper      # reads "<pgid>" lines, then "release" or end-of-file
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

RELEASE = "release"


class Reaper:
    """llmtrain's side: start the reaper, register process groups, release it at a clean end."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "llmtrain.local.reaper"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True,
        )

    def watch(self, process_group: int) -> None:
        self._process.stdin.write(f"{process_group}\n")
        self._process.stdin.flush()

    def release(self) -> None:
        """The job's processes are gone: the reaper exits without killing anything."""
        try:
            self._process.stdin.write(f"{RELEASE}\n")
            self._process.stdin.close()
        except BrokenPipeError:
            pass
        self._process.wait(timeout=30)


def kill_groups(groups: list[int]) -> None:
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def main() -> int:
    # In its own session no terminal signal reaches it; ignore them anyway while watching.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    groups: list[int] = []
    for line in sys.stdin:
        word = line.strip()
        if word == RELEASE:
            return 0
        if word.isdigit():
            groups.append(int(word))
    kill_groups(groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
