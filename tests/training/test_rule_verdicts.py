"""The rules' arithmetic (trainer/rules.py), their settings' validation, and the test-only fault
injection: no torchrun here (tests/training/test_rules.py injects each fault into real runs)."""

from __future__ import annotations

import json
import re

import pytest

from training_jobs.contract.hyperparameters import ConfigError, RulesConfig, from_hyperparameters
from training_jobs.trainer.errors import RuleTriggered
from training_jobs.trainer.faults import ENVIRONMENT_VARIABLE, Faults
from training_jobs.trainer.rules import MIN_HISTORY, Rules, process_group_timeout_minutes


def _rules(**settings) -> Rules:
    return Rules(RulesConfig(**{"rule_warmup_steps": 0, **settings}))


def _feed(rules: Rules, losses, grad_norm: float = 1.0, first: int = 1) -> list:
    verdicts = []
    for offset, loss in enumerate(losses):
        verdicts += rules.judge_step(first + offset, loss, grad_norm)
    return verdicts


def test_a_spike_is_judged_against_the_mean_of_the_healthy_steps_and_kept_out_of_it():
    rules = _rules(rule_loss_spike_factor=2.0, rule_loss_spike_action="rollback")
    assert _feed(rules, [3.0, 3.2, 2.8, 3.0, 3.0]) == []
    [verdict] = _feed(rules, [7.0], first=6)
    assert (verdict.rule, verdict.step, verdict.action) == ("loss_spike", 6, "rollback")
    assert verdict.baseline == pytest.approx(3.0) and verdict.threshold == pytest.approx(6.0)
    assert verdict.describe() == ("loss_spike at step 6: loss 7 is above 2 x its running mean 3 "
                                  "(action rollback)")
    assert rules.take_pending() == verdict and rules.take_pending() is None
    [again] = _feed(rules, [7.0], first=7)  # the spike did not raise the mean
    assert again.baseline == pytest.approx(3.0)
    assert _feed(rules, [5.9], first=8) == []


def test_a_falling_loss_never_fires_and_nothing_is_judged_before_the_history_is_there():
    rules = _rules(rule_loss_spike_factor=1.1)
    assert _feed(rules, [100.0] * (MIN_HISTORY - 1) + [1000.0]) == []  # the 5th joins the history
    assert _feed(rules, [10.0 - step * 0.5 for step in range(15)], first=MIN_HISTORY + 1) == []


def test_the_warm_up_steps_are_neither_judged_nor_counted():
    rules = _rules(rule_warmup_steps=3)
    assert _feed(rules, [1000.0, 1.0, 1.0]) == []  # a spike in the warm-up is nobody's business
    assert list(rules.loss.statistic.values) == []
    _feed(rules, [2.0] * MIN_HISTORY, first=4)
    assert rules.loss.statistic.value() == pytest.approx(2.0)


def test_the_gradient_norm_is_judged_against_the_median():
    rules = _rules(rule_grad_norm_action="stop")
    for step, norm in enumerate([1.0, 1.1, 0.9, 50.0, 1.0], start=1):  # 50 is under 10 x median 1
        assert rules.judge_step(step, 3.0, norm) == []
    [verdict] = rules.judge_step(6, 3.0, 10.5)
    assert (verdict.rule, verdict.baseline) == ("grad_norm_explosion", pytest.approx(1.0))
    assert rules.pending == verdict


def test_a_throughput_drop_is_judged_per_window_after_the_warm_up():
    rules = _rules(rule_warmup_steps=4, rule_throughput_action="stop", rule_throughput_fraction=0.5)
    _feed(rules, [3.0] * 6)
    assert rules.judge_window(6, steps=3, tokens_per_sec=1.0) == []  # began in the warm-up
    for window in range(MIN_HISTORY):
        _feed(rules, [3.0] * 2, first=7 + 2 * window)
        assert rules.judge_window(8 + 2 * window, steps=2, tokens_per_sec=1000.0 + window) == []
    _feed(rules, [3.0] * 2, first=17)
    # beside a background checkpoint write: neither judged nor counted in the median
    assert rules.judge_window(18, steps=2, tokens_per_sec=1.0, measured_alone=False) == []
    assert rules.pending is None
    [verdict] = rules.judge_window(18, steps=2, tokens_per_sec=400.0)
    assert verdict.describe() == ("throughput_drop at step 18: tokens/s 400 is below 0.5 x its running "
                                  "median 1002 (action stop)")


def test_the_most_severe_action_of_a_step_is_carried_out():
    rules = _rules(rule_loss_spike_action="rollback", rule_grad_norm_action="stop")
    _feed(rules, [3.0] * MIN_HISTORY)
    verdicts = rules.judge_step(6, 30.0, 100.0)
    assert [v.action for v in verdicts] == ["rollback", "stop"]
    assert rules.take_pending().action == "stop"


def test_log_and_skip_wait_for_nothing_and_off_never_fires():
    rules = _rules(rule_loss_spike_action="skip", rule_grad_norm_action="off")
    assert rules.judges_before_update
    _feed(rules, [3.0] * MIN_HISTORY)
    [verdict] = rules.judge_step(6, 30.0, 1e9)
    assert verdict.action == "skip" and rules.pending is None
    assert not _rules().judges_before_update  # the defaults judge at the logging step: no sync


def test_non_finite_values_are_left_to_the_divergence_check():
    rules = _rules()
    _feed(rules, [3.0] * MIN_HISTORY)
    assert rules.judge_step(6, float("nan"), float("inf")) == []
    assert len(rules.loss.statistic.values) == MIN_HISTORY


