"""Pipeline parallelism as the training program runs it: the order in which a rank runs its stages'
forwards and backwards, and what it holds meanwhile.

Which decoder layers each stage holds and which stages each pipeline rank holds are the program's
contract (training_jobs/contract/stage_split.py: the balanced split, rank r holding stages r,
r + degree, ...); torch.distributed.pipelining's schedule runs them. The order of a rank's actions
fixes how many micro-batches it holds activations for at once (GPipe all of them; 1F1B at most the
degree; the interleaved schedules by their warm-up), so the planner replays torch's own order
(`rank_actions`) rather than a formula. llmtrain never imports torch: tests/llmtrain/test_planner.py
keeps `rank_actions` equal to torch's schedules.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"


@dataclass(frozen=True)
class Action:
    """One compute action of a pipeline rank: a stage's forward, full backward, or (zero bubble)
    backward for the input only and, later, for the weights."""

    stage: int
    kind: str
    micro_batch: int


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: decoder layers first_layer .. first_layer + num_layers - 1, with the
    embedding when `first` and the final norm, head and loss when `last`."""

    index: int
    first_layer: int
    num_layers: int
    first: bool
    last: bool

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


def stages_from_counts(counts: tuple[int, ...]) -> tuple[Stage, ...]:
    stages, first_layer = [], 0
    for index, count in enumerate(counts):
        stages.append(Stage(index, first_layer, count, index == 0, index == len(counts) - 1))
        first_layer += count
    return tuple(stages)


# --- the schedules' order ---------------------------------------------------------------------------


def rank_actions(schedule: str, degree: int, per_rank: int, micro_batches: int, rank: int) -> list[Action]:
    """The compute actions pipeline rank `rank` runs in one step, in torch's order."""
    if schedule == "gpipe":
        return [Action(rank, FORWARD, mb) for mb in range(micro_batches)] + [
            Action(rank, BACKWARD, mb) for mb in range(micro_batches)
        ]
    if schedule == "1f1b":
        return _one_f_one_b(degree, micro_batches, rank)
    return _interleaved(schedule, degree, per_rank, micro_batches, rank)


def _one_f_one_b(degree: int, micro_batches: int, rank: int) -> list[Action]:
    """Schedule1F1B: degree - rank forwards to fill the pipeline, then one backward and one forward
    in turn, then the remaining backwards."""
    warmup = min(micro_batches, degree - rank)
    actions = [Action(rank, FORWARD, mb) for mb in range(warmup)]
    for mb in range(micro_batches):
        actions.append(Action(rank, BACKWARD, mb))
        if warmup + mb < micro_batches:
            actions.append(Action(rank, FORWARD, warmup + mb))
    return actions


