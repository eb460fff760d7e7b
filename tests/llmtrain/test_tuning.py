"""`llmtrain tune`'s search and its SageMaker request (llmtrain.core.tuning): ranges parsed and checked
against the template's bounds and metrics, the CreateHyperParameterTuningJob request built from the
rendered run and valid against botocore's model, the budget of a tune, and the tuned values as
SageMaker passes them (plain strings) read by the training program's config."""

from __future__ import annotations

import json

import pytest
from deployed_support import platform_context

from llmtrain.core.catalog import Catalog
from llmtrain.core.errors import OverrideError, RequestValidationError
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.tuning import (
    ParamRange,
    Trial,
    TuneError,
    TuneSpec,
    best_so_far,
    best_trial,
    check_tune,
    check_tune_budget,
    check_tune_program,
    full_run_command,
    start_command,
)
from llmtrain.core.tuning_request import tuning_problems_for_request, tuning_request, validate_tuning_request
from llmtrain.core.validate import input_problems

CATALOG = Catalog.load()
FSDP = CATALOG.resolve("llama-pretrain-fsdp")
VALIDATION = platform_context().datasets_uri + "tiny/validation/"


def spec(*params: str, **kwargs) -> TuneSpec:
    return TuneSpec(
        params=tuple(ParamRange.parse(p) for p in params),
        objective=kwargs.pop("objective", "eval:loss"),
        **kwargs,
    )


def rendered(platform=None, **overrides):
    platform = platform or platform_context()
    return render(
        FSDP, RunInput(run_name="lr-1", overrides={"channels.validation": VALIDATION, **overrides}), platform
    )


def test_params_parse_ranges_log_scales_integers_and_lists():
    assert ParamRange.parse("lr=1e-5..1e-3:log") == ParamRange("lr", "continuous", 1e-5, 1e-3, log=True)
    assert ParamRange.parse("warmup_steps=10..200:int") == ParamRange("warmup_steps", "integer", 10, 200)
    assert ParamRange.parse("attention=sdpa,eager") == ParamRange(
        "attention", "categorical", values=("sdpa", "eager")
    )
    for bad, says in [
        ("lr", "write"),
        ("lr=1e-3..1e-5", "LOW must be below HIGH"),
        ("lr=0..1:log", "above 0"),
        ("lr=sdpa", "two or more values"),
        ("lr=1..2:cube", "unknown flag"),
        ("warmup_steps=1.5..3:int", "integers"),
    ]:
        with pytest.raises(TuneError, match=says):
            ParamRange.parse(bad)


def test_a_range_outside_the_templates_bounds_is_refused_naming_the_bound():
    with pytest.raises(OverrideError, match=r"'lr'.*above the maximum 0\.01"):
        check_tune(FSDP, spec("lr=1e-5..1e-1:log"), {})
    with pytest.raises(OverrideError, match=r"'warmup_steps'.*below the minimum 0"):
        check_tune(FSDP, spec("warmup_steps=-5..200:int"), {})
    with pytest.raises(OverrideError, match=r"seq_len.*not allowed; allowed: int one of 512"):
        check_tune(FSDP, spec("seq_len=512,777"), {})
    with pytest.raises(OverrideError, match="integer setting: write its range with :int"):
        check_tune(FSDP, spec("warmup_steps=10..200"), {})
    with pytest.raises(OverrideError, match="does not let a run set it.*did you mean 'lr_decay_steps'"):
        check_tune(FSDP, spec("lr_decay_step=1..2:int"), {})
    with pytest.raises(OverrideError, match="not a hyperparameter"):
        check_tune(FSDP, spec("instance_count=1..4:int"), {})
    with pytest.raises(TuneError, match="tuned with --param and set with --set"):
        check_tune(FSDP, spec("lr=1e-5..1e-3:log"), {"lr": "0.001"})
    check_tune(
        FSDP, spec("lr=1e-5..1e-3:log", "warmup_steps=10..200:int", "activation_checkpointing=none,full"), {}
    )


def test_a_range_the_training_program_refuses_at_an_end_is_refused_with_its_message():
    """Within the template's bounds is not enough: each end must pass the contract of the code the
    version runs (the 1.2.0 archive's here), with the run's other settings."""
    program, platform = CATALOG.program_contract(FSDP), platform_context()
    run = RunInput(run_name="lr-1", overrides={"max_steps": "100"})
    # The template's min_lr is 3e-5: the program refuses an lr below it (here at the first trial).
    below_min_lr = r"first trial \(lr=1e-05\): .* 'min_lr': got 3e-05, expected a value <= lr"
    with pytest.raises(TuneError, match=below_min_lr):
        check_tune_program(FSDP, spec("lr=1e-5..1e-3:log"), run, platform, program)
    # The template allows warm-up to 100000 steps; the program, to the decay horizon (lr_decay_steps).
    horizon = RunInput(run_name="w", overrides={"max_steps": "100", "lr_decay_steps": "150"})
    too_long = r"--param warmup_steps=10\.\.200:int: warmup_steps=200: .*decay horizon"
    with pytest.raises(TuneError, match=too_long):
        check_tune_program(FSDP, spec("lr=5e-5..1e-3:log", "warmup_steps=10..200:int"), horizon, platform,
                           program)
    within = spec("lr=5e-5..1e-3:log", "warmup_steps=10..100:int")
    check_tune_program(FSDP, within, horizon, platform, program)


