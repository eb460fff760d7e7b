"""The launcher state machine, executed: the synthesized definition runs in moto.

The definition is the one CloudFormation would deploy: the `dev` stage is synthesized (as app.py
does, for moto's account), and the launcher stack's `DefinitionString` is resolved with its
references (tests/llmtrain/launcher_harness.py). moto's Step Functions interpreter executes it; the
Lambda handlers are the real ones, with the environment and template registry of the synthesized
functions; SageMaker, the functions' AWS calls and SNS are moto.

Supplied in test code (moto has neither; see launcher_harness.py): Lambda execution (moto needs
Docker, so the handlers are called in-process as the Lambda runtime would) and the
`sagemaker:createTrainingJob.sync` integration (CreateTrainingJob into moto, then each job ends as
the test scripts it). Wait states record their seconds instead of sleeping.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import aws_cdk as cdk
import pytest
from launcher_harness import ACCOUNT, CloudFormationResolver, JobOutcome, launcher_in_moto

from llmtrain.core.catalog import Catalog
from llmtrain.core.environments import load_environment
from llmtrain.core.platform import PlatformContext
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from stacks.platform import PlatformStage

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "llmtrain-dev-default"  # the job-name prefix of dev's one team, `default`


def _synthesize(tmp_path_factory, config):
    outdir = tmp_path_factory.mktemp("cdk.out")
    app = cdk.App(outdir=str(outdir))
    stage = PlatformStage(app, config=config)
    assembly = app.synth().get_nested_assembly(stage.artifact_id)
    templates = {stack.stack_name: stack.template for stack in assembly.stacks}
    return Path(assembly.directory), stage.launcher.stack_name, templates


def _dev_config():
    return dataclasses.replace(load_environment(ROOT / "config" / "dev.yaml"), account=ACCOUNT)


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    """The dev stage, synthesized once for this module: its assembly folder and templates by stack."""
    return _synthesize(tmp_path_factory, _dev_config())


@pytest.fixture
def launcher(synthesized):
    assembly_dir, launcher_stack, templates = synthesized

    def start(outcomes):
        return launcher_in_moto(assembly_dir, launcher_stack, templates, outcomes)

    return start


def _platform(harness) -> PlatformContext:
    """The platform context the deployed functions receive (from the synthesized template)."""
    function = next(iter(harness.launcher.functions.values()))
    return PlatformContext.from_dict(json.loads(function.environment["LLMTRAIN_PLATFORM_CONTEXT"]))


def _sent(harness, field: str) -> list:
    return [request[field] for request in harness.jobs.requests]


def _instance_types(harness) -> list[str]:
    return [request["ResourceConfig"]["InstanceType"] for request in harness.jobs.requests]


def _states_entered(run) -> list[str]:
    return [
        event["stateEnteredEventDetails"]["name"]
        for event in run.history
        if "stateEnteredEventDetails" in event
    ]


def test_happy_path_passes_every_rendered_field_and_summarizes_the_run(launcher):
    with launcher(
        [JobOutcome(metrics={"train:loss": 1.875, "eval:loss": 2.0}, billable_seconds=7200)]
    ) as harness:
        run = harness.run(
            {
                "template": "llama-pretrain-fsdp",
                "version": "1.0.0",
                "run_name": "happy",
                "overrides": {"max_steps": 100, "instance_count": 4},
            }
        )
        notifications = harness.notifications()
        platform = _platform(harness)

    assert run.status == "SUCCEEDED", run.cause
    # CreateTrainingJob received exactly the request render() produces: every field passed through.
    template = Catalog.load().get("llama-pretrain-fsdp", "1.0.0")
    expected = render(
        template,
        RunInput(run_name="happy", overrides={"max_steps": 100, "instance_count": 4}, owner="launcher"),
        platform,
    )
    assert harness.jobs.requests == [expected]
    request = harness.jobs.requests[0]
    assert request["TrainingJobName"] == f"{PREFIX}-happy-a1"
    assert request["ResourceConfig"]["InstanceCount"] == 4
    assert {"KeepAlivePeriodInSeconds"} <= set(request["ResourceConfig"])
    assert {"CheckpointConfig", "RetryStrategy", "EnableManagedSpotTraining"} <= set(request)
    assert json.loads(request["HyperParameters"]["max_steps"]) == 100

    summary = run.output
    assert summary["status"] == "Completed"
    assert summary["job_name"] == f"{PREFIX}-happy-a1"
    assert summary["final_metrics"] == {"train:loss": 1.875, "eval:loss": 2.0}
    assert summary["model_artifacts"] == (
        f"s3://{platform.artifacts_bucket}/teams/default/llama-pretrain-fsdp/happy/{PREFIX}-happy-a1/output/model.tar.gz"
    )
    assert summary["billable_seconds"] == 7200
    assert summary["attempts"] == 1
    assert summary["template"] == "llama-pretrain-fsdp@1.0.0"

    # The notification carries the same summary.
    assert len(notifications) == 1
    note = notifications[0]
    assert note["Subject"] == "llmtrain: run happy Completed"
    assert note["MessageAttributes"]["status"]["Value"] == "Completed"
    for fact in (
        f"{PREFIX}-happy-a1",
        "train:loss=1.875",
        "eval:loss=2",
        summary["model_artifacts"],
        "Billable seconds: 7200",
        "Attempts: 1",
        "Completed",
    ):
        assert fact in note["Message"]
    assert harness.waits == []


def test_bad_input_fails_before_any_training_job_with_what_to_fix(launcher):
    bad_inputs = {
        "unknown-template": (
            {"template": "no-such-template", "run_name": "r1"},
            # The team's templates are its launcher's registry: the message lists them.
            ["team 'default': template 'no-such-template' is not one of its templates", "llama-pretrain-fsdp",
             "teams.default.templates"],
        ),
        "disallowed-override": (
            {"template": "gpt2-ddp", "run_name": "r2", "overrides": {"parallelism": "fsdp"}},
            ["override 'parallelism'", "does not allow", "max_steps"],
        ),
        "out-of-range": (
            {"template": "gpt2-ddp", "run_name": "r3", "overrides": {"max_steps": 0}},
            ["override 'max_steps'", "below the minimum"],
        ),
        "missing-run-name": ({"template": "gpt2-ddp"}, ["'run_name' is required"]),
        "unknown-field": (
            {"template": "gpt2-ddp", "run_name": "r5", "overridez": {}},
            ["unknown input field", "overridez"],
        ),
        "unknown-version": (
            {"template": "gpt2-ddp", "version": "9.9.9", "run_name": "r6"},
            ["has no version '9.9.9'", "1.0.0"],
        ),
    }
    with launcher([]) as harness:
        runs = {
            name: harness.run(execution_input, name=name) for name, (execution_input, _) in bad_inputs.items()
        }
        notifications = harness.notifications()

    assert harness.jobs.requests == []  # no CreateTrainingJob call at all
    for name, (_, fragments) in bad_inputs.items():
        run = runs[name]
        assert run.status == "FAILED", name
        assert run.error == "InvalidRunInput", (name, run.error, run.cause)
        for fragment in fragments:
            assert fragment in run.cause, (name, fragment, run.cause)
        assert not any(state.startswith("CreateTrainingJob") for state in _states_entered(run))
    # The subject names the run (the input's run_name, else the execution's name).
    assert sorted(n["Subject"] for n in notifications) == sorted(
        f"llmtrain: run {execution_input.get('run_name', name)} rejected"
        for name, (execution_input, _) in bad_inputs.items()
    )
    assert all(n["MessageAttributes"]["status"]["Value"] == "Rejected" for n in notifications)


def test_capacity_error_then_success_retries_with_a_new_name_and_the_same_checkpoints(launcher):
    with launcher([JobOutcome.capacity_error(), JobOutcome()]) as harness:
        run = harness.run({"template": "llama-pretrain-fsdp", "run_name": "busy"})

    assert run.status == "SUCCEEDED", run.cause
    assert _sent(harness, "TrainingJobName") == [f"{PREFIX}-busy-a1", f"{PREFIX}-busy-a2"]
    checkpoints = {request["CheckpointConfig"]["S3Uri"] for request in harness.jobs.requests}
    assert len(checkpoints) == 1 and checkpoints.pop().endswith("/teams/default/llama-pretrain-fsdp/busy/")
    assert _instance_types(harness) == ["ml.p4d.24xlarge", "ml.p4d.24xlarge"]
    assert harness.waits == [600]  # the template's backoff_seconds before the first retry
    assert run.output["attempts"] == 2
    assert [a["outcome"] for a in run.output["attempt_history"]] == ["capacity", "Completed"]
    assert "CapacityError" in run.output["attempt_history"][0]["reason"]


def test_capacity_retries_exhausted_move_to_the_fallback_instance_type(launcher):
    # gpt2-ddp: 3 capacity retries per type, backoff 120 s doubling, fallback ml.g5.24xlarge.
    with launcher([JobOutcome.capacity_error()] * 4 + [JobOutcome()]) as harness:
        run = harness.run({"template": "gpt2-ddp", "run_name": "fallback"})

    assert run.status == "SUCCEEDED", run.cause
    assert _instance_types(harness) == ["ml.g5.12xlarge"] * 4 + ["ml.g5.24xlarge"]
    assert harness.waits == [120, 240, 480, 0]
    assert _sent(harness, "TrainingJobName") == [f"{PREFIX}-fallback-a{n}" for n in range(1, 6)]
    assert len({request["CheckpointConfig"]["S3Uri"] for request in harness.jobs.requests}) == 1
    assert run.output["instance_type"] == "ml.g5.24xlarge"


def test_capacity_exhausted_on_every_type_fails_with_what_was_tried(launcher):
    with launcher([JobOutcome.capacity_error()] * 8) as harness:
        run = harness.run({"template": "gpt2-ddp", "run_name": "nocapacity"})
        notifications = harness.notifications()

    assert run.status == "FAILED"
    assert run.error == "CapacityUnavailable"
    assert _instance_types(harness) == ["ml.g5.12xlarge"] * 4 + ["ml.g5.24xlarge"] * 4
    assert harness.waits == [120, 240, 480, 0, 120, 240, 480]
    assert "ml.g5.12xlarge, ml.g5.24xlarge" in run.cause and "Attempts: 8" in run.cause
    assert notifications[0]["Subject"] == "llmtrain: run nocapacity Failed (CapacityUnavailable)"


def test_quota_error_fails_fast_naming_the_quota_and_its_numbers(launcher):
    quota = JobOutcome.quota_error("ml.p4d.24xlarge for training job usage", limit=2, in_use=2, requested=2)
    with launcher([quota]) as harness:
        run = harness.run({"template": "llama-pretrain-fsdp", "run_name": "quota"})
        notifications = harness.notifications()

    assert run.status == "FAILED"
    assert run.error == "QuotaExceeded"
    assert (
        "quota 'ml.p4d.24xlarge for training job usage' is 2, 2 in use, and this job asks for 2 more"
        in run.cause
    )
    assert "Service Quotas" in run.cause
    assert len(harness.jobs.requests) == 1 and harness.waits == []  # policy "fail": no retry
    assert notifications[0]["MessageAttributes"]["status"]["Value"] == "Failed"


def test_quota_error_waits_and_retries_when_the_template_says_wait(launcher):
    # llama-pretrain-hsdp-tp has quota_policy: wait (backoff 900 s).
    quota = JobOutcome.quota_error("ml.p5.48xlarge for training job usage", limit=8, in_use=4, requested=4)
    with launcher([quota, quota, JobOutcome()]) as harness:
        run = harness.run({"template": "llama-pretrain-hsdp-tp", "run_name": "waitquota"})

    assert run.status == "SUCCEEDED", run.cause
    assert harness.waits == [900, 1800]
    assert [a["outcome"] for a in run.output["attempt_history"]] == ["quota", "quota", "Completed"]


def test_algorithm_error_fails_with_the_jobs_failure_reason(launcher):
    reason = "AlgorithmError: ExecuteUserScriptError: torch.OutOfMemoryError: CUDA out of memory"
    with launcher([JobOutcome.algorithm_error(reason)]) as harness:
        run = harness.run({"template": "gpt2-ddp", "run_name": "oom"})
        notifications = harness.notifications()

    assert run.status == "FAILED"
    assert run.error == "TrainingJobFailed"
    assert reason in run.cause and "llmtrain logs oom" in run.cause
    assert len(harness.jobs.requests) == 1 and harness.waits == []
    message = notifications[0]["Message"]
    assert f"{PREFIX}-oom-a1" in message and reason in message and "Billable seconds: 120" in message


def test_a_hung_job_is_retried_once_from_the_same_checkpoints(launcher):
    """The training program's hang watchdog ended attempt 1: one new job, at once, resumes it."""
    hang = JobOutcome.algorithm_error(
        "AlgorithmError: HungCollective: nothing finished for 20 minutes on rank 3 (host algo-1) after "
        "step 1200"
    )
    with launcher([hang, JobOutcome()]) as harness:
        run = harness.run({"template": "llama-pretrain-fsdp", "run_name": "stuck"})

    assert run.status == "SUCCEEDED", run.cause
    assert _sent(harness, "TrainingJobName") == [f"{PREFIX}-stuck-a1", f"{PREFIX}-stuck-a2"]
    assert len({request["CheckpointConfig"]["S3Uri"] for request in harness.jobs.requests}) == 1
    assert harness.waits == [0]
    assert [a["outcome"] for a in run.output["attempt_history"]] == ["hung", "Completed"]


