"""The training loop: micro steps with gradient accumulation, the optimizer step, logging,
evaluation, the profiler window, checkpoints and the stop signal.

The hot path never waits for the device: losses and gradient norms stay on the device and are
read once per logging step (one all-reduce of the window's losses), which is also where a
non-finite loss is detected; a checkpoint is only written after that check.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..contract.hyperparameters import TrainConfig, profile_window
from .checkpoint import CheckpointStore, Triggers
from .data import EvalBatches, TrainBatches
from .errors import DivergenceError
from .loss import causal_lm_loss, causal_lm_loss_sum, trained_targets
from .metrics import MetricsLogger, log, peak_memory_gb
from .strategies import Strategy
from .strategies.protocol import LossFn, MicroBatch


@dataclass
class Throughput:
    """Inputs of the per-window speed metrics."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops_total: float


@dataclass
class Window:
    """Device-side values of the steps since the last log line."""

    first_step: int
    started: float
    losses: list[torch.Tensor] = field(default_factory=list)
    grad_norm: torch.Tensor | None = None
    excluded: float = 0.0  # seconds spent evaluating or checkpointing inside the window


@dataclass
class LoopContext:
    config: TrainConfig
    strategy: Strategy
    train: TrainBatches
    evaluation: EvalBatches | None
    store: CheckpointStore
    triggers: Triggers
    metrics: MetricsLogger
    throughput: Throughput
    output_dir: Path
    device: torch.device
    step: int = 0

    def trainer_state(self) -> dict:
        return {"step": self.step, "data": self.train.state_dict(),
                "scheduler": self.strategy.scheduler_state(),
                "parallel": self.strategy.topology.dims.state(),
                "hyperparameters": self.config.flat()}


def train_step(ctx: LoopContext) -> torch.Tensor:
    """One optimizer step; returns this rank's loss (a device tensor) such that its mean over the
    data-parallel ranks (topology.mean_loss) is the step's loss."""
    micro_batches = ctx.train.next_step()
    return ctx.strategy.forward_backward(micro_batches, _micro_batch_loss(ctx, micro_batches))


def _micro_batch_loss(ctx: LoopContext, micro_batches: list[MicroBatch]) -> LossFn:
    token_weight = _trained_token_weight(ctx, micro_batches)
    if token_weight is None:
        return causal_lm_loss
    return lambda logits, targets: causal_lm_loss_sum(logits, targets) * token_weight


def _trained_token_weight(ctx: LoopContext, micro_batches) -> torch.Tensor | None:
    """With a loss-masked dataset, the factor of a micro batch's summed loss that makes the step's
    gradient (divided by the accumulation steps in backward, averaged over the batch ranks: data and
    context parallel)
    the mean over every trained token of the global batch, however unevenly they fall into micro
    batches: accumulation steps x ranks / trained targets. None for packed text, where every micro
    batch holds the same number of targets and its mean is the right loss."""
    if not ctx.train.samples.manifest.loss_mask:
        return None
    group = ctx.strategy.topology.batch_group()
    count = sum(trained_targets(targets) for _, targets in micro_batches)
    dist.all_reduce(count, group=group)
    return len(micro_batches) * dist.get_world_size(group) / count.clamp(min=1)


def _global_losses(ctx: LoopContext, window: Window) -> list[float]:
    """Each step's loss averaged over the data-parallel ranks (one all-reduce per window)."""
    return ctx.strategy.topology.mean_loss(torch.stack(window.losses).float()).tolist()


def _check_finite(losses: list[float], window: Window, grad_norm: float) -> None:
    for offset, value in enumerate(losses):
        if not math.isfinite(value):
            raise DivergenceError(
                f"the loss is {value} at step {window.first_step + offset}: training diverged. Lower "
                "lr, raise warmup_steps, enable gradient clipping (max_grad_norm), or check the data")
    if not math.isfinite(grad_norm):
        step = window.first_step + len(losses) - 1
        raise DivergenceError(f"the gradient norm is {grad_norm} at step {step}: training diverged. "
                              "Lower lr or enable gradient clipping (max_grad_norm)")


def report(ctx: LoopContext, window: Window) -> None:
    """Synchronise once: check the window for divergence and write the metrics line."""
    losses = _global_losses(ctx, window)
    grad_norm = float(window.grad_norm)
    _check_finite(losses, window, grad_norm)
    steps = len(losses)
    elapsed = max(time.perf_counter() - window.started - window.excluded, 1e-9)
    tokens_per_sec = ctx.throughput.tokens_per_step * steps / elapsed
    mfu = ctx.throughput.flops_per_token * tokens_per_sec / ctx.throughput.peak_flops_total \
        if ctx.throughput.peak_flops_total else 0.0
    ctx.metrics.train({"step": ctx.step, "loss": sum(losses) / steps, "lr": ctx.strategy.current_lr(),
                       "grad_norm": grad_norm, "tokens_per_sec": tokens_per_sec, "mfu": mfu,
                       "step_time": elapsed / steps, "memory_gb": peak_memory_gb(ctx.device)})


