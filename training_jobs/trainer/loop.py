"""The training loop: micro steps with gradient accumulation, the optimizer step, logging,
evaluation, the profiler window, checkpoints, the stop signal, and the rules' actions.

The hot path never waits for the device: losses and gradient norms stay on the device and are
read once per logging step (one all-reduce of the window's losses), which is also where a
non-finite loss is detected and the rules judge each step (trainer/rules.py); a checkpoint is only
written after that. Only a rule whose action is skip judges each step before its update, at the
cost of one host synchronisation per step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..contract.hyperparameters import TrainConfig, profile_window
from .checkpoint import CheckpointStore, Triggers, read_trainer_state
from .data import EvalBatches, TrainBatches
from .errors import DivergenceError, RuleTriggered
from .faults import Faults
from .metrics import MetricsLogger, log, peak_memory_gb
from .moe.signals import RouterSignals
from .objectives import Objective
from .rules import Rules, Verdict, withholds_update
from .strategies import Strategy
from .strategies.protocol import UpdateGate
from .watchdog import HangWatchdog


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
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    excluded: float = 0.0  # seconds spent evaluating, checkpointing or rolling back inside the window
    # a checkpoint written in the background competes with these steps for the host: not a drop
    beside_a_save: bool = False


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
    rules: Rules
    objective: Objective
    faults: Faults = field(default_factory=Faults)
    watchdog: HangWatchdog | None = None  # started and stopped by run()
    router: RouterSignals | None = None  # a mixture of experts' router losses, metrics and biases
    step: int = 0

    def trainer_state(self) -> dict:
        return {"step": self.step, "data": self.train.state_dict(),
                "scheduler": self.strategy.scheduler_state(),
                "parallel": self.strategy.topology.dims.state(),
                "hyperparameters": self.config.flat()}


def train_step(ctx: LoopContext) -> torch.Tensor:
    """One optimizer step's forward and backward; returns this rank's loss (a device tensor) such
    that its mean over the data-parallel ranks (topology.mean_loss) is the step's loss."""
    step, rank = ctx.step + 1, dist.get_rank()
    ctx.faults.before_step(step, rank, ctx.train.next_step)
    micro_batches, loss_fn = ctx.objective.prepare_step(ctx.train.next_step(), ctx.train.step_samples)
    if ctx.router is not None:  # a mixture of experts: its router losses join the objective's
        loss_fn = ctx.router.with_router_losses(loss_fn)
    loss_fn = ctx.faults.loss(step, rank, loss_fn)
    return ctx.strategy.forward_backward(micro_batches, loss_fn)


def _global_losses(ctx: LoopContext, losses: list[torch.Tensor]) -> list[float]:
    """Each step's loss averaged over the data-parallel ranks (one all-reduce per window)."""
    return ctx.strategy.topology.mean_loss(torch.stack(losses).float()).tolist()


def same_on_every_rank(values: list[float]) -> list[float]:
    """Rank 0's values on every rank (a broadcast of a CPU tensor, gloo), so that every rank's rules
    judge the same numbers: a rank's own clock, or a last bit of a reduction, never splits a decision."""
    if dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


def _update_gate(ctx: LoopContext, loss: torch.Tensor) -> UpdateGate | None:
    """Where a rule may skip a step: judge the step's loss and gradient norm before its update."""
    if not ctx.rules.judges_before_update:
        return None

    def gate(grad_norm: torch.Tensor) -> bool:
        global_loss = ctx.strategy.topology.mean_loss(loss.detach().float().reshape(1).clone())
        value, norm = same_on_every_rank(
            torch.stack([global_loss[0], grad_norm.float().to(global_loss.device)]).tolist())
        verdicts = ctx.rules.judge_step(ctx.step + 1, value, norm)
        _record_verdicts(ctx, verdicts)
        return not withholds_update(verdicts)
    return gate