def test_a_rule_stop_fails_the_run_without_a_retry_and_says_what_the_rule_saw(launcher):
    reason = ("AlgorithmError: RuleTriggered: loss_spike at step 120: loss 9.1 is above 3 x its running mean "
              "2.9 (action stop)")
    with launcher([JobOutcome.algorithm_error(reason), JobOutcome()]) as harness:
        run = harness.run({"template": "gpt2-ddp", "run_name": "spiky"})
        notifications = harness.notifications()

    assert run.status == "FAILED" and run.error == "StoppedByRule"
    assert len(harness.jobs.requests) == 1 and harness.waits == []
    assert reason in run.cause and "shows its [rule] lines" in run.cause
    assert notifications[0]["Subject"] == "llmtrain: run spiky Failed (StoppedByRule)"
    assert "RuleTriggered: loss_spike at step 120" in notifications[0]["Message"]


def test_a_second_start_of_a_run_in_progress_creates_no_second_job(launcher):
    release = threading.Event()
    with launcher([JobOutcome(hold=release)]) as harness:
        first = harness.start({"template": "gpt2-ddp", "run_name": "twice"})
        deadline = time.monotonic() + 30
        while not harness.jobs.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        # Another execution for the same run (e.g. from the console, under another name).
        second = harness.run({"template": "gpt2-ddp", "run_name": "twice"}, name="twice-again")
        release.set()
        first_run = harness.wait(first)
        third = harness.run({"template": "gpt2-ddp", "run_name": "twice"}, name="twice-after")

    assert second.status == "FAILED" and second.error == "RunAlreadyInProgress"
    assert f"{PREFIX}-twice-a1" in second.cause and "llmtrain status twice" in second.cause
    assert first_run.status == "SUCCEEDED", first_run.cause
    assert third.status == "FAILED" and third.error == "RunAlreadyCompleted"
    assert len(harness.jobs.requests) == 1