@torch.no_grad()
def evaluate(ctx: LoopContext) -> float:
    strategy = ctx.strategy
    strategy.train(False)
    total = torch.zeros(2, device=ctx.device)  # summed loss over the trained targets, their number
    batches = list(ctx.evaluation)
    for start in range(0, len(batches), strategy.eval_micro_batches):
        total += strategy.evaluate(batches[start:start + strategy.eval_micro_batches])
    strategy.train(True)
    strategy.topology.sum_loss(total)
    value = float(total[0] / total[1].clamp(min=1))
    ctx.metrics.eval({"step": ctx.step, "eval_loss": value})
    return value


class Profiler:
    """A torch.profiler trace of steps START..END (profile_steps), one file per rank."""

    def __init__(self, window: tuple[int, int] | None, output_dir: Path, rank: int) -> None:
        self.window, self.output_dir, self.rank = window, output_dir, rank
        self.active = None

    def before(self, step: int) -> None:
        if self.window and step == self.window[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.active = torch.profiler.profile(activities=activities, record_shapes=True)
            self.active.__enter__()

    def after(self, step: int) -> None:
        if self.active is not None and step == self.window[1]:
            self.active.__exit__(None, None, None)
            folder = self.output_dir / "profile"
            folder.mkdir(parents=True, exist_ok=True)
            self.active.export_chrome_trace(str(folder / f"trace_rank{self.rank}_steps"
                                                         f"{self.window[0]}-{self.window[1]}.json"))
            self.active = None


def _due(every: int, step: int, last: bool) -> bool:
    return last or (every > 0 and step % every == 0)


def save(ctx: LoopContext, *, wait: bool) -> None:
    """Checkpoint now; with wait=False the files may still be written after this returns (the log
    line's seconds are then the time training stood still, and a second line reports the commit)."""
    started = time.perf_counter()
    path = ctx.store.save(ctx.step, ctx.strategy, ctx.trainer_state(), wait=wait)
    ctx.triggers.saved()
    if dist.get_rank() == 0:
        background = " (writing in the background)" if ctx.store.pending else ""
        log(f"checkpoint step={ctx.step} path={path} seconds={time.perf_counter() - started:.2f}"
            f"{background}")


def _commit_finished_save(ctx: LoopContext) -> None:
    committed = ctx.store.poll_pending()
    if committed is not None and dist.get_rank() == 0:
        log(f"checkpoint complete: {committed}")


def _after_step(ctx: LoopContext, window: Window, last: bool) -> tuple[Window, bool]:
    """Logging, evaluation and checkpoints after a step; returns the next window and "stop"."""
    logging = ctx.config.logging
    checkpoint_now, stop = ctx.triggers.poll(ctx.step)
    if _due(logging.log_every_steps, ctx.step, last) or checkpoint_now or stop:
        report(ctx, window)  # also the divergence check: a diverged model is never saved
        window = Window(ctx.step + 1, time.perf_counter())
    paused = time.perf_counter()
    _commit_finished_save(ctx)
    if ctx.evaluation is not None and _due(logging.eval_every_steps, ctx.step, last):
        evaluate(ctx)
    if checkpoint_now or stop or last:
        save(ctx, wait=stop or last)  # the job ends after these: their files must be on disk
    window.excluded += time.perf_counter() - paused  # not training time: keep it out of tokens/s
    return window, stop


def run(ctx: LoopContext) -> str:
    """Train until max_steps or a stop signal; returns "finished" or "interrupted"."""
    max_steps = ctx.config.run.max_steps
    profiler = Profiler(profile_window(ctx.config.logging.profile_steps), ctx.output_dir,
                        dist.get_rank())
    ctx.strategy.train(True)
    window = Window(ctx.step + 1, time.perf_counter())
    while ctx.step < max_steps:
        profiler.before(ctx.step + 1)
        window.losses.append(train_step(ctx))
        window.grad_norm = ctx.strategy.step()
        ctx.step += 1
        profiler.after(ctx.step)
        window, stop = _after_step(ctx, window, last=ctx.step == max_steps)
        if stop:
            if dist.get_rank() == 0:
                log(f"stop signal received: saved step {ctx.step} and stopping")
            return "interrupted"
    return "finished"
