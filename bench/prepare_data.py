"""`python -m bench.prepare_data [--megabytes 8] [--workers 1 2 4] [--tokenizer DIR] [--out FILE]`

prepare_data's speed against the bare tokenizer (issue 35): a synthetic JSONL corpus (seeded
English-like sentences, `--megabytes` of it) tokenized

- by the bare tokenizer: `tokenizers.Tokenizer.encode_batch` on the texts already in memory (the
  Rust library's own thread pool, all cores), the floor of what any preparation costs;
- by `python -m training_jobs.prepare_data --workers N` for each N, as a user runs it: a fresh
  process, reading the file, the work units (the corpus cut into 4 units per worker of the largest
  N, so every N has the same units), the shards, the merge. Wall time from start to exit, so the
  workers' start-up (each loads transformers and the tokenizer) is in it.

tokens/s = the dataset's tokens / seconds. One JSON object with the machine (CPU model, its SIMD
flags, load average before and after), the command lines and the results; docs/benchmarks.md
("Data preparation") has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import machine
from bench.ours import REPO_ROOT

TOKENIZER = REPO_ROOT / "training_jobs" / "assets" / "tokenizer"
WORDS = (
    "the and of to that with have be river stone garden window morning letter bridge music quiet "
    "bright small green open old long road house light water paper table story night walks finds "
    "keeps builds reads writes carries opens follows remembers across under over near beside slowly "
    "often never always almost gently"
).split()
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "amx_tile")


def write_corpus(path: Path, megabytes: float, seed: int = 35) -> list[str]:
    rng = random.Random(seed)
    texts, size = [], 0
    while size < megabytes * 1e6:
        sentences = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))).capitalize() + "."
            for _ in range(rng.randint(3, 40))
        ]
        texts.append(" ".join(sentences))
        size += len(texts[-1]) + 12
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def bare_tokenizer(texts: list[str], tokenizer: Path) -> dict:
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    start = time.perf_counter()
    tokens = sum(len(e.ids) for e in encoder.encode_batch(texts, add_special_tokens=False))
    seconds = time.perf_counter() - start
    return {
        "what": "tokenizers encode_batch (in memory)",
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
    }


def prepare(corpus: Path, tokenizer: Path, workers: int, unit_bytes: int, folder: Path) -> dict:
    output = folder / f"out-{workers}"
    command = [
        sys.executable,
        "-m",
        "training_jobs.prepare_data",
        "--input",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
        "--output",
        str(output),
        "--workers",
        str(workers),
        "--unit-bytes",
        str(unit_bytes),
    ]
    environment = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO_ROOT, env=environment, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    tokens = json.loads((output / "manifest.json").read_text())["num_tokens"]
    return {
        "what": f"prepare_data --workers {workers}",
        "workers": workers,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
        "command": " ".join(command[1:]).replace(str(folder), "TMP"),
    }


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [flag for flag in SIMD_FLAGS if flag in present]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prepare_data", description=__doc__.split("\n")[2])
    parser.add_argument("--megabytes", type=float, default=8.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    result = {
        "machine": {
            **machine.describe(REPO_ROOT),
            "cpu_flags": cpu_flags(),
            "load_before": machine.load_average(),
        },
        "megabytes": args.megabytes,
        "tokenizer": str(args.tokenizer),
    }
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        corpus = folder / "corpus.jsonl"
        texts = write_corpus(corpus, args.megabytes)
        unit_bytes = max(1, corpus.stat().st_size // (4 * max(args.workers)) + 1)
        result["documents"], result["unit_bytes"] = len(texts), unit_bytes
        result["runs"] = [bare_tokenizer(texts, args.tokenizer)]
        for workers in args.workers:
            result["runs"].append(prepare(corpus, args.tokenizer, workers, unit_bytes, folder))
    result["machine"]["load_after"] = machine.load_average()
    bare = result["runs"][0]["tokens_per_s"]
    for run in result["runs"]:
        run["vs_bare_tokenizer"] = round(run["tokens_per_s"] / bare, 3)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