def test_the_definition_is_resolved_from_the_synthesized_template(synthesized):
    """The harness executes what CloudFormation deploys: every reference resolves to a value."""
    _, launcher_stack, templates = synthesized
    template = templates[launcher_stack]
    machine = next(
        r for lid, r in template["Resources"].items()
        if r["Type"] == "AWS::StepFunctions::StateMachine" and lid.startswith("Launcher")
    )
    definition = json.loads(
        CloudFormationResolver(templates).resolve(machine["Properties"]["DefinitionString"], launcher_stack)
    )
    states = definition["States"]
    assert states["CreateTrainingJob-all"]["Resource"] == "arn:aws:states:::sagemaker:createTrainingJob.sync"
    assert states["Resolve"]["Parameters"]["FunctionName"].startswith(
        f"arn:aws:lambda:us-east-1:{ACCOUNT}:function:"
    )
    assert "${" not in json.dumps(definition) and "Fn::" not in json.dumps(definition)


# -- defects found by executing the synthesized state machine with unusual input ----------------------
# Each test below failed on the launcher as it was before typed records and teams (issue 18).


def _rejected_before_any_job(harness, run, *fragments):
    assert run.status == "FAILED", (run.status, run.error, run.cause)
    assert run.error == "InvalidRunInput", (run.error, run.cause)
    for fragment in fragments:
        assert fragment in run.cause, (fragment, run.cause)
    assert not any(state.startswith("CreateTrainingJob") for state in _states_entered(run))


