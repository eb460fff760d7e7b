"""A model of an environment's queue under AWS Batch's fair-share scheduling, and a week of it.

What it models, from Batch's documentation of fair-share scheduling policies (not its code, which is
not public), for one queue feeding one service environment of ``capacity`` instances:

- Usage decays. Each share identifier (a team) accumulates the instances it runs, forgotten with
  time constant ``share_decay_seconds``: between two events, with r instances running, its usage U
  becomes ``U e^(-dt/T) + r T (1 - e^(-dt/T))``. Batch: "the decay allows for more recently run jobs
  to have more weight than jobs that ran earlier" (0 means its minimum window, 600 s).
- Shares are served by usage over weight: the next job comes from the share with the lowest
  ``usage x weightFactor`` among those with jobs waiting (a lower factor gets more: Batch's 0.125 gets
  8 times what 1.0 gets); within a share, the highest scheduling priority first, then the oldest.
- The head of the queue waits for room: jobs start in that order while the next one fits in the
  free instances; when it does not, nothing behind it starts ("jobs at the front of the queue").
- Compute reservation: with A shares running jobs, ``(computeReservation/100)^A`` of the capacity is
  kept for shares that run nothing; a share that runs something may not start a job into it, and
  while its next job waits for the reserve, only shares running nothing may start (they are what
  the reserve is for).

What it leaves out: SageMaker's own capacity (every job that starts gets its instances), several
queues, preemption, and Batch's scheduling period (jobs start at the moment room frees).

``week_of_bursts`` is a week of three teams' bursty submissions; ``simulate`` runs a workload through
the model; ``plot`` draws each team's running instances, its share of the instance-hours while every
team had work waiting (against its weight), and its waiting times
(docs/img/fair-share-week.png: ``python -m llmtrain.lifecycle.queue_simulation
docs/img/fair-share-week.png``).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmtrain.core import queue_policy as policy

HOUR = 3600.0
WEEK = 7 * 24 * HOUR
BATCH_MINIMUM_DECAY = 600  # Batch's window for shareDecaySeconds 0


@dataclass(frozen=True)
class Job:
    """One submission: which share, when, how many instances for how long, at what priority."""

    team: str
    submitted: float
    instances: int
    seconds: float
    priority: int = 0


@dataclass(frozen=True)
class QueuePolicy:
    """The queue as the environment configures it (``queues:`` and the teams' ``share_weight``)."""

    capacity: int
    share_weights: Mapping[str, int]
    share_decay_seconds: int = 86400
    compute_reservation: int = 0

    @property
    def weight_factors(self) -> dict[str, float]:
        return policy.weight_factors(self.share_weights)

    def reserved(self, active_shares: int) -> float:
        """Instances kept for shares with nothing running while ``active_shares`` run something."""
        if active_shares == 0 or self.compute_reservation == 0:
            return 0.0
        return self.capacity * (self.compute_reservation / 100) ** active_shares


@dataclass
class TeamResult:
    instance_hours: float = 0.0
    # Instance-hours used while every team had jobs waiting (the queue under contention).
    contended_instance_hours: float = 0.0
    waits: list[float] = field(default_factory=list)  # seconds from submission to start, per job
    # The longest time the team had jobs waiting and none of them started.
    longest_unserved: float = 0.0


@dataclass
class SimulationResult:
    policy: QueuePolicy
    teams: dict[str, TeamResult]
    contended_seconds: float
    # (time, {team: instances running}) after every event, for plotting.
    timeline: list[tuple[float, dict[str, int]]]
    unfinished: int

    def contended_shares(self) -> dict[str, float]:
        """Each team's fraction of the instance-hours used while every team had jobs waiting."""
        total = sum(team.contended_instance_hours for team in self.teams.values())
        return {name: team.contended_instance_hours / total for name, team in self.teams.items()}


class _Queue:
    """The model's state: waiting jobs per share, running jobs, decayed usage."""

    def __init__(self, queue_policy: QueuePolicy):
        self.policy = queue_policy
        self.factors = queue_policy.weight_factors
        teams = list(queue_policy.share_weights)
        self.waiting: dict[str, list[tuple[int, float, int, Job]]] = {team: [] for team in teams}
        self.running: dict[str, int] = dict.fromkeys(teams, 0)
        self.usage: dict[str, float] = dict.fromkeys(teams, 0.0)
        self.decay = queue_policy.share_decay_seconds or BATCH_MINIMUM_DECAY
        self._order = 0

    def add(self, job: Job) -> None:
        self._order += 1
        heapq.heappush(self.waiting[job.team], (-job.priority, job.submitted, self._order, job))

    def advance(self, seconds: float) -> None:
        kept = math.exp(-seconds / self.decay)
        for team, used in self.usage.items():
            self.usage[team] = used * kept + self.running[team] * self.decay * (1 - kept)

    def next_job(self) -> Job | None:
        """The next job to start, or None. Shares go in order of usage x factor (lowest first), each
        offering its next job (priority, then age). A job with no room holds everything behind it; a
        job that waits only for the reserve lets the shares running nothing go ahead of it."""
        free = self.policy.capacity - sum(self.running.values())
        reserve = self.policy.reserved(sum(1 for count in self.running.values() if count))
        only_idle_shares = False
        for team in sorted((t for t, jobs in self.waiting.items() if jobs),
                           key=lambda t: (self.usage[t] * self.factors[t], t)):
            job = self.waiting[team][0][3]
            if job.instances > free:
                return None
            if self.running[team]:
                if only_idle_shares or job.instances > free - reserve:
                    only_idle_shares = True
                    continue
            return job
        return None

    def start(self, job: Job) -> None:
        heapq.heappop(self.waiting[job.team])
        self.running[job.team] += job.instances


def simulate(
    queue_policy: QueuePolicy, jobs: Sequence[Job], *, until: float | None = None
) -> SimulationResult:
    """Run ``jobs`` through the model until every job ended (or ``until``)."""
    queue = _Queue(queue_policy)
    teams = {team: TeamResult() for team in queue_policy.share_weights}
    events = [(job.submitted, order, "submit", job) for order, job in enumerate(jobs)]
    heapq.heapify(events)
    now, sequence, contended = 0.0, len(jobs), 0.0
    unserved_since: dict[str, float | None] = dict.fromkeys(teams)
    timeline: list[tuple[float, dict[str, int]]] = [(0.0, dict(queue.running))]
    while events and (until is None or events[0][0] <= until):
        at, _, kind, job = heapq.heappop(events)
        contended += _account(queue, teams, at - now)
        now = at
        if kind == "submit":
            queue.add(job)
        else:
            queue.running[job.team] -= job.instances
        started = _dispatch(queue)
        for begun in started:
            teams[begun.team].waits.append(now - begun.submitted)
            sequence += 1
            heapq.heappush(events, (now + begun.seconds, sequence, "end", begun))
        _track_unserved(queue, teams, unserved_since, now, {job.team for job in started})
        timeline.append((now, dict(queue.running)))
    unfinished = sum(len(waiting) for waiting in queue.waiting.values()) + sum(queue.running.values())
    return SimulationResult(queue_policy, teams, contended, timeline, unfinished)


def _account(queue: _Queue, teams: dict[str, TeamResult], seconds: float) -> float:
    """Charge the time since the last event: usage, instance-hours, and contention (seconds of it)."""
    if seconds <= 0:
        return 0.0
    queue.advance(seconds)
    contended = all(queue.waiting[team] for team in teams)
    for team, result in teams.items():
        hours = queue.running[team] * seconds / HOUR
        result.instance_hours += hours
        if contended:
            result.contended_instance_hours += hours
    return seconds if contended else 0.0


def _dispatch(queue: _Queue) -> list[Job]:
    started = []
    while (job := queue.next_job()) is not None:
        queue.start(job)
        started.append(job)
    return started


def _track_unserved(queue: _Queue, teams: dict[str, TeamResult], since: dict[str, float | None],
                    now: float, started: set[str]) -> None:
    """Per team, the longest time it had jobs waiting and none started (a start restarts the clock)."""
    for team, result in teams.items():
        if since[team] is not None:
            result.longest_unserved = max(result.longest_unserved, now - since[team])
        if not queue.waiting[team]:
            since[team] = None
        elif team in started or since[team] is None:
            since[team] = now


@dataclass(frozen=True)
class BurstProfile:
    """How one team submits over the week: bursts of ``jobs_per_burst`` jobs submitted together at
    random moments, each job of one of ``instances`` for ``hours`` (uniform), until the team has asked
    for ``demand`` of the instance-hours the capacity offers in the week."""

    demand: float
    jobs_per_burst: tuple[int, int] = (3, 10)
    instances: tuple[int, ...] = (1, 2, 4, 8)
    hours: tuple[float, float] = (1.0, 8.0)


def week_of_bursts(profiles: Mapping[str, BurstProfile], *, capacity: int, seed: int = 7) -> list[Job]:
    """A week of bursty submissions, one team per profile (a fifth of the jobs at priority 5)."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    for team, profile in profiles.items():
        wanted, asked = profile.demand * capacity * WEEK, 0.0
        while asked < wanted:
            at = rng.uniform(0, WEEK)
            for _ in range(rng.randint(*profile.jobs_per_burst)):
                job = Job(team=team, submitted=at, instances=rng.choice(profile.instances),
                          seconds=rng.uniform(*profile.hours) * HOUR, priority=5 if rng.random() < 0.2 else 0)
                jobs.append(job)
                asked += job.instances * job.seconds
    return sorted(jobs, key=lambda job: job.submitted)


def plot(result: SimulationResult, path: str | Path) -> Path:
    """Three panels: running instances per team, share of contended instance-hours against weight,
    waiting times. Written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    teams = list(result.policy.share_weights)
    expected = policy.expected_shares(result.policy.share_weights)
    figure, (running, shares, waits) = plt.subplots(3, 1, figsize=(10, 11))
    times = [at / HOUR for at, _ in result.timeline]
    running.stackplot(times, *[[counts[team] for _, counts in result.timeline] for team in teams],
                      labels=[f"{t} (weight {result.policy.share_weights[t]})" for t in teams], step="post")
    running.axhline(result.policy.capacity, color="black", linewidth=0.8, linestyle=":")
    running.axvline(WEEK / HOUR, color="black", linewidth=0.8, linestyle="--")
    running.annotate("last submission", (WEEK / HOUR, result.policy.capacity), fontsize="small",
                     xytext=(4, -12), textcoords="offset points")
    running.set(title="Instances running per team", xlabel="hours", ylabel="instances",
                xlim=(0, max(times)))
    running.legend(loc="upper right", fontsize="small")
    measured = result.contended_shares()
    positions = range(len(teams))
    shares.bar([p - 0.2 for p in positions], [measured[t] for t in teams], width=0.4,
               label="share of instance-hours under contention")
    shares.bar([p + 0.2 for p in positions], [expected[t] for t in teams], width=0.4,
               label="weight / sum of weights", alpha=0.6)
    shares.set_xticks(list(positions), teams)
    contended = result.contended_seconds / HOUR
    shares.set(title=f"Fair share while every team had work waiting ({contended:.0f} h)", ylabel="fraction")
    shares.legend(fontsize="small")
    waits.boxplot([[w / HOUR for w in result.teams[t].waits] for t in teams], tick_labels=teams)
    waits.set(title="Waiting time from submission to start", ylabel="hours")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


# The week the documentation shows: three teams of weights 3, 2 and 1 on prod's 48 instances, each
# asking for more than its share (75%, 50% and 30% of the week's instance-hours: 155% together, so
# the queue is contended most of the week): pretraining in bursts of large, long jobs, fine-tuning in
# bursts of many small ones, research in between.
DEMO_WEIGHTS = {"pretrain": 3, "finetune": 2, "research": 1}
DEMO_PROFILES = {
    "pretrain": BurstProfile(demand=0.75, jobs_per_burst=(2, 6), instances=(4, 8), hours=(2.0, 8.0)),
    "finetune": BurstProfile(demand=0.50, jobs_per_burst=(3, 10), instances=(1, 2), hours=(0.5, 3.0)),
    "research": BurstProfile(demand=0.30, jobs_per_burst=(2, 8), instances=(1, 2, 4), hours=(1.0, 6.0)),
}
DEMO_CAPACITY = 48


def demo_week(seed: int = 7, compute_reservation: int = 10) -> SimulationResult:
    queue_policy = QueuePolicy(capacity=DEMO_CAPACITY, share_weights=DEMO_WEIGHTS, share_decay_seconds=86400,
                               compute_reservation=compute_reservation)
    return simulate(queue_policy, week_of_bursts(DEMO_PROFILES, capacity=DEMO_CAPACITY, seed=seed))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Simulate a week of the fair-share queue and plot it.")
    parser.add_argument("output", help="the PNG to write")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    result = demo_week(args.seed)
    plot(result, args.output)
    for team, share in result.contended_shares().items():
        waits = sorted(result.teams[team].waits)
        print(f"{team}: {share:.3f} of contended instance-hours (weight {DEMO_WEIGHTS[team]}), "
              f"median wait {waits[len(waits) // 2] / HOUR:.1f} h, longest unserved "
              f"{result.teams[team].longest_unserved / HOUR:.1f} h")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
