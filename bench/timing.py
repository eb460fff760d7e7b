"""Step times from the outside: the arrival time of each configuration's per-step output line.

Every configuration, ours and the peers alike, prints one line per optimizer step (ours: its
contract `[metrics] step=N ...` line with log_every_steps=1; the peers: `[bench] step=N`). bench.run
timestamps each line as it arrives on the pipe, so every configuration is timed by the same clock
and the time between two lines is the whole step: data, forward, backward, optimizer, logging and
anything else the program does in between (a checkpoint save included).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from itertools import pairwise

STEP_LINE = re.compile(r"^\[(?:metrics|bench)\] step=(\d+)\b")


@dataclass(frozen=True)
class StepTimes:
    steps: list[int]  # step numbers in arrival order
    intervals: list[float]  # seconds per step between consecutive lines (divided by the step gap)

    def after_warmup(self, warmup_steps: int) -> list[float]:
        return [t for step, t in zip(self.steps[1:], self.intervals, strict=True) if step > warmup_steps]

    def median_after_warmup(self, warmup_steps: int) -> float:
        measured = self.after_warmup(warmup_steps)
        if not measured:
            raise ValueError(f"no step after the {warmup_steps} warm-up steps was logged")
        return statistics.median(measured)


def step_times(lines: list[tuple[float, str]]) -> StepTimes:
    arrivals: list[tuple[int, float]] = []
    for arrival, text in lines:
        match = STEP_LINE.match(text)
        if match:
            arrivals.append((int(match[1]), arrival))
    steps = [step for step, _ in arrivals]
    if any(s1 <= s0 for s0, s1 in pairwise(steps)):
        raise ValueError(f"step numbers must increase, got {steps}")
    intervals = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in pairwise(arrivals)]
    return StepTimes(steps=steps, intervals=intervals)


def step_cpu_times(lines: list[tuple[float, str]], cpu_seconds: list[float],
                   warmup_steps: int) -> list[float]:
    """CPU seconds per step after the warm-up, from the tree's CPU time at each step line's arrival
    (bench.procs): the work of a step whatever else the machine ran meanwhile."""
    arrivals = [(int(match[1]), cpu) for (_, text), cpu in zip(lines, cpu_seconds, strict=True)
                if (match := STEP_LINE.match(text))]
    return [(c1 - c0) / (s1 - s0) for (s0, c0), (s1, c1) in pairwise(arrivals) if s1 > warmup_steps]


def stall_per_event(times: StepTimes, event_steps: set[int], warmup_steps: int) -> list[float]:
    """Extra seconds at each event step (e.g. a checkpoint save) over the median ordinary step.

    The stall may show in the step that triggers the event or in the next one (depending on when
    the line is printed), so both intervals count, less two ordinary steps.
    """
    pairs = list(zip(times.steps[1:], times.intervals, strict=True))
    ordinary = [t for step, t in pairs
                if step > warmup_steps and step not in event_steps and step - 1 not in event_steps]
    typical = statistics.median(ordinary)
    by_step = dict(pairs)
    stalls = []
    for step in sorted(event_steps):
        if step in by_step and step + 1 in by_step:
            stalls.append(by_step[step] + by_step[step + 1] - 2 * typical)
    return stalls