def test_rollbacks_in_a_row_are_capped_until_a_checkpoint_is_written():
    rules = _rules(rule_max_rollbacks=2)
    rules.rolled_back()
    rules.rolled_back()
    assert not rules.may_roll_back
    rules.checkpoint_written()
    assert rules.may_roll_back


def test_the_collectives_time_out_after_the_hang_watchdog():
    assert process_group_timeout_minutes(RulesConfig()) == 30.0
    assert process_group_timeout_minutes(RulesConfig(rule_hang_minutes=45.0)) == 55.0


def test_the_defaults_are_on_and_every_rule_can_be_turned_off():
    config = from_hyperparameters({"model_preset": "llama-tiny"}).rules
    assert (config.rule_loss_spike_action, config.rule_grad_norm_action,
            config.rule_throughput_action, config.rule_hang_minutes) == ("rollback", "log", "log", 20.0)
    off = from_hyperparameters({"model_preset": "llama-tiny", "rule_loss_spike_action": "off",
                                "rule_grad_norm_action": "off", "rule_throughput_action": "off",
                                "rule_hang_minutes": 0}).rules
    assert off.rule_hang_minutes == 0.0


@pytest.mark.parametrize(("settings", "message"), [
    ({"rule_throughput_action": "skip"},
     "invalid hyperparameter 'rule_throughput_action': got 'skip', expected off, log or stop (a slow "
     "step is neither its batch's fault"),
    ({"rule_throughput_action": "rollback"}, "invalid hyperparameter 'rule_throughput_action'"),
    ({"parallelism": "deepspeed", "rule_loss_spike_action": "skip"},
     "invalid hyperparameter 'rule_loss_spike_action': got 'skip', expected off, log, rollback or stop "
     "with parallelism=deepspeed"),
    ({"parallelism": "deepspeed", "rule_grad_norm_action": "skip"},
     "invalid hyperparameter 'rule_grad_norm_action'"),
    ({"rule_loss_spike_action": "restart"},
     "invalid hyperparameter 'rule_loss_spike_action': got 'restart', expected one of off, log, skip, "
     "rollback, stop"),
    ({"rule_loss_spike_factor": 1.0}, "invalid hyperparameter 'rule_loss_spike_factor': got 1.0, "
                                      "expected a value > 1.0"),
    ({"rule_throughput_fraction": 1.5}, "invalid hyperparameter 'rule_throughput_fraction'"),
    ({"rule_hang_minutes": -1}, "invalid hyperparameter 'rule_hang_minutes'"),
    ({"rule_window": 2}, "invalid hyperparameter 'rule_window': got 2, expected a value >= 5"),
])
def test_rule_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_hyperparameters({"model_preset": "llama-tiny", **settings})


def test_a_rule_stop_becomes_the_jobs_failure_reason(tmp_path, monkeypatch, capsys):
    from training_jobs import train

    monkeypatch.setenv("SM_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    train._report(RuleTriggered("loss_spike at step 12: loss 55.9 is above 3 x its running mean 6.1"))
    reason = (tmp_path / "failure").read_text()
    assert reason == "RuleTriggered: loss_spike at step 12: loss 55.9 is above 3 x its running mean 6.1"
    assert capsys.readouterr().err == ""  # every rank stops alike: local rank 0 of each host says it


def test_fault_injection_is_off_without_its_variable_and_refuses_unknown_faults():
    faults = Faults.from_environment({})
    loss_fn = object()
    assert faults.loss(10, 0, loss_fn) is loss_fn
    with pytest.raises(ValueError, match="unknown fault"):
        Faults.from_environment({ENVIRONMENT_VARIABLE: json.dumps({"meteor": {}})})


def test_a_once_fault_fires_once_and_a_loss_fault_keeps_the_gradient():
    import torch

    faults = Faults.from_environment({ENVIRONMENT_VARIABLE: json.dumps(
        {"loss_spike": {"steps": [3], "add": 5.0, "ranks": [1], "once": True},
         "grad_explosion": {"steps": [4], "factor": 10.0}})})
    weight = torch.tensor(2.0, requires_grad=True)

    def loss_fn(logits, targets):
        return weight * 3.0

    assert faults.loss(3, 0, loss_fn) is loss_fn  # another rank
    spiked = faults.loss(3, 1, loss_fn)(None, None)
    spiked.backward()
    assert spiked.item() == 11.0 and weight.grad.item() == 3.0
    assert faults.loss(3, 1, loss_fn) is loss_fn  # once
    weight.grad = None
    exploded = faults.loss(4, 0, loss_fn)(None, None)
    exploded.backward()
    assert exploded.item() == 6.0 and weight.grad.item() == 30.0


def test_no_templates_metric_definition_matches_a_rule_line(tmp_path, capsys):
    """A [rule] line is not a metric: SageMaker (and the local runner) must not read one as a loss."""
    from llmtrain.core.catalog import Catalog
    from training_jobs.trainer.metrics import MetricsLogger

    rules = _rules(rule_loss_spike_action="rollback")
    _feed(rules, [3.0] * MIN_HISTORY)
    [verdict] = rules.judge_step(6, 30.0, 1.0)
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    logger.rule(verdict.record())
    logger.rule({"step": 6, "rule": verdict.rule, "rolled_back_to": 4, "checkpoint": "/x/step_00000004"})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("[rule] step=6 rule=loss_spike action=rollback value=30 threshold=9 baseline=3")
    regexes = {metric.regex for template in Catalog.load().all() for metric in template.metrics}
    assert regexes and not [(regex, line) for regex in regexes for line in lines if re.search(regex, line)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["kind"] for record in records] == ["rule", "rule"]
