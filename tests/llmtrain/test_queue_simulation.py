"""The fair-share model of the queues (llmtrain.lifecycle.queue_simulation): a week of three teams' bursty
submissions gives each team its weight's share under contention, within 10%, and starves no team;
and each documented rule of the model (usage over weight, compute reservation, priority within a
share, the head of the queue waiting for room) acts as documented."""

from __future__ import annotations

import pytest

from llmtrain.core import queue_policy as policy
from llmtrain.lifecycle.queue_simulation import (
    DEMO_PROFILES,
    DEMO_WEIGHTS,
    HOUR,
    WEEK,
    Job,
    QueuePolicy,
    demo_week,
    plot,
    simulate,
    week_of_bursts,
)


@pytest.mark.parametrize("seed", [7, 11, 23])
def test_a_contended_week_gives_each_team_its_weight_within_ten_percent_and_starves_none(seed):
    result = demo_week(seed)
    # Every job ran; the queue was contended (every team had work waiting) for most of the week.
    assert result.unfinished == 0
    assert all(len(team.waits) > 50 for team in result.teams.values())
    assert result.contended_seconds > 0.8 * WEEK
    expected = policy.expected_shares(DEMO_WEIGHTS)
    for team, share in result.contended_shares().items():
        assert share == pytest.approx(expected[team], rel=0.10), (team, share, expected[team])
    # No team waited a whole decay window (a day) with work queued and nothing started.
    for team, outcome in result.teams.items():
        assert outcome.longest_unserved < 24 * HOUR, (team, outcome.longest_unserved / HOUR)


def test_the_demo_week_asks_for_more_than_the_capacity_and_each_team_for_more_than_its_share():
    jobs = week_of_bursts(DEMO_PROFILES, capacity=48, seed=7)
    offered = 48 * WEEK
    asked = {team: sum(j.instances * j.seconds for j in jobs if j.team == team) / offered
             for team in DEMO_WEIGHTS}
    expected = policy.expected_shares(DEMO_WEIGHTS)
    assert sum(asked.values()) > 1.5
    assert all(asked[team] > expected[team] for team in DEMO_WEIGHTS), asked
    assert all(0 <= j.submitted < WEEK for j in jobs)


def _policy(**changes) -> QueuePolicy:
    return QueuePolicy(**{"capacity": 8, "share_weights": {"a": 1, "b": 1}, **changes})


def _start_of(result, team: str, index: int = 0) -> float:
    return result.teams[team].waits[index]


def test_the_share_with_least_usage_for_its_weight_goes_first():
    # a ran 8 instances for 4 hours; b and a then each queue a job for the same freed capacity.
    jobs = [Job("a", 0, 8, 4 * HOUR), Job("a", 1, 8, HOUR), Job("b", 2, 8, HOUR)]
    result = simulate(_policy(), jobs)
    assert _start_of(result, "b") == pytest.approx(4 * HOUR - 2)  # b first, though a queued earlier
    assert _start_of(result, "a", 1) == pytest.approx(5 * HOUR - 1)
    # With b's weight a twentieth of a's, a's usage counts for less than b's (none): b still first,
    # but a weight 20 times b's and equal usage would serve a first.
    heavier = simulate(_policy(share_weights={"a": 20, "b": 1}),
                       [Job("a", 0, 8, 60), Job("b", 0, 8, 60), Job("a", 0, 8, 60), Job("b", 1, 8, HOUR),
                        Job("a", 1, 8, HOUR)])
    assert heavier.teams["a"].waits[2] < heavier.teams["b"].waits[1]


def test_usage_is_forgotten_over_the_decay_time():
    # a's heavy use ended a week ago: with a day of decay it no longer counts; with a month it does.
    jobs = [Job("a", 0, 8, 24 * HOUR), Job("b", 8 * 24 * HOUR, 8, HOUR), Job("b", 8 * 24 * HOUR, 8, HOUR),
            Job("a", 8 * 24 * HOUR + 1, 8, HOUR)]
    forgotten = simulate(_policy(share_decay_seconds=86400), [*jobs, Job("b", 8 * 24 * HOUR, 8, HOUR)])
    remembered = simulate(_policy(share_decay_seconds=policy.MAX_SHARE_DECAY_SECONDS * 4), jobs)
    # b ran one hour; after it, a (forgotten) and b (one recent hour) compete: a goes first.
    assert forgotten.teams["a"].waits[1] < forgotten.teams["b"].waits[2]
    assert remembered.teams["b"].waits[1] < remembered.teams["a"].waits[1]


def test_compute_reservation_keeps_room_for_a_team_running_nothing():
    # a and b fill the queue with long jobs; c arrives with a small one.
    filling = [Job(team, 0, 1, 10 * HOUR) for team in ("a", "b") for _ in range(40)]
    newcomer = Job("c", HOUR, 2, HOUR)
    weights = {"a": 1, "b": 1, "c": 1}
    reserved = simulate(QueuePolicy(capacity=48, share_weights=weights, compute_reservation=25),
                        [*filling, newcomer])
    unreserved = simulate(QueuePolicy(capacity=48, share_weights=weights, compute_reservation=0),
                          [*filling, newcomer])
    # 25% reserved with two shares running: 48 x 0.25^2 = 3 instances kept for c, which starts at once.
    assert reserved.teams["c"].waits == [0.0]
    assert unreserved.teams["c"].waits == [pytest.approx(9 * HOUR)]


def test_priority_orders_jobs_within_a_share_and_the_head_waits_for_room():
    jobs = [Job("a", 0, 8, HOUR), Job("a", 1, 2, HOUR, priority=0), Job("a", 2, 2, HOUR, priority=5)]
    result = simulate(_policy(share_weights={"a": 1}), jobs)
    waits = result.teams["a"].waits  # in start order: the first job, then priority 5, then 0
    assert waits == [0.0, pytest.approx(HOUR - 2), pytest.approx(HOUR - 1)]
    # A job too large for the free instances holds the ones behind it (nothing jumps the head).
    held = simulate(_policy(share_weights={"a": 1, "b": 1}),
                    [Job("a", 0, 6, HOUR), Job("b", 1, 4, HOUR), Job("a", 2, 1, HOUR)])
    assert held.teams["b"].waits == [pytest.approx(HOUR - 1)]
    assert held.teams["a"].waits[1] == pytest.approx(HOUR - 2)


def test_the_plot_shows_the_week(tmp_path):
    written = plot(demo_week(7), tmp_path / "week.png")
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and written.stat().st_size > 20_000