def _record_verdicts(ctx: LoopContext, verdicts: list[Verdict]) -> None:
    for verdict in verdicts:
        ctx.metrics.rule(verdict.record())


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
    """Synchronise once: check the window for divergence, write the metrics line, let the rules judge
    the window's steps (unless they judged them before their updates) and its throughput."""
    losses = _global_losses(ctx, window.losses)
    grad_norms = torch.stack(window.grad_norms).float().tolist()
    _check_finite(losses, window, grad_norms[-1])
    steps = len(losses)
    elapsed = max(time.perf_counter() - window.started - window.excluded, 1e-9)
    tokens_per_sec = ctx.throughput.tokens_per_step * steps / elapsed
    mfu = ctx.throughput.flops_per_token * tokens_per_sec / ctx.throughput.peak_flops_total \
        if ctx.throughput.peak_flops_total else 0.0
    ctx.metrics.train({"step": ctx.step, "loss": sum(losses) / steps, "lr": ctx.strategy.current_lr(),
                       "grad_norm": grad_norms[-1], "tokens_per_sec": tokens_per_sec, "mfu": mfu,
                       "step_time": elapsed / steps, "memory_gb": peak_memory_gb(ctx.device),
                       **ctx.objective.window_metrics()})
    _judge_window(ctx, window, losses, grad_norms, tokens_per_sec)
    if ctx.router is not None:
        _report_routing(ctx)


def _report_routing(ctx: LoopContext) -> None:
    """The window's `[moe]` line, and the router_collapse rule's verdict on it."""
    balance = ctx.router.window_balance()
    ctx.metrics.moe(balance.metrics(ctx.step))
    share, = same_on_every_rank([balance.max_expert_share])
    _record_verdicts(ctx, ctx.rules.judge_routing(ctx.step, share, ctx.router.balanced_share))


def _judge_window(ctx: LoopContext, window: Window, losses: list[float], grad_norms: list[float],
                  tokens_per_sec: float) -> None:
    rules, steps = ctx.rules, len(losses)
    values = same_on_every_rank([*losses, *grad_norms, tokens_per_sec])
    verdicts = []
    if not rules.judges_before_update:
        for offset in range(steps):
            verdicts += rules.judge_step(window.first_step + offset, values[offset],
                                         values[steps + offset])
    verdicts += rules.judge_window(ctx.step, steps, values[-1], measured_alone=not window.beside_a_save)
    _record_verdicts(ctx, verdicts)


@torch.no_grad()
def evaluate(ctx: LoopContext) -> float:
    ctx.strategy.train(False)
    values = ctx.objective.evaluate(ctx.evaluation)
    ctx.strategy.train(True)
    ctx.metrics.eval({"step": ctx.step, **values})
    return values["eval_loss"]


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
    ctx.rules.checkpoint_written()
    if dist.get_rank() == 0:
        background = " (writing in the background)" if ctx.store.pending else ""
        log(f"checkpoint step={ctx.step} path={path} seconds={time.perf_counter() - started:.2f}"
            f"{background}")


def _commit_finished_save(ctx: LoopContext) -> None:
    committed = ctx.store.poll_pending()
    if committed is not None and dist.get_rank() == 0:
        log(f"checkpoint complete: {committed}")


def _beat(ctx: LoopContext, done: str) -> None:
    if ctx.watchdog is not None:
        ctx.watchdog.beat(done)


def _after_step(ctx: LoopContext, window: Window, last: bool) -> tuple[Window, bool]:
    """Logging, the rules' actions, evaluation and checkpoints after a step; returns the next window
    and "stop"."""
    logging = ctx.config.logging
    checkpoint_now, stop = ctx.triggers.poll(ctx.step)
    if _due(logging.log_every_steps, ctx.step, last) or checkpoint_now or stop or ctx.rules.pending:
        report(ctx, window)  # the divergence check and the rules: a diverged model is never saved
        window = Window(ctx.step + 1, time.perf_counter())
    paused = time.perf_counter()
    verdict = ctx.rules.take_pending()
    if verdict is not None:
        act(ctx, verdict)  # a roll-back, or a stop (raises)
        window = Window(ctx.step + 1, time.perf_counter())
        return window, False
    _commit_finished_save(ctx)
    if ctx.evaluation is not None and _due(logging.eval_every_steps, ctx.step, last):
        evaluate(ctx)
        _beat(ctx, f"the evaluation at step {ctx.step}")
    if checkpoint_now or stop or last:
        save(ctx, wait=stop or last)  # the job ends after these: their files must be on disk
        _beat(ctx, f"the checkpoint of step {ctx.step}")
        window.beside_a_save = ctx.store.pending is not None
    window.excluded += time.perf_counter() - paused  # not training time: keep it out of tokens/s
    return window, stop


