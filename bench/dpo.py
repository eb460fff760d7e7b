"""`python -m bench.dpo [--mode quick|full|tiny] [--rounds N] [--out FILE]`

DPO step time of our program against TRL's DPOTrainer, side by side in one run: the same model (the
mode's preset, built from the same config), the same preference pairs (examples/data/tiny_preference:
prepared by our `prepare_data --preference` for ours, given as text to TRL, which tokenizes them with
the same tokenizer), the same pairs per step (the mode's global batch, one process, no
accumulation), the same precision and optimizer settings, and a frozen copy of the initial model as
the reference on both sides. Each side's step is timed from outside by its per-step line
(bench.timing), the rounds interleaved; the ratio is TRL's median step time over ours.
`python -m bench.run` measures it among its extras (`make bench`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.measure import Workspace, measure
from bench.modes import MODES, BenchConfig, BenchMode
from bench.ours import REPO_ROOT

PAIRS = REPO_ROOT / "examples" / "data" / "tiny_preference" / "train.jsonl"
TOKENIZER = REPO_ROOT / "training_jobs" / "assets" / "tokenizer"  # the one bench.model builds with
DPO_BETA = 0.1
PRECISION = "fp32"  # what both sides run at on a CPU without surprises (bf16 autocast differs per side)
OURS = BenchConfig("ours_dpo", "ours", PRECISION, compile=False,
                   hyperparameters={"objective": "dpo", "dpo_beta": DPO_BETA, "dpo_reference": "copy"})
TRL = BenchConfig("trl_dpo", "trl_dpo", PRECISION, compile=False)


def prepare_pairs(folder: Path, seq_len: int) -> Path:
    """The shipped pairs in our program's preference format, at most `seq_len` tokens a row."""
    from training_jobs import prepare_data

    output = folder / "pairs"
    code = prepare_data.main(["--input", str(PAIRS), "--tokenizer", str(TOKENIZER), "--output", str(output),
                              "--preference", "--max-length", str(seq_len), "--workers", "1"])
    if code != 0:
        raise RuntimeError(f"prepare_data --preference of {PAIRS} exited {code}")
    return output


def _pooled(records: list[dict], mode: BenchMode) -> dict:
    """One record from the rounds of one side: its step times pooled, pairs per second."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return records[-1]
    merged = {key: value for key, value in ok[-1].items() if key != "tokens_per_s"}
    pooled = [t for r in ok for t in r["step_times_s"]]
    pooled_cpu = [t for r in ok for t in r["cpu_step_times_s"]]
    step = statistics.median(pooled)
    merged.update(step_time_s=step, step_times_s=pooled, pairs_per_s=mode.global_batch_size / step,
                  round_step_times_s=[r["step_time_s"] for r in ok],
                  cpu_step_time_s=statistics.median(pooled_cpu), cpu_step_times_s=pooled_cpu,
                  round_cpu_step_times_s=[statistics.median(r["cpu_step_times_s"]) for r in ok],
                  peak_rss_gb=max(r["peak_rss_gb"] for r in ok))
    return merged


def _ratios(ours: dict, trl: dict, measure: str) -> tuple[float, list[float]]:
    """TRL's median `measure` (step_time, cpu_step_time) over ours, pooled and round by round (the
    rounds ran next to each other)."""
    rounds = [theirs / mine for mine, theirs in
              zip(ours[f"round_{measure}s_s"], trl[f"round_{measure}s_s"], strict=True)]
    return trl[f"{measure}_s"] / ours[f"{measure}_s"], rounds


def side_by_side(mode: BenchMode, workspace: Workspace, rounds: int) -> dict:
    """Both sides `rounds` times, interleaved; each side's record and TRL's step time over ours."""
    channel = prepare_pairs(workspace.root / "dpo", mode.seq_len)
    pairs_workspace = dataclasses.replace(workspace, train_channel=channel)
    runs: dict[str, list[dict]] = {OURS.name: [], TRL.name: []}
    for round_index in range(rounds):
        for config in (OURS, TRL):
            print(f"[bench] dpo round {round_index + 1}/{rounds}: {config.name} ...", flush=True)
            runs[config.name].append(measure(config, mode, pairs_workspace))
    ours, trl = (_pooled(runs[c.name], mode) for c in (OURS, TRL))
    both_ok = ours["status"] == trl["status"] == "ok" and len(runs[OURS.name]) == len(runs[TRL.name])
    ratio, by_round = _ratios(ours, trl, "step_time") if both_ok else (None, None)
    cpu_ratio, cpu_by_round = _ratios(ours, trl, "cpu_step_time") if both_ok else (None, None)
    return {
        "status": "ok" if both_ok else "failed",
        "pairs_per_step": mode.global_batch_size,
        "precision": PRECISION,
        "data": str(PAIRS.relative_to(REPO_ROOT)),
        "ours": ours,
        "trl": trl,
        "ratio": ratio,
        "ratio_by_round": by_round,
        "cpu_ratio": cpu_ratio,
        "cpu_ratio_by_round": cpu_by_round,
    }


def main(argv: list[str] | None = None) -> int:
    from bench import machine

    parser = argparse.ArgumentParser(prog="python -m bench.dpo", description=__doc__.splitlines()[2])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: the mode's)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "dpo.json")
    args = parser.parse_args(argv)
    mode = MODES[args.mode]
    load_start = machine.load_average()
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as root:
        workspace = Workspace(root=Path(root), tokens_npy=Path(root) / "unused.npy",
                              train_channel=Path(root) / "unused")
        result = side_by_side(mode, workspace, args.rounds or mode.rounds)
    result.update(mode=mode.name, model_preset=mode.model_preset, seq_len=mode.seq_len,
                  machine=machine.describe(REPO_ROOT),
                  load_average={"start": load_start, "end": machine.load_average()},
                  command="python -m bench.dpo " + " ".join(argv if argv is not None else sys.argv[1:]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[bench] dpo: {result['status']}, TRL step / ours = {result['ratio']}; wrote {args.out}")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
