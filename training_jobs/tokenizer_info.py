"""Print, as JSON, what a tokenizer folder gives the training program's data: its size
(`len(tokenizer)`, what prepare_data records as a dataset's vocab_size and the model's embedding is
sized from) and its end-of-sequence id.

    python -m training_jobs.tokenizer_info DIR

`llmtrain run --local` and `llmtrain start` run it to check a dataset against the tokenizer a job
will read it with (llmtrain never imports the program).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training_jobs.prepare_data import load_tokenizer  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m training_jobs.tokenizer_info DIR", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(argv[0])
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