@pytest.mark.parametrize(
    ("execution_input", "kind"),
    [([1, 2], "got a list"), ("gpt2-ddp", "got a string"), (7, "got a number"), (None, "got null")],
)
def test_input_that_is_not_a_json_object_is_rejected_and_notified(launcher, execution_input, kind):
    """Defect 1: such input ended in States.Runtime, with no notification."""
    with launcher([]) as harness:
        run = harness.run(execution_input, name="not-an-object")
        notifications = harness.notifications()
    _rejected_before_any_job(harness, run, "the execution input must be a JSON object like", kind)
    assert harness.jobs.requests == []
    assert [n["Subject"] for n in notifications] == ["llmtrain: run not-an-object rejected"]
    assert "Error: InvalidRunInput" in notifications[0]["Message"]


def test_an_enormous_number_is_rejected_naming_the_override(launcher):
    """Defect 2: Resolve crashed with a raw stack trace (OverflowError) instead of a rejection."""
    with launcher([]) as harness:
        run = harness.run({"template": "gpt2-ddp", "run_name": "huge", "overrides": {"lr": 10**400}})
    _rejected_before_any_job(harness, run, "override 'lr': 1000000000", "is not a valid float")
    assert "Traceback" not in run.cause and len(run.cause) < 1000
    assert harness.jobs.requests == []