@dataclass(frozen=True)
class _Rounds:
    """How the interleaved schedules walk a rank's stages: `per_round` micro-batches on one stage,
    then the next."""

    degree: int
    per_rank: int
    micro_batches: int
    rank: int
    warmup: int

    @property
    def per_round(self) -> int:
        rounds = max(1, self.micro_batches // self.degree)
        return self.micro_batches // rounds

    def forward_stage(self, step: int) -> int:
        return ((step // self.per_round) % self.per_rank) * self.degree + self.rank

    def backward_stage(self, step: int) -> int:
        local = self.per_rank - 1 - ((step - self.warmup) // self.per_round) % self.per_rank
        return local * self.degree + self.rank


def interleaved_warmup(schedule: str, degree: int, per_rank: int, micro_batches: int, rank: int) -> int:
    """Forwards before the first backward: the last rank fills its other stages with a round of
    micro-batches each, every rank before it two (interleaved 1F1B) or one (zero bubble) more."""
    rounds = max(1, micro_batches // degree)
    per_round = micro_batches // rounds
    hops = 2 if schedule == "interleaved_1f1b" else 1
    return min((per_rank - 1) * per_round + hops * (degree - 1 - rank), micro_batches * per_rank)


def _interleaved(schedule: str, degree: int, per_rank: int, micro_batches: int, rank: int) -> list[Action]:
    """ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (ZB1P): warm-up forwards, then
    a forward and a backward in turn, then the remaining backwards; zero bubble splits each backward
    into input (I) and weight (W) gradients and runs the W of rank r's backwards r steps late."""
    zero_bubble = schedule == "zero_bubble"
    warmup = interleaved_warmup(schedule, degree, per_rank, micro_batches, rank)
    walk = _Rounds(degree, per_rank, micro_batches, rank, warmup)
    total = per_rank * micro_batches
    forwards: dict[int, int] = defaultdict(int)
    backwards: dict[int, int] = defaultdict(int)
    weights: dict[int, int] = defaultdict(int)
    backward_steps: list[int] = []
    actions: list[Action] = []

    def next_of(counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    for step in range(warmup + total):
        if step < total:
            stage = walk.forward_stage(step)
            actions.append(Action(stage, FORWARD, next_of(forwards, stage)))
        if step < warmup:
            continue
        stage = walk.backward_stage(step)
        actions.append(Action(stage, BACKWARD_INPUT if zero_bubble else BACKWARD, next_of(backwards, stage)))
        backward_steps.append(step)
        if zero_bubble and step - warmup >= rank:
            done = walk.backward_stage(backward_steps[_weights_done(weights)])
            actions.append(Action(done, BACKWARD_WEIGHT, next_of(weights, done)))
    while zero_bubble and _weights_done(weights) < len(backward_steps):
        done = walk.backward_stage(backward_steps[_weights_done(weights)])
        actions.append(Action(done, BACKWARD_WEIGHT, next_of(weights, done)))
    return actions


def _weights_done(weights: dict[int, int]) -> int:
    return sum(weights.values())


# --- what a step costs in time ----------------------------------------------------------------------


def bubble_fraction(degree: int, per_rank: int, micro_batches: int) -> float:
    """The share of a step a rank idles while the pipeline fills and drains, for equal stages and
    a full backward: (p - 1) / (v x m + p - 1), with p ranks, v stages per rank, m micro-batches
    (1F1B and GPipe: v = 1)."""
    return (degree - 1) / (per_rank * micro_batches + degree - 1)


# --- what a rank holds for its micro-batches ---------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds for backward: `per_micro_batch` from each forward to its backward;
    `between_backwards` more from a zero-bubble input backward to its weight backward (the
    gradients the weight backward starts from), and `after_weights` of it from the weight backward
    to the end of the step (what only the input backward needed: torch does not free it then);
    `once` from the stage's first forward to the end of the step (autocast's compute-dtype weight
    copies, cached for the step)."""

    per_micro_batch: float
    between_backwards: float = 0.0
    after_weights: float = 0.0
    once: float = 0.0


@dataclass(frozen=True)
class HeldPeak:
    bytes: float
    in_flight: int  # the most micro-batches one stage held at once


def peak_held(actions: list[Action], memories: dict[int, StageMemory]) -> HeldPeak:
    """The most a rank holds at once while it runs `actions` (the peak follows a forward or an
    input backward: every other action only frees)."""
    live: dict[tuple[int, int], float] = {}
    started: set[int] = set()
    kept = peak = 0.0
    in_flight = 0
    for action in actions:
        memory = memories[action.stage]
        key = (action.stage, action.micro_batch)
        if action.kind == FORWARD:
            live[key] = memory.per_micro_batch
            started.add(action.stage)
            in_flight = max(in_flight, sum(1 for stage, _ in live if stage == action.stage))
        elif action.kind == BACKWARD_INPUT:
            live[key] += memory.between_backwards
        else:
            live.pop(key, None)
            kept += memory.after_weights if action.kind == BACKWARD_WEIGHT else 0.0
            continue
        held = sum(live.values()) + sum(memories[stage].once for stage in started) + kept
        peak = max(peak, held)
    return HeldPeak(peak, in_flight)
