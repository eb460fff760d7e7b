"""`python -m bench.run [--mode quick|full|tiny] [--out bench/results/latest.json]`

Measures every configuration side by side in one run (bench.modes), then the checkpoint stall,
the data loader and `cdk synth`, and writes one JSON file. `python -m bench.report` turns that file
into the table and plot of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import derive, dpo, extras, machine, matmul
from bench.flops import model_shape
from bench.measure import Workspace, measure, total_steps
from bench.model import build_causal_lm, tokenizer_vocab_size
from bench.modes import MODES, BenchConfig, BenchMode, configurations
from bench.ours import REPO_ROOT, write_train_channel
from bench.tokens import load_tokens, write_tokens

DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "latest.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[2])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick",
                        help="quick: this CPU machine (default); full: CUDA GPUs; tiny: smoke test")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON results")
    parser.add_argument("--only", nargs="+", metavar="CONFIG",
                        help="measure only these configurations (for development; ratios may be null)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="repeat the configurations, interleaved, this many times (mode default)")
    parser.add_argument("--skip-extras", action="store_true",
                        help="skip checkpoint, data-loader and cdk synth measurements")
    return parser.parse_args(argv)


def _check_device(mode: BenchMode) -> None:
    import torch

    if mode.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--mode {mode.name} runs on CUDA GPUs and this machine has none: use --mode quick")


def _distributed_world_size(mode: BenchMode) -> tuple[int, str | None]:
    """Processes for the distributed configurations, or why they cannot run here."""
    if mode.device != "cuda":
        return mode.distributed_world_size, None
    import torch

    available = torch.cuda.device_count()
    if available < 2:
        return 0, f"needs 2 GPUs, this machine has {available}"
    return min(mode.distributed_world_size, available), None


def _selected(mode: BenchMode, only: list[str] | None) -> tuple[list[BenchConfig], dict]:
    """The configurations to run, and records for those that cannot run on this machine."""
    world_size, reason = _distributed_world_size(mode)
    configs, skipped = [], {}
    for config in configurations(mode):
        if only and config.name not in only:
            continue
        if config.world_size > 1 and reason:
            skipped[config.name] = {"name": config.name, "runner": config.runner,
                                    "precision": config.precision, "world_size": config.world_size,
                                    "parallelism": config.parallelism, "status": "skipped", "error": reason}
            continue
        if config.world_size > 1:
            config = dataclasses.replace(config, world_size=world_size)
        configs.append(config)
    unknown = set(only or ()) - {c.name for c in configurations(mode)}
    if unknown:
        sys.exit(f"--only: unknown configuration(s) {', '.join(sorted(unknown))}; choose from "
                 + ", ".join(c.name for c in configurations(mode)))
    return configs, skipped


def _prepare_workspace(root: Path, mode: BenchMode, vocab_size: int) -> Workspace:
    from bench.model import _tokenizer

    longest_run = total_steps(mode) + mode.checkpoint_every_steps * (mode.checkpoint_saves + 2)
    needed = 2 * longest_run * mode.global_batch_size * (mode.seq_len + 1)
    tokens_npy = write_tokens(root / "tokens.npy", max(needed, mode.data_loader_tokens), vocab_size)
    channel = write_train_channel(load_tokens(tokens_npy), root / "train", vocab_size,
                                  _tokenizer().eos_token_id)
    return Workspace(root=root, tokens_npy=tokens_npy, train_channel=channel)


def _merge_rounds(records: list[dict]) -> dict:
    """One record from several rounds of the same configuration: pooled step times."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return records[-1]
    merged = dict(ok[-1])
    pooled = [t for r in ok for t in r["step_times_s"]]
    tokens_per_step = ok[0]["tokens_per_s"] * ok[0]["step_time_s"]
    merged.update(step_time_s=statistics.median(pooled), step_times_s=pooled,
                  tokens_per_s=tokens_per_step / statistics.median(pooled),
                  round_step_times_s=[r["step_time_s"] for r in ok],
                  peak_rss_gb=max(r["peak_rss_gb"] for r in ok),
                  peak_process_rss_gb=max(r["peak_process_rss_gb"] for r in ok))
    return merged


def _measure_all(configs: list[BenchConfig], mode: BenchMode, workspace: Workspace, rounds: int) -> dict:
    by_name: dict[str, list[dict]] = {c.name: [] for c in configs}
    for round_index in range(rounds):
        for config in configs:
            print(f"[bench] round {round_index + 1}/{rounds}: {config.name} ...", flush=True)
            record = measure(config, mode, workspace)
            by_name[config.name].append(record)
            print(f"[bench]   {_one_line(record)}", flush=True)
    return {name: _merge_rounds(records) for name, records in by_name.items()}