def act(ctx: LoopContext, verdict: Verdict) -> None:
    """Carry out a rule's roll-back or stop. A stop saves nothing: the checkpoint being written in the
    background (of a step the rules had passed) is committed, then the job fails with the verdict."""
    ctx.store.finish_pending()
    if verdict.action == "stop":
        raise RuleTriggered(f"{verdict.describe()}. {_resume_hint(ctx)}")
    if not ctx.rules.may_roll_back:
        raise RuleTriggered(f"{verdict.describe()}, after {ctx.rules.rollbacks_in_a_row} roll-back(s) "
                            f"in a row without a new checkpoint: the fault persists. {_resume_hint(ctx)}")
    folder = ctx.store.newest_readable_everywhere()
    if folder is None:
        raise RuleTriggered(f"{verdict.describe()}, but there is no checkpoint to roll back to (none "
                            "written yet, or each host holds only its own ranks' files: roll-backs "
                            "need /opt/ml/checkpoints on a shared file system on several hosts); "
                            "set checkpoint_every_steps, or the rule's action to skip, log or stop")
    rollback(ctx, folder, verdict)


def _resume_hint(ctx: LoopContext) -> str:
    found = ctx.store.newest_readable_everywhere()
    where = f"from {found.name}" if found is not None else "from its last checkpoint"
    return (f"Starting the run again resumes {where}; lower lr or raise warmup_steps, or change the "
            "rule's setting (rule_* hyperparameters)")


def rollback(ctx: LoopContext, folder: Path, verdict: Verdict) -> None:
    """Reload `folder`'s model, optimizer, schedule and RNG, and continue with the data after the
    batches that set the rule off (they are not trained again, as a restart would)."""
    started, from_step = time.perf_counter(), ctx.step
    state = read_trainer_state(folder)
    ctx.store.load(folder, ctx.strategy)
    ctx.strategy.load_scheduler(state["scheduler"])
    ctx.step = int(state["step"])
    ctx.rules.rolled_back()
    _beat(ctx, f"the roll-back to step {ctx.step}")
    ctx.metrics.rule({"step": from_step, "rule": verdict.rule, "rolled_back_to": ctx.step,
                      "checkpoint": str(folder)})
    if dist.get_rank() == 0:
        log(f"rolled back from step {from_step} to {folder} (step {ctx.step}) after {verdict.describe()}"
            f"; the data continues at sample {ctx.train.consumed_samples} "
            f"({time.perf_counter() - started:.2f} s)")


def run(ctx: LoopContext) -> str:
    """Train until max_steps or a stop signal; returns "finished" or "interrupted"."""
    max_steps = ctx.config.run.max_steps
    profiler = Profiler(profile_window(ctx.config.logging.profile_steps), ctx.output_dir,
                        dist.get_rank())
    ctx.strategy.train(True)
    if ctx.watchdog is not None:
        ctx.watchdog.start()
    try:
        window = Window(ctx.step + 1, time.perf_counter())
        while ctx.step < max_steps:
            profiler.before(ctx.step + 1)
            loss = train_step(ctx)
            window.losses.append(loss)
            window.grad_norms.append(ctx.strategy.step(_update_gate(ctx, loss)))
            if ctx.router is not None:
                ctx.router.after_update()
            ctx.step += 1
            _beat(ctx, f"step {ctx.step}")
            profiler.after(ctx.step)
            window, stop = _after_step(ctx, window, last=ctx.step == max_steps)
            if stop:
                if dist.get_rank() == 0:
                    log(f"stop signal received: saved step {ctx.step} and stopping")
                return "interrupted"
        return "finished"
    finally:
        if ctx.watchdog is not None:
            ctx.watchdog.stop()
