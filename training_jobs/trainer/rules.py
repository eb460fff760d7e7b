"""Rules that watch a run and act on it (the place SageMaker Debugger's rules take, in the program).

Three rules judge each step or logging window against running statistics of the healthy ones before
it, a fourth judges a mixture of experts' routing; the fifth, the hang watchdog, is
trainer/watchdog.py:

- `loss_spike`: a step's loss above `rule_loss_spike_factor` x the running mean of recent losses;
- `grad_norm_explosion`: a step's global gradient norm above `rule_grad_norm_factor` x the running
  median of recent norms;
- `throughput_drop`: a logging window's tokens/s below `rule_throughput_fraction` x the running
  median of recent windows' (evaluation and checkpoint time are already left out of tokens/s);
- `router_collapse` (mixture-of-experts models): in a logging window, one expert of a layer took at
  least `rule_router_collapse_fraction` of that layer's tokens (an absolute threshold: a collapsed
  router is no deviation from its own history).

The first `rule_warmup_steps` steps of each job (the loss falls fast, the first steps compile) are
neither judged nor counted; a rule judges once its statistics hold `MIN_HISTORY` values; a value that
fires a rule is kept out of its statistics. What a rule does is its action: log, skip (the step's
update is not applied), rollback (trainer/loop.py reloads the last complete checkpoint) or stop.

The values come identical to every rank (loop.py broadcasts rank 0's), so every rank reaches the
same verdicts at the same step without another collective. This module holds only the arithmetic
(no torch): loop.py calls it and carries out the actions.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..contract.hyperparameters import RulesConfig

MIN_HISTORY = 5
# Actions by severity: when several rules fire at one step, the most severe one is carried out.
SEVERITY = {"off": 0, "log": 1, "skip": 2, "rollback": 3, "stop": 4}
# Actions that keep the step's update from being applied (a roll-back or a stop discards it anyway).
WITHHOLD_UPDATE = ("skip", "rollback", "stop")
# Actions loop.py carries out between steps.
BETWEEN_STEPS = ("rollback", "stop")


@dataclass(frozen=True)
class Verdict:
    """One rule that fired: at which step, on what value, against which threshold."""

    rule: str
    step: int
    value: float
    threshold: float
    baseline: float  # the running statistic the threshold multiplies
    action: str
    explanation: str  # e.g. "loss 12.3 is above 3 x its running mean 2.47"

    def describe(self) -> str:
        return f"{self.rule} at step {self.step}: {self.explanation} (action {self.action})"

    def record(self) -> dict:
        """The metrics line ([rule], and a JSON line of kind "rule")."""
        return {"step": self.step, "rule": self.rule, "action": self.action, "value": self.value,
                "threshold": self.threshold, "baseline": self.baseline}


class RunningStatistic:
    """The last `size` healthy values and their mean or median."""

    def __init__(self, size: int, summary: Callable[[list[float]], float]) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.summary = summary

    @property
    def ready(self) -> bool:
        return len(self.values) >= MIN_HISTORY

    def value(self) -> float:
        return self.summary(list(self.values))

    def add(self, value: float) -> None:
        if math.isfinite(value):  # a non-finite value stops the job elsewhere (DivergenceError)
            self.values.append(value)


@dataclass
class ThresholdRule:
    """Fires when a value crosses `factor` x its running statistic: above it (`above`), or below it."""

    name: str
    quantity: str  # what the value is, for the explanation
    statistic_name: str  # "mean" or "median"
    factor: float
    action: str
    statistic: RunningStatistic
    above: bool = True

    def judge(self, step: int, value: float) -> Verdict | None:
        """The verdict on `value` (None when it is healthy, or the rule is off or not ready); a
        healthy value joins the statistics."""
        if self.action == "off" or not math.isfinite(value):
            return None
        if not self.statistic.ready:
            self.statistic.add(value)
            return None
        baseline = self.statistic.value()
        threshold = self.factor * baseline
        fired = value > threshold if self.above else value < threshold
        if not fired:
            self.statistic.add(value)
            return None
        side = "above" if self.above else "below"
        explanation = (f"{self.quantity} {value:.6g} is {side} {self.factor:g} x its running "
                       f"{self.statistic_name} {baseline:.6g}")
        return Verdict(self.name, step, value, threshold, baseline, self.action, explanation)


@dataclass
class CollapseRule:
    """Fires when the busiest expert's share of a layer's tokens reaches `fraction`."""

    fraction: float
    action: str

    def judge(self, step: int, share: float, balanced_share: float) -> Verdict | None:
        if self.action == "off" or not math.isfinite(share) or share < self.fraction:
            return None
        explanation = (f"one expert took {share:.4g} of a layer's tokens, at or above "
                       f"{self.fraction:g} (a balanced router gives each {balanced_share:.4g})")
        return Verdict("router_collapse", step, share, self.fraction, balanced_share, self.action,
                       explanation)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class Rules:
    """The verdicts of one job's rules, step by step and window by window, and what to do about them.

    `judge_step` is called once per step in order (from the update gate before the optimizer step
    where a rule may skip it, `judges_before_update`; otherwise from the logging step), and
    `judge_window` once per logging window. A verdict whose action is rollback or stop waits in
    `pending` until loop.py carries it out between steps.
    """

    def __init__(self, config: RulesConfig) -> None:
        self.config = config
        window = config.rule_window
        self.loss = ThresholdRule("loss_spike", "loss", "mean", config.rule_loss_spike_factor,
                                  config.rule_loss_spike_action, RunningStatistic(window, _mean))
        self.grad_norm = ThresholdRule("grad_norm_explosion", "gradient norm", "median",
                                       config.rule_grad_norm_factor, config.rule_grad_norm_action,
                                       RunningStatistic(window, statistics.median))
        self.throughput = ThresholdRule("throughput_drop", "tokens/s", "median",
                                        config.rule_throughput_fraction, config.rule_throughput_action,
                                        RunningStatistic(window, statistics.median), above=False)
        self.router = CollapseRule(config.rule_router_collapse_fraction,
                                   config.rule_router_collapse_action)
        self.steps_judged = 0  # steps of this job, roll-backs included (they train steps again)
        self.pending: Verdict | None = None
        self.rollbacks_in_a_row = 0

    @property
    def judges_before_update(self) -> bool:
        """Whether the step rules must judge before the optimizer step (an action may skip it),
        which costs one host synchronisation per step; otherwise they judge at the logging step."""
        return "skip" in (self.loss.action, self.grad_norm.action)

    def judge_step(self, step: int, loss: float, grad_norm: float) -> list[Verdict]:
        self.steps_judged += 1
        if self.steps_judged <= self.config.rule_warmup_steps:
            return []
        verdicts = [v for v in (self.loss.judge(step, loss), self.grad_norm.judge(step, grad_norm)) if v]
        self._hold(verdicts)
        return verdicts

    def judge_window(self, step: int, steps: int, tokens_per_sec: float, *,
                     measured_alone: bool = True) -> list[Verdict]:
        """A logging window of `steps` steps ending at `step`; one that began in the warm-up (its
        first steps compiled) or ran beside a checkpoint written in the background (which competes
        for the host) is neither judged nor counted."""
        if not measured_alone or self.steps_judged - steps < self.config.rule_warmup_steps:
            return []
        verdict = self.throughput.judge(step, tokens_per_sec)
        verdicts = [verdict] if verdict else []
        self._hold(verdicts)
        return verdicts

    def judge_routing(self, step: int, max_expert_share: float, balanced_share: float) -> list[Verdict]:
        """A logging window's routing (the busiest expert's share of its layer's tokens, over the
        worst layer), after the warm-up."""
        if self.steps_judged < self.config.rule_warmup_steps:
            return []
        verdict = self.router.judge(step, max_expert_share, balanced_share)
        verdicts = [verdict] if verdict else []
        self._hold(verdicts)
        return verdicts

    def _hold(self, verdicts: list[Verdict]) -> None:
        for verdict in verdicts:
            if verdict.action in BETWEEN_STEPS and (
                    self.pending is None or SEVERITY[verdict.action] > SEVERITY[self.pending.action]):
                self.pending = verdict

    def take_pending(self) -> Verdict | None:
        pending, self.pending = self.pending, None
        return pending

    def rolled_back(self) -> None:
        self.rollbacks_in_a_row += 1

    def checkpoint_written(self) -> None:
        self.rollbacks_in_a_row = 0

    @property
    def may_roll_back(self) -> bool:
        return self.rollbacks_in_a_row < self.config.rule_max_rollbacks


def withholds_update(verdicts: list[Verdict]) -> bool:
    """Whether the step these verdicts judged must not be applied."""
    return any(verdict.action in WITHHOLD_UPDATE for verdict in verdicts)


def process_group_timeout_minutes(config: RulesConfig, default: float = 30.0) -> float:
    """The collectives' own timeout: longer than the hang watchdog's, so the watchdog, which says where
    every rank was, acts first."""
    return max(default, config.rule_hang_minutes + 10.0)