def test_the_objective_is_one_of_the_templates_metrics():
    with pytest.raises(TuneError, match=r"'eval:los' is not one of .*\(did you mean 'eval:loss'\?\)"):
        check_tune(FSDP, spec("lr=1e-5..1e-3:log", objective="eval:los"), {})
    with pytest.raises(TuneError, match="channels.validation"):
        problems = tuning_problems_for_request(
            spec("lr=1e-5..1e-3:log"), render(FSDP, RunInput(run_name="r"), platform_context())
        )
        raise TuneError(problems[0])


def test_the_tuning_request_is_the_rendered_run_with_the_search_and_botocore_accepts_it():
    platform = platform_context()
    training = rendered(platform)
    tune = spec(
        "lr=1e-5..1e-3:log",
        "warmup_steps=10..200:int",
        "activation_checkpointing=none,full",
        trials=20,
        parallel=4,
        seed=7,
    )
    request = tuning_request(tune, training, platform, run_name="lr-1")
    assert input_problems("sagemaker", "CreateHyperParameterTuningJob", request) == []
    config = request["HyperParameterTuningJobConfig"]
    assert config["Strategy"] == "Bayesian" and config["TrainingJobEarlyStoppingType"] == "Auto"
    assert config["HyperParameterTuningJobObjective"] == {"Type": "Minimize", "MetricName": "eval:loss"}
    assert config["ResourceLimits"] == {"MaxNumberOfTrainingJobs": 20, "MaxParallelTrainingJobs": 4}
    assert config["RandomSeed"] == 7
    assert config["ParameterRanges"] == {
        "ContinuousParameterRanges": [
            {"Name": "lr", "MinValue": "1e-05", "MaxValue": "0.001", "ScalingType": "Logarithmic"}
        ],
        "IntegerParameterRanges": [
            {"Name": "warmup_steps", "MinValue": "10", "MaxValue": "200", "ScalingType": "Linear"}
        ],
        "CategoricalParameterRanges": [{"Name": "activation_checkpointing", "Values": ["none", "full"]}],
    }
    definition = request["TrainingJobDefinition"]
    # Everything a run gets: role, VPC, KMS keys, channels, image, metric definitions, encryption.
    for field in (
        "RoleArn",
        "VpcConfig",
        "OutputDataConfig",
        "InputDataConfig",
        "StoppingCondition",
        "EnableInterContainerTrafficEncryption",
        "EnableManagedSpotTraining",
        "RetryStrategy",
    ):
        assert definition[field] == training[field], field
    assert (
        definition["AlgorithmSpecification"]["MetricDefinitions"]
        == training["AlgorithmSpecification"]["MetricDefinitions"]
    )
    # Warm pools are not for tuning jobs; the rest of the resources as rendered.
    assert definition["ResourceConfig"] == {
        k: v for k, v in training["ResourceConfig"].items() if k != "KeepAlivePeriodInSeconds"
    }
    # Trials would share one checkpoint prefix and resume from each other.
    assert "CheckpointConfig" not in definition
    static = definition["StaticHyperParameters"]
    assert not {"lr", "warmup_steps", "activation_checkpointing"} & set(static)
    assert static["max_steps"] == training["HyperParameters"]["max_steps"]
    assert request["HyperParameterTuningJobName"] == f"{platform.job_name_prefix}-lr-1-t1"
    assert {"Key": "llmtrain:team", "Value": platform.team} in request["Tags"]
    assert "WarmStartConfig" not in request


def test_hyperband_warm_start_and_maximize():
    platform = platform_context()
    tune = spec("lr=1e-5..1e-3:log", strategy="hyperband", maximize=True, objective="train:tokens_per_sec")
    request = tuning_request(
        tune,
        rendered(platform, eval_every_steps="1000"),
        platform,
        run_name="hb",
        parent_tuning_jobs=["llmtrain-dev-default-lr-1-t1"],
    )
    config = request["HyperParameterTuningJobConfig"]
    assert config["Strategy"] == "Hyperband" and config["TrainingJobEarlyStoppingType"] == "Off"
    # One report of a training metric per logging step: 20000 steps / every 10.
    assert config["StrategyConfig"] == {"HyperbandStrategyConfig": {"MinResource": 1, "MaxResource": 2000}}
    assert config["HyperParameterTuningJobObjective"]["Type"] == "Maximize"
    assert request["WarmStartConfig"] == {
        "ParentHyperParameterTuningJobs": [{"HyperParameterTuningJobName": "llmtrain-dev-default-lr-1-t1"}],
        "WarmStartType": "IdenticalDataAndAlgorithm",
    }
    assert input_problems("sagemaker", "CreateHyperParameterTuningJob", request) == []