def test_an_empty_version_is_refused_not_taken_for_latest(launcher):
    """Defect 3: `"version": ""` silently ran the latest version."""
    with launcher([JobOutcome()]) as harness:
        run = harness.run({"template": "gpt2-ddp", "version": "", "run_name": "noversion"})
    _rejected_before_any_job(harness, run, "'version' must be a published version", 'or "latest"')
    assert harness.jobs.requests == []


def test_a_long_execution_name_still_gets_its_notification(launcher):
    """Defect 4: SNS subjects are at most 100 characters; an 80-character execution name broke the
    rejection's publish, so nobody heard of it."""
    name = "x" * 80
    with launcher([]) as harness:
        bad = {"template": "gpt2-ddp", "run_name": name, "overrides": {"max_steps": 0}}
        run = harness.run(bad, name=name)
        notifications = harness.notifications()
    assert run.error == "InvalidRunInput"
    [note] = notifications
    assert len(note["Subject"]) <= 100 and note["Subject"].endswith("... rejected")
    assert note["Subject"].startswith("llmtrain: run xxxx")
    assert not any("notification_error" in json.dumps(e, default=str) for e in run.history)


def test_a_fallback_type_that_cannot_hold_the_run_is_never_tried(launcher):
    """Defect 5: gpt2-ddp's fallback ml.g5.24xlarge has no EFA, so a two-node run could not use it; the
    run ended as RetryNotPossible blaming SageMaker. It now ends as CapacityUnavailable, saying why."""
    run_input = {
        "template": "gpt2-ddp",
        "run_name": "twonodes",
        "overrides": {"instance_count": 2, "instance_type": "ml.p4d.24xlarge"},
    }
    with launcher([JobOutcome.capacity_error()] * 4) as harness:
        run = harness.run(run_input)
    assert run.status == "FAILED"
    assert run.error == "CapacityUnavailable", run.cause
    assert _instance_types(harness) == ["ml.p4d.24xlarge"] * 4  # 1 + 3 retries, no fallback attempt
    assert "SageMaker had no capacity for ml.p4d.24xlarge after 4 attempt(s)" in run.cause
    assert "Fallback types that cannot hold this run were not tried (ml.g5.24xlarge:" in run.cause
    assert "EFA" in run.cause