def _one_line(record: dict) -> str:
    if record["status"] != "ok":
        return f"{record['status']}: {record.get('error', '')[:2000]}"
    return (f"{record['tokens_per_s']:.0f} tokens/s, step {record['step_time_s']:.3f} s, "
            f"peak RSS {record['peak_rss_gb']:.2f} GiB")


def _extras(mode: BenchMode, workspace: Workspace, vocab_size: int, configs: dict, skip: bool,
            rounds: int) -> dict:
    if skip:
        reason = {"status": "skipped", "error": "--skip-extras"}
        return {"checkpoint": reason, "data_loader": reason, "cdk_synth": reason, "dpo": reason}
    print("[bench] checkpoint stall ...", flush=True)
    checkpoint = extras.checkpoint_stall(mode, workspace)
    print("[bench] data loader ...", flush=True)
    loader = extras.data_loader(mode, workspace, vocab_size)
    consumed = derive.consumption(configs)
    loader["consumption_tokens_per_s"] = consumed
    loader["ratio_to_consumption"] = loader["tokens_per_s"] / consumed if consumed else None
    synth = {"status": "skipped", "error": f"not measured in --mode {mode.name}"}
    if mode.synth:
        print("[bench] cdk synth ...", flush=True)
        synth = extras.cdk_synth()
    print("[bench] dpo: ours against TRL's DPOTrainer ...", flush=True)
    preference = dpo.side_by_side(mode, workspace, rounds)
    return {"checkpoint": checkpoint, "data_loader": loader, "cdk_synth": synth, "dpo": preference}


def run_benchmark(mode: BenchMode, root: Path, only: list[str] | None, rounds: int,
                  skip_extras: bool = False) -> dict:
    _check_device(mode)
    started, clock = datetime.datetime.now(datetime.UTC), time.perf_counter()
    configs, skipped = _selected(mode, only)
    load_start = machine.load_average()
    vocab_size = tokenizer_vocab_size()
    shape = model_shape(build_causal_lm(mode.model_preset, mode.seq_len), mode.seq_len)
    moe = mode.moe_model
    moe_shape = model_shape(build_causal_lm(moe.preset, mode.seq_len, moe.overrides), mode.seq_len)
    workspace = _prepare_workspace(root, mode, vocab_size)
    print("[bench] matmul peak ...", flush=True)
    peaks_start = matmul.measure_peaks(mode.device, mode.matmul_sizes, mode.matmul_seconds)
    records = {**_measure_all(configs, mode, workspace, rounds), **skipped}
    measured_extras = _extras(mode, workspace, vocab_size, records, skip_extras, rounds)
    print("[bench] matmul peak again ...", flush=True)
    peaks = matmul.best_of(peaks_start,
                           matmul.measure_peaks(mode.device, mode.matmul_sizes, mode.matmul_seconds))
    derive.add_mfu_and_hf_ratio(records, peaks, shape.flops_per_token, moe_shape.flops_per_token)
    results = {
        "schema_version": 1,
        "mode": mode.name,
        "settings": {**dataclasses.asdict(mode), "rounds": rounds, "only": only},
        "started_at": started.isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - clock, 1),
        "machine": machine.describe(REPO_ROOT),
        "load_average": {"start": load_start, "end": machine.load_average()},
        "model": {"preset": mode.model_preset, "vocab_size_tokenizer": vocab_size,
                  **dataclasses.asdict(shape), "flops_per_token": shape.flops_per_token,
                  "global_batch_size": mode.global_batch_size,
                  "tokens_per_step": mode.global_batch_size * mode.seq_len},
        "moe_model": {"preset": moe.preset, "overrides": moe.overrides, **dataclasses.asdict(moe_shape),
                      "flops_per_token": moe_shape.flops_per_token},
        "peak": peaks,
        "configs": records,
        "ratios": derive.ratios(records),
        "ratios_by_round": derive.ratios_by_round(records),
        "mfu": derive.mfu_table(records),
        **measured_extras,
    }
    results["targets"] = derive.targets(results)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = MODES[args.mode]
    rounds = args.rounds or mode.rounds
    with tempfile.TemporaryDirectory(prefix="bench-") as root:
        results = run_benchmark(mode, Path(root), args.only, rounds, args.skip_extras)
    results["command"] = "python -m bench.run " + shlex.join(argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"[bench] wrote {args.out}", flush=True)
    for target in results["targets"]:
        print(f"[bench] target {target['key']} {target['target']}: measured {target['measured']}, "
              f"met={target['met']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