def test_a_run_name_too_long_for_a_tuning_job_name_is_refused():
    with pytest.raises(TuneError, match="at most 32"):
        tuning_request(
            spec("lr=1e-5..1e-3:log"),
            rendered(),
            platform_context(),
            run_name="a-run-name-far-too-long-for-it",
        )


def test_botocore_catches_what_it_would_refuse():
    platform = platform_context()
    request = tuning_request(spec("lr=1e-5..1e-3:log"), rendered(platform), platform, run_name="lr-1")
    request["HyperParameterTuningJobConfig"]["Strategy"] = "Grid-ish"
    request["TrainingJobDefinition"]["StaticHyperParameters"]["x"] = "y" * 3000
    with pytest.raises(RequestValidationError) as refused:
        validate_tuning_request(request, platform)
    text = str(refused.value)
    assert "Strategy" in text and "StaticHyperParameters" in text


def test_the_budget_is_one_trials_cost_times_the_trials():
    tune = spec("lr=1e-5..1e-3:log", trials=10)
    plan = {"usd": 120.0, "summary": "fits"}
    assert check_tune_budget(plan, tune, budget_usd=1200, team="nlp")["usd"] == 1200
    with pytest.raises(TuneError, match=r"up to \$1,200 \(10 trials x \$120 per trial.*budget of \$1,000"):
        check_tune_budget(plan, tune, budget_usd=1000, team="nlp")


def test_tune_spec_round_trips_and_refuses_nonsense():
    tune = spec("lr=1e-5..1e-3:log", "attention=sdpa,eager", trials=9, parallel=3, warm_start_from=("a",))
    assert TuneSpec.from_dict(json.loads(json.dumps(tune.to_dict()))) == tune
    for bad, says in [
        ({"params": [], "objective": "x"}, "at least one"),
        ({**tune.to_dict(), "parallel": 10}, "--parallel"),
        ({**tune.to_dict(), "strategy": "grid"}, "--strategy"),
        ({**tune.to_dict(), "bogus": 1}, "unknown field"),
    ]:
        with pytest.raises(TuneError, match=says):
            TuneSpec.from_dict(bad)


def test_best_trial_and_the_start_line():
    trials = [
        Trial(0, {"lr": 1e-4}, 3.0, "Completed"),
        Trial(1, {"lr": 1e-3}, 2.0, "Pruned"),
        Trial(2, {"lr": 3e-3}, 2.5, "Completed"),
        Trial(3, {"lr": 5e-3}, None, "Failed"),
    ]
    assert best_trial(trials, maximize=False).number == 2
    assert best_trial(trials, maximize=True).number == 0
    assert best_so_far(trials, maximize=False) == [3.0, 3.0, 2.5, 2.5]
    assert (
        start_command("gpt2-ddp@1.2.0", "r-best", {"max_steps": "100"}, {"lr": 0.0030000001})
        == "llmtrain start gpt2-ddp@1.2.0 --run-name r-best --set max_steps=100 --set lr=0.003"
    )


def test_a_local_tunes_full_run_line_leaves_out_the_trials_length_and_hosts():
    """Issue 36 item 8: the trials ran shortened (`--set max_steps=12 instance_count=1`); the full run's
    command keeps the tune's other overrides and the best values, not the trial-only ones."""
    settings = {"instance_count": "1", "max_steps": "12", "grad_accum_steps": "1", "eval_every_steps": "4"}
    command, dropped = full_run_command("gpt2-ddp@1.2.0", "lr-best", settings, {"lr": 0.002})
    assert command == (
        "llmtrain start gpt2-ddp@1.2.0 --run-name lr-best --set grad_accum_steps=1 --set lr=0.002"
    )
    assert dropped == {"instance_count": "1", "max_steps": "12", "eval_every_steps": "4"}
    # A tuned value is the best trial's, never left out.
    command, dropped = full_run_command("gpt2-ddp@1.2.0", "s-best", {"max_steps": "12"}, {"max_steps": 40})
    assert command.endswith("--set max_steps=40") and dropped == {}


def test_the_program_reads_the_plain_strings_sagemaker_tuning_passes():
    """SageMaker writes tuned values into hyperparameters.json as plain strings beside the JSON-encoded
    static ones; the toolkit decodes what is JSON, and the program's config coerces the rest."""
    from sagemaker_training import environment as toolkit

    from training_jobs.contract import from_hyperparameters

    static = {k: v for k, v in rendered()["HyperParameters"].items() if not k.startswith("sagemaker_")}
    tuned = {"lr": "0.0001", "warmup_steps": "50", "activation_checkpointing": "none"}
    decoded = {}
    for key, raw in {**static, **tuned}.items():
        try:
            decoded[key] = json.loads(raw)
        except ValueError:
            decoded[key] = raw
    assert toolkit.read_hyperparameters.__doc__  # the toolkit decodes exactly this way (json.loads, else raw)
    config = from_hyperparameters(decoded)
    assert config.optim.lr == 1e-4 and config.optim.warmup_steps == 50
    assert config.parallel.activation_checkpointing == "none"