def test_a_run_keeps_its_template_and_version_for_life(launcher):
    """Defect 6: starting a failed run again under another template version continued the run's name
    with another program on the same checkpoints."""
    reason = "AlgorithmError: exit code 1"
    with launcher([JobOutcome.algorithm_error(reason), JobOutcome()]) as harness:
        first = harness.run({"template": "gpt2-ddp", "version": "1.0.0", "run_name": "kept"})
        other = harness.run(
            {"template": "gpt2-ddp", "version": "1.1.0", "run_name": "kept"}, name="kept-other-version"
        )
        # Issue 36 item 3: another template on the run's name would fail on the checkpoints' model.
        other_template = harness.run(
            {"template": "llama-pretrain-fsdp", "run_name": "kept"}, name="kept-other-template"
        )
        again = harness.run({"template": "gpt2-ddp", "run_name": "kept"}, name="kept-again")
    assert first.error == "TrainingJobFailed"
    refused = "run 'kept' runs gpt2-ddp@1.0.0 (its earlier jobs), not gpt2-ddp@1.1.0"
    _rejected_before_any_job(harness, other, refused)
    refused = "run 'kept' runs gpt2-ddp@1.0.0 (its earlier jobs), not llama-pretrain-fsdp@latest"
    _rejected_before_any_job(harness, other_template, refused, "choose a new run_name")
    # Continued without a version ("latest"), the run stays on the version its jobs ran.
    assert again.status == "SUCCEEDED", again.cause
    assert again.output["template"] == "gpt2-ddp@1.0.0"
    assert _sent(harness, "TrainingJobName") == [f"{PREFIX}-kept-a1", f"{PREFIX}-kept-a2"]
    code = {json.loads(r["HyperParameters"]["sagemaker_submit_directory"]) for r in harness.jobs.requests}
    assert len(code) == 1 and "/gpt2-ddp/1.0.0/" in code.pop()


def test_a_throttled_create_training_job_is_called_again(launcher):
    """Defect 7: a one-off ThrottlingException from CreateTrainingJob failed the run."""
    with launcher([JobOutcome.throttled(), JobOutcome()]) as harness:
        run = harness.run({"template": "gpt2-ddp", "run_name": "throttled"})
    assert run.status == "SUCCEEDED", run.cause
    # No job existed after the throttled call: the same attempt (and job name) is made again.
    assert _sent(harness, "TrainingJobName") == [f"{PREFIX}-throttled-a1"] * 2
    assert harness.waits == [10]
    assert run.output["attempts"] == 1


def test_a_run_name_with_upper_case_is_refused(launcher):
    """Defect 8: SageMaker matches job names without case, checkpoint prefixes do not: `Casey` and
    `casey` shared jobs but not checkpoints."""
    with launcher([JobOutcome()]) as harness:
        first = harness.run({"template": "gpt2-ddp", "run_name": "casey"})
        upper = harness.run({"template": "gpt2-ddp", "run_name": "Casey"}, name="Casey")
    assert first.status == "SUCCEEDED", first.cause
    _rejected_before_any_job(harness, upper, "run_name 'Casey' has upper-case letters", "use 'casey'")
    assert len(harness.jobs.requests) == 1


def test_a_channel_escaping_the_teams_prefix_creates_no_job(launcher):
    """Issue 25: a channel that starts with the team's datasets prefix and then leaves it (a dot
    segment, percent-encoding, a trailing space) passed Resolve and created a training job."""
    with launcher([JobOutcome()]) as harness:
        datasets = _platform(harness).datasets_uri
        other = datasets.replace("/teams/default/", "/teams/other/")
        escapes = {
            "dots": (f"{datasets}../other/tokens/", "the path segment '..'"),
            "dot": (f"{datasets}./../other/tokens/", "the path segment '.'"),
            "encoded": (f"{datasets}%2e%2e/other/tokens/", "a percent sign"),
            "space": (f"{datasets}tokens/ ", "holds SPACE"),
        }
        runs = {
            name: harness.run(
                {"template": "gpt2-ddp", "run_name": f"escape-{name}", "overrides": {"channels.train": uri}}
            )
            for name, (uri, _) in escapes.items()
        }
        outside = harness.run(
            {"template": "gpt2-ddp", "run_name": "outside", "overrides": {"channels.train": other}}
        )
    for name, (_, problem) in escapes.items():
        _rejected_before_any_job(harness, runs[name], "override 'channels.train'", problem)
    _rejected_before_any_job(harness, outside, "is outside team 'default''s datasets prefix")
    assert harness.jobs.requests == []


