"""`python -m bench.profile [--mode quick] [--precision bf16] [--steps 3] [--compile]`

Where the time of one training step goes: our program's own step (its job builder, strategy and
loop functions, in this process, a group of one) next to the plain PyTorch loop on the same model,
batch and precision, both under torch.profiler. Prints the operators that take the most time in
either, with the time per step of each, so a difference between the two points at its cause; then
times both steps taken in turns (so a change of load hits both alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.model import _tokenizer, build_causal_lm, tokenizer_vocab_size
from bench.modes import MODES, BenchConfig, BenchMode
from bench.ours import OursRun, write_train_channel
from bench.tokens import batch, load_tokens, write_tokens


def _profile(step_fn, warmup: int, steps: int) -> dict[str, float]:
    """Self CPU time per step (ms) of every operator, and the wall time per step."""
    for _ in range(warmup):
        step_fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step_fn()
    table = {event.key: event.self_cpu_time_total / 1000 / steps for event in profiler.key_averages()}
    return table


def ours_step(mode: BenchMode, precision: str, root: Path, compile_layers: bool = False):
    """Our program's train step, built by its own job builder from the container contract."""
    from training_jobs.contract.hyperparameters import from_hyperparameters
    from training_jobs.trainer import job, loop, parallel
    from training_jobs.trainer.environment import read_environment

    config = BenchConfig(f"ours_{precision}", "ours", precision, compile=compile_layers)
    run = OursRun(config, mode, 1000, root / "train", root / "job")
    environ = {key: value for key, value in run.environment().items()}
    environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env = read_environment([], environ)
    parsed = from_hyperparameters(env.hyperparameters)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    parallel.init_distributed(torch.device("cpu"), 0, 1, timeout_minutes=5)
    ctx = job.build(parsed, env, torch.device(mode.device)).loop

    def step():
        loss = loop.train_step(ctx)
        ctx.strategy.step()
        loss.item()

    return step


def plain_step(mode: BenchMode, precision: str, tokens_path: Path, compile_model: bool = False):
    """The plain loop's step (bench.workers.plain_loop, inlined for the profiler)."""
    torch.manual_seed(0)
    model = build_causal_lm(mode.model_preset, mode.seq_len)
    forward = torch.compile(model) if compile_model else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=True)
    tokens = load_tokens(tokens_path)
    counter = iter(range(10**9))

    def step():
        input_ids = torch.from_numpy(batch(tokens, next(counter), mode.global_batch_size, mode.seq_len))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = forward(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return step


def alternate(steps: dict, repeats: int) -> dict[str, float]:
    """Median wall time per step of each step function, run in turns (drifting load hits all)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def compare(ours: dict[str, float], plain: dict[str, float], top: int) -> list[dict]:
    names = sorted(set(ours) | set(plain), key=lambda n: -max(ours.get(n, 0), plain.get(n, 0)))
    return [{"op": n, "ours_ms": round(ours.get(n, 0.0), 2), "plain_ms": round(plain.get(n, 0.0), 2)}
            for n in names[:top]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[2])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="our program with compile=true, the plain loop with torch.compile(model)")
    parser.add_argument("--kernels", action="store_true",
                        help="with --compile: time each generated C++ kernel on its own line "
                             "(inductor's cpp.enable_kernel_profile) instead of whole compiled graphs")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=8, help="timed steps of each, taken in turns")
    parser.add_argument("--json", type=Path, help="also write the comparison here")
    args = parser.parse_args(argv)
    if args.kernels and not args.compile:
        parser.error("--kernels names the kernels torch.compile generates: add --compile")
    if args.kernels:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    mode = MODES[args.mode]
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as folder:
        root = Path(folder)
        vocab = tokenizer_vocab_size()
        tokens_path = write_tokens(root / "tokens.npy", 2_000_000, vocab)
        write_train_channel(load_tokens(tokens_path), root / "train", vocab, _tokenizer().eos_token_id)
        steps = {"plain": plain_step(mode, args.precision, tokens_path, args.compile),
                 "ours": ours_step(mode, args.precision, root, args.compile)}
        plain = _profile(steps["plain"], 2, args.steps)
        ours = _profile(steps["ours"], 2, args.steps)
        medians = alternate(steps, args.repeats)
    rows = compare(ours, plain, args.top)
    print(f"{'operator':55s} {'ours ms/step':>13s} {'plain ms/step':>14s}")
    for row in rows:
        print(f"{row['op'][:55]:55s} {row['ours_ms']:13.2f} {row['plain_ms']:14.2f}")
    print(f"{'TOTAL self CPU (all threads of the main process)':55s} {sum(ours.values()):13.2f} "
          f"{sum(plain.values()):14.2f}")
    print(f"wall time per step, median of {args.repeats} taken in turns: "
          + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in medians.items()))
    if args.json:
        args.json.write_text(json.dumps({"operators": rows, "median_step_s": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
