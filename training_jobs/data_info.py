"""Check token shards' content as the training program does when it loads a channel, and print what
it would fail on, one problem a line (nothing when the data is fine).

    python -m training_jobs.data_info CHANNEL=DIR [CHANNEL=DIR ...]

It reads the shards and masks themselves (the manifest's form is checked by the platform without the
program): a token id at or beyond the manifest's vocab_size, or loss masks that train no answer token
(trainer/shards.py `content_problem`). `llmtrain run --local` runs it before any job starts (llmtrain
never imports the program).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training_jobs.trainer.errors import DataError  # noqa: E402
from training_jobs.trainer.shards import content_problem, read_manifest  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or not all("=" in value for value in argv):
        print("usage: python -m training_jobs.data_info CHANNEL=DIR [CHANNEL=DIR ...]", file=sys.stderr)
        return 2
    for value in argv:
        channel, _, folder = value.partition("=")
        try:
            problem = content_problem(read_manifest(Path(folder)), channel)
        except DataError as error:
            problem = f"the {channel} channel: {error}"
        if problem:
            print(" ".join(problem.split()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