def test_the_planner_guards_the_launcher_and_the_summary_reports_the_cost(launcher):
    """Resolve plans every run (llmtrain.planner): it refuses one planned not to fit its GPUs,
    naming the change that would, unless the input sets skip_plan_check, and one planned to cost
    more than its team's budget (dev's one team has none of its own: the environment's budgets.
    max_run_cost_usd of config/dev.yaml, $20,000); the summary of a run that ran
    holds its actual cost (billable seconds x instances x on-demand price) beside the predicted."""
    too_big = {"model_preset": "gpt2-medium", "seq_len": 1024, "micro_batch_size": 16}
    with launcher([JobOutcome(billable_seconds=1800)]) as harness:
        # A run's own channels (under its team's datasets) do not change the plan or its advice.
        datasets = _platform(harness).datasets_uri
        too_big["channels.train"] = f"{datasets}notes/train/"
        refused = harness.run({"template": "gpt2-ddp", "run_name": "too-big", "overrides": too_big})
        dear = harness.run(
            {"template": "llama-pretrain-fsdp", "run_name": "too-dear", "overrides": {"max_steps": 1000000}}
        )
        forced = harness.run(
            {"template": "gpt2-ddp", "run_name": "forced", "overrides": too_big, "skip_plan_check": True}
        )
        notifications = harness.notifications()

    assert refused.status == "FAILED" and refused.error == "InvalidRunInput"
    assert "planned not to fit" in refused.cause and "ml.g5.12xlarge" in refused.cause
    assert "; set micro_batch_size=" in refused.cause and "skip_plan_check" in refused.cause
    assert dear.status == "FAILED" and dear.error == "InvalidRunInput"
    assert "above team 'default''s budget of $20,000 per run" in dear.cause
    # Only the forced run reached SageMaker.
    assert _sent(harness, "TrainingJobName") == [f"{PREFIX}-forced-a1"]
    assert forced.status == "SUCCEEDED", forced.cause
    summary = forced.output
    price = json.loads((ROOT / "llmtrain" / "planner" / "prices.json").read_text())["on_demand_per_hour"]
    assert summary["actual_cost_usd"] == pytest.approx(1800 * price["ml.g5.12xlarge"] / 3600)
    assert summary["predicted_cost_usd"] > 0 and summary["plan"].startswith("plan: DOES NOT FIT")
    note = next(n for n in notifications if n["Subject"] == "llmtrain: run forced Completed")
    assert f"Cost: ${summary['actual_cost_usd']:,.2f} actual" in note["Message"]
    assert f"${summary['predicted_cost_usd']:,.2f} predicted" in note["Message"]


@pytest.fixture(scope="module")
def team_budget_launcher(tmp_path_factory):
    """dev, its one team with a budget of its own ($10 a run) below the environment's ($20,000)."""
    config = _dev_config()
    team = dataclasses.replace(config.teams[0], max_run_cost_usd=10.0)
    assembly_dir, launcher_stack, templates = _synthesize(
        tmp_path_factory, dataclasses.replace(config, teams=(team,))
    )
    return lambda outcomes: launcher_in_moto(assembly_dir, launcher_stack, templates, outcomes)


def test_a_teams_own_budget_is_what_its_launcher_enforces(team_budget_launcher):
    """The team's max_run_cost_usd reaches its launcher as run_budget_usd, in place of the
    environment's: a run planned at about $18 is refused at $10, one planned under $1 runs; the
    environment's $20,000 would have let both through."""
    with team_budget_launcher([JobOutcome(billable_seconds=600)]) as harness:
        assert _platform(harness).run_budget_usd == 10.0
        long_run = harness.run(
            {"template": "gpt2-ddp", "run_name": "long", "overrides": {"max_steps": 200000}}
        )
        short_run = harness.run({"template": "gpt2-ddp", "run_name": "short"})

    assert long_run.status == "FAILED" and long_run.error == "InvalidRunInput"
    assert "above team 'default''s budget of $10 per run" in long_run.cause
    assert "teams.default.max_run_cost_usd" in long_run.cause
    assert _sent(harness, "TrainingJobName") == [f"{PREFIX}-short-a1"]
    assert short_run.status == "SUCCEEDED", short_run.cause
    assert 0 < short_run.output["predicted_cost_usd"] < 10
