"""A cloud data preparation before any job: its CreateProcessingJob requests (botocore's shape), the
refusals that need no AWS call, the S3 checks against moto's S3, and the cost estimate from the
measured rate."""

from __future__ import annotations

import dataclasses
import json

import boto3
import pytest
from botocore.validate import ParamValidator
from deployed_support import BUCKET, REGION, TEAM_URI, moto_credentials, platform_context
from moto import mock_aws

from llmtrain.client import preparations
from llmtrain.core.catalog import Catalog
from llmtrain.core.preparation import (
    CPU_INSTANCE_TYPES,
    DATASET_PATH,
    DEDUP_FOLDER,
    INPUT_PATH,
    PREVIOUS_PATH,
    PROCESSING_REQUEST_FIELDS,
    QUALITY_REQUIREMENTS,
    SHARDS_PATH,
    STATE_PATH,
    TOKENIZER_PATH,
    Preparation,
    PreparationError,
    PreparationInput,
    check_preparation,
    execution_name,
    merge_request,
    preparation_instance_types,
    shards_request,
    volume_size_gb,
)
from llmtrain.core.render import image_uri
from llmtrain.core.sourcedir import collect_files, repository_root
from llmtrain.core.spec import PLATFORM_CODE, PLATFORM_ENTRY_POINT, CodeSpec
from llmtrain.core.validate import input_shape
from llmtrain.lifecycle import preparation_steps
from llmtrain.planner import prices
from llmtrain.planner.checks import PlanRefused
from llmtrain.planner.preparation_cost import MEASURED_SECONDS, check_budget, estimate, vcpus
from training_jobs.data_pipeline import units

PLATFORM = platform_context(max_instance_count=8)
TEMPLATE = Catalog.load().resolve("gpt2-ddp")
TOKENIZER = repository_root() / "training_jobs" / "assets" / "tokenizer"
PREPARATION = Preparation(
    name="web-2026",
    input_uri=f"{TEAM_URI}raw/web/",
    tokenizer_uri=f"{TEAM_URI}tok/",
    instance_type="ml.c5.4xlarge",
    instance_count=3,
    options=("--text-key", "body", "--validation-fraction", "0.01"),
    owner="alice",
    input_bytes=40 << 30,
    stamp="20261128120000",
)


def _problems(request: dict) -> bool:
    return ParamValidator().validate(request, input_shape("sagemaker", "CreateProcessingJob")).has_errors()


def test_the_shards_and_merge_requests_are_accepted_by_botocore_and_carry_the_teams_guard_rails():
    shards, merge = (
        shards_request(PREPARATION, PLATFORM, TEMPLATE),
        merge_request(PREPARATION, PLATFORM, TEMPLATE),
    )
    assert not _problems(shards) and not _problems(merge)
    for request in (shards, merge):
        assert request["RoleArn"] == PLATFORM.execution_role_arn
        assert request["ProcessingJobName"].startswith(f"{PLATFORM.job_name_prefix}-web-2026-")
        assert request["ProcessingOutputConfig"]["KmsKeyId"] == PLATFORM.kms_key_arn
        assert request["ProcessingResources"]["ClusterConfig"]["VolumeKmsKeyId"] == PLATFORM.kms_key_arn
        assert request["NetworkConfig"]["VpcConfig"] == {
            "SecurityGroupIds": list(PLATFORM.security_group_ids),
            "Subnets": list(PLATFORM.subnet_ids),
        }
        assert {"Key": "llmtrain:team", "Value": PLATFORM.team} in request["Tags"]
        assert request["AppSpecification"]["ImageUri"] == image_uri(
            TEMPLATE, "ml.c5.4xlarge", PLATFORM.region
        )
    assert shards["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 3
    assert merge["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 1
    assert shards["ProcessingJobName"] != merge["ProcessingJobName"]
    data = {i["InputName"]: i["S3Input"] for i in shards["ProcessingInputs"]}
    assert data["data"]["S3Uri"] == PREPARATION.input_uri and data["data"]["LocalPath"] == INPUT_PATH
    assert data["data"]["S3DataDistributionType"] == "FullyReplicated"  # each instance runs units of any file
    assert "previous" not in data  # a first attempt
    arguments = shards["AppSpecification"]["ContainerArguments"]
    assert arguments[:9] == [
        "--input",
        INPUT_PATH,
        "--tokenizer",
        TOKENIZER_PATH,
        "--output",
        DATASET_PATH,
        "--state",
        STATE_PATH,
        "--host-config",
    ]
    assert arguments[9:] == list(PREPARATION.options)  # the same options as a local preparation
    outputs = {o["OutputName"]: o["S3Output"] for o in shards["ProcessingOutputConfig"]["Outputs"]}
    assert outputs["dataset"]["S3Uri"] == f"{TEAM_URI}web-2026/"
    assert outputs["state"]["S3Uri"] == f"{TEAM_URI}web-2026/.preparation/"
    assert merge["AppSpecification"]["ContainerArguments"][:3] == ["--merge-only", "--input", PREVIOUS_PATH]
    rerun = shards_request(dataclasses.replace(PREPARATION, rerun=True), PLATFORM, TEMPLATE)
    assert not _problems(rerun) and rerun["AppSpecification"]["ContainerArguments"][-2:] == [
        "--previous",
        PREVIOUS_PATH,
    ]


def test_a_deduplicating_preparations_merge_reads_the_datasets_prefix_to_rewrite_its_shards():
    plain = merge_request(PREPARATION, PLATFORM, TEMPLATE)
    dedup = dataclasses.replace(PREPARATION, options=(*PREPARATION.options, "--dedup=minhash"))
    shards, merge = shards_request(dedup, PLATFORM, TEMPLATE), merge_request(dedup, PLATFORM, TEMPLATE)
    assert not _problems(shards) and not _problems(merge)
    inputs = {i["InputName"]: i["S3Input"] for i in merge["ProcessingInputs"]}
    assert inputs["shards"] == {**inputs["state"], "S3Uri": f"{TEAM_URI}web-2026/", "LocalPath": SHARDS_PATH}
    assert merge["AppSpecification"]["ContainerArguments"][-2:] == ["--shards", SHARDS_PATH]
    assert "shards" not in {i["InputName"] for i in plain["ProcessingInputs"]}
    assert shards["AppSpecification"]["ContainerArguments"][9:] == list(dedup.options)  # passed on as is
    assert shards["ProcessingJobName"] != merge["ProcessingJobName"] and len(merge["ProcessingInputs"]) == 4
    # 40 GiB of input: the merge holds the shards, the signatures and the rewritten shards (about 3 x 43 GB)
    volume = merge["ProcessingResources"]["ClusterConfig"]["VolumeSizeInGB"]
    assert volume > plain["ProcessingResources"]["ClusterConfig"]["VolumeSizeInGB"] and volume >= 3 * 43
    assert DEDUP_FOLDER == units.DEDUP_FOLDER  # the folder the launcher removes is the one the program writes


def test_both_jobs_install_the_quality_steps_library_the_repository_pins():
    scripts = {build(PREPARATION, PLATFORM, TEMPLATE)["AppSpecification"]["ContainerEntrypoint"][2]
               for build in (shards_request, merge_request)}
    assert len(scripts) == 1 and f"-r requirements.txt -r {QUALITY_REQUIREMENTS};" in scripts.pop()
    archived = {f.archive_path: f.path for f in collect_files(CodeSpec(PLATFORM_CODE, PLATFORM_ENTRY_POINT))}
    pins = [line for line in archived[QUALITY_REQUIREMENTS].read_text().splitlines() if line[:1].isalpha()]
    repository = (repository_root() / "requirements.txt").read_text().splitlines()
    assert pins == ["datatrove==0.10.1"] and pins[0] in repository


def test_both_requests_have_the_fields_the_state_machine_passes():
    """The preparation state machine passes each of PROCESSING_REQUEST_FIELDS and fixes RoleArn: a field
    the requests gained and the definition lacks would never reach SageMaker."""
    for make in (shards_request, merge_request):
        request = make(PREPARATION, PLATFORM, TEMPLATE)
        assert set(request) == {"RoleArn", *PROCESSING_REQUEST_FIELDS}


def test_the_state_machine_input_round_trips_and_names_what_is_wrong():
    given = PreparationInput(PREPARATION, TEMPLATE.ref)
    assert PreparationInput.from_dict(json.loads(json.dumps(given.to_dict()))) == given
    for data, message in [
        ([], "must be a JSON object with 'template' and 'preparation', got a list"),
        ({"template": "gpt2-ddp", "preparation": {}}, "'template' must be 'name@version'"),
        ({**given.to_dict(), "extra": 1}, "unknown fields ['extra']"),
        ({**given.to_dict(), "preparation": {**PREPARATION.to_dict(), "instance_count": "2"}},
         "'instance_count' must be a whole number, got a string"),
        ({**given.to_dict(), "preparation": {**PREPARATION.to_dict(), "rerun": 1}},
         "'rerun' must be true or false"),
        ({**given.to_dict(), "preparation": {**PREPARATION.to_dict(), "options": "--x"}},
         "'options' must be a list of strings"),
        ({**given.to_dict(), "preparation": {"name": "web"}}, "'input_uri' is missing"),
    ]:
        with pytest.raises(PreparationError) as refused:
            PreparationInput.from_dict(data)
        assert message in str(refused.value), (data, str(refused.value))
    with pytest.raises(PreparationError, match="stamp '2026' must be YYYYMMDDHHMMSS"):
        check_preparation(dataclasses.replace(PREPARATION, stamp="2026"), PLATFORM)
    name = execution_name(PLATFORM, PREPARATION)
    assert name.endswith("-20261128120000") and len(name) <= 80
    stem = name[: -len("-20261128120000")]
    assert shards_request(PREPARATION, PLATFORM, TEMPLATE)["ProcessingJobName"].startswith(stem)


def test_a_teams_preparations_run_on_its_cpu_types_or_else_on_every_cpu_type():
    assert preparation_instance_types(("ml.p4d.24xlarge", "ml.g5.12xlarge")) == CPU_INSTANCE_TYPES
    assert preparation_instance_types(()) == CPU_INSTANCE_TYPES
    assert preparation_instance_types(("ml.p4d.24xlarge", "ml.m5.xlarge")) == ("ml.m5.xlarge",)
    gpus_only = dataclasses.replace(PLATFORM, allowed_instance_types=("ml.p4d.24xlarge",))
    check_preparation(PREPARATION, gpus_only)  # a team of GPU types prepares on any CPU type


def test_a_long_dataset_name_gives_a_job_name_within_sagemakers_limit():
    long = dataclasses.replace(PREPARATION, name="a.very_long-name." * 7)
    name = shards_request(long, PLATFORM, TEMPLATE)["ProcessingJobName"]
    assert len(name) <= 63 and name.startswith(PLATFORM.job_name_prefix)
    other = dataclasses.replace(long, name=long.name + "x")
    assert shards_request(other, PLATFORM, TEMPLATE)["ProcessingJobName"] != name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"input_uri": "s3://another-bucket/teams/default/raw/"}, "outside team 'default'"),
        ({"input_uri": f"{TEAM_URI}../other/raw/"}, "--input"),
        ({"input_uri": "s3://" + BUCKET + "/teams/other/raw/"}, "outside team 'default'"),
        ({"tokenizer_uri": "s3://another-bucket/tok/"}, "--tokenizer 's3://another-bucket/tok/' is outside"),
        ({"input_uri": f"{TEAM_URI}web-2026/raw/"}, "inside the dataset being prepared"),
        ({"instance_type": "ml.p4d.24xlarge"}, "a preparation tokenizes on CPUs"),
        ({"instance_count": 9}, "above team 'default''s cap of 8"),
        ({"options": ("--preference",)}, "--preference is not offered with --cloud"),
        ({"options": ("--ded", "exact")}, "--ded: write the option in full (--dedup)"),
        ({"options": ("--output", "x")}, "--output: the platform sets it"),
        ({"name": "bad/name"}, "--name 'bad/name'"),
    ],
)
def test_refusals_before_any_aws_call(change, message):
    with pytest.raises(PreparationError, match=None) as refused:
        check_preparation(dataclasses.replace(PREPARATION, **change), PLATFORM)
    assert message in str(refused.value)


def test_an_instance_type_the_team_may_not_use_is_refused():
    limited = dataclasses.replace(PLATFORM, allowed_instance_types=("ml.m5.xlarge",))
    with pytest.raises(PreparationError, match="not allowed for team 'default'"):
        check_preparation(PREPARATION, limited)
    check_preparation(dataclasses.replace(PREPARATION, instance_type="ml.m5.xlarge"), limited)


def test_the_estimate_uses_the_measured_rate_and_refuses_a_preparation_over_the_budget():
    bench = json.loads((repository_root() / "bench" / "results" / "prepare-data-cpu.json").read_text())
    one_worker = next(run for run in bench["runs"] if run.get("workers") == 1)
    assert one_worker["seconds"] == MEASURED_SECONDS  # the figure is the benchmark's, not a guess
    assert vcpus("ml.c5.4xlarge") == 16 and vcpus("ml.m5.large") == 2 and vcpus("ml.c5.xlarge") == 4
    table = prices.load()
    plan = estimate(6_000_000 * 15 * 4, "ml.c5.4xlarge", 4, table)  # 15 workers each, 4 instances
    assert plan.hours * 3600 == pytest.approx(MEASURED_SECONDS)
    assert plan.usd == pytest.approx(plan.hours * 4 * table.on_demand("ml.c5.4xlarge"))
    big = estimate(10 << 40, "ml.c5.4xlarge", 4, table)
    check_budget(big, None, "default")
    with pytest.raises(PlanRefused, match="above team 'default''s budget of \\$10 per run"):
        check_budget(big, 10.0, "default")
    assert "6 MB in 14.2 s" in big.summary_line()


def test_volume_holds_the_input_and_the_instances_share_of_shards():
    assert volume_size_gb(100 * 10**9, 4) >= 125 and volume_size_gb(100 * 10**9, 4) < 160


# -- S3 checks (moto) -------------------------------------------------------------------------------------


@pytest.fixture
def s3(monkeypatch):
    moto_credentials(monkeypatch)
    with mock_aws():
        client = boto3.client("s3", region_name=REGION)
        client.create_bucket(Bucket=BUCKET)
        yield client


def _put(s3, key: str, body: bytes) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"teams/default/{key}", Body=body)


def test_the_input_prefix_is_checked_before_any_job(s3):
    uri = f"{TEAM_URI}raw/"
    with pytest.raises(PreparationError, match=f"--input {uri}: no files there"):
        preparations.check_inputs(s3, uri, preparations.input_files(s3, uri), 1)
    _put(s3, "raw/a.jsonl", b'{"text": "hello"}\n')
    _put(s3, "raw/.hidden", b"x")
    _put(s3, "raw/b.txt", b"world")
    files = preparations.input_files(s3, uri)
    assert [f.key for f in files] == ["teams/default/raw/a.jsonl", "teams/default/raw/b.txt"]
    preparations.check_inputs(s3, uri, files, 2)
    with pytest.raises(PreparationError, match="--instance-count 3 is more than the 2 input file"):
        preparations.check_inputs(s3, uri, files, 3)
    _put(s3, "raw/c.txt", b"caf\xe9 latin-1")
    with pytest.raises(PreparationError, match="raw/c.txt: not UTF-8 text \\(byte 3\\)"):
        preparations.check_inputs(s3, uri, preparations.input_files(s3, uri), 1)
    _put(s3, "raw/c.txt", b"ok")
    _put(s3, "raw/d.parquet", b"PAR1")
    with pytest.raises(PreparationError, match="d.parquet: a .parquet file is not text"):
        preparations.check_inputs(s3, uri, preparations.input_files(s3, uri), 1)


def test_an_output_that_holds_a_dataset_is_refused_and_an_earlier_attempt_is_resumed(s3):
    assert preparations.output_is_rerun(s3, PREPARATION, PLATFORM) is False
    _put(s3, "web-2026/.preparation/plan.json", b"{}")
    assert preparations.output_is_rerun(s3, PREPARATION, PLATFORM) is True
    _put(s3, "web-2026/train/manifest.json", b"{}")
    with pytest.raises(PreparationError, match="already holds a dataset \\(train/manifest.json\\)"):
        preparations.output_is_rerun(s3, PREPARATION, PLATFORM)
    other = dataclasses.replace(PREPARATION, name="other")
    _put(s3, "other/notes.txt", b"x")
    with pytest.raises(PreparationError, match="holds 1 file\\(s\\) \\(e.g. notes.txt\\) but no preparation"):
        preparations.output_is_rerun(s3, other, PLATFORM)


def test_a_tokenizer_folder_that_does_not_load_is_refused_and_one_that_loads_passes(s3):
    uri = f"{TEAM_URI}tok/"
    with pytest.raises(PreparationError, match="no tokenizer there"):
        preparations.check_tokenizer_and_options(s3, uri, ())
    _put(s3, "tok/tokenizer.json", b"{not json")
    with pytest.raises(
        PreparationError, match=f"--tokenizer {uri}: not a tokenizer folder transformers can load"
    ):
        preparations.check_tokenizer_and_options(s3, uri, ())
    for path in TOKENIZER.iterdir():
        _put(s3, f"tok/{path.name}", path.read_bytes())
    preparations.check_tokenizer_and_options(s3, uri, ("--text-key", "body"))
    with pytest.raises(PreparationError, match="--validation-fraction must be in"):
        preparations.check_tokenizer_and_options(s3, uri, ("--validation-fraction", "2"))


def test_sizes_and_the_marker_are_written_from_the_listing_and_unused_files_removed(s3):
    """What the preparation state machine's function writes (llmtrain.lifecycle.preparation_steps)."""
    _put(s3, "web-2026/train/shard_00000_00000.bin", b"\0" * 8)
    _put(s3, "web-2026/.preparation/units/00000.json", b"{}")
    with pytest.raises(PreparationError, match="has no manifest.json"):
        preparation_steps.write_marker(s3, PREPARATION, PLATFORM)
    sizes = preparation_steps.write_sizes(s3, PREPARATION, PLATFORM)
    assert sizes == {"train/shard_00000_00000.bin": 8}
    _put(s3, "web-2026/train/manifest.json", b"{}")
    with pytest.raises(PreparationError, match="not the manifest of a dataset .*nothing was removed"):
        preparation_steps.write_marker(s3, PREPARATION, PLATFORM)
    # What a deduplicating merge leaves: a unit's shard it replaced, the signatures, an upload's temporary.
    manifest = {"shards": [{"path": "shard_00000_00000_dedup.bin", "num_tokens": 2}]}
    _put(s3, "web-2026/train/manifest.json", json.dumps(manifest).encode())
    for key in ("train/shard_00000_00000_dedup.bin", "train/shard_00001_00000.bin.tmp", ".dedup/0/0.sig"):
        _put(s3, f"web-2026/{key}", b"\0" * 4)
    preparation_steps.write_marker(s3, PREPARATION, PLATFORM)
    marker = json.loads(
        s3.get_object(Bucket=BUCKET, Key="teams/default/web-2026/llmtrain-dataset.json")["Body"].read()
    )
    assert sorted(f["path"] for f in marker["files"]) == [
        ".preparation/sizes.json",
        ".preparation/units/00000.json",
        "train/manifest.json",
        "train/shard_00000_00000_dedup.bin",
    ]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="teams/default/web-2026/")["Contents"]]
    assert len(keys) == 5 and marker["team"] == "default"  # the four files and the marker


def test_the_completed_summary_gives_each_quality_steps_removals_from_the_merges_report(s3):
    """The Complete step's summary: what the CLI prints after a followed execution and the team's topic
    gets; no report yet (no merge), no removal."""
    _put(s3, "web-2026/train/manifest.json", json.dumps({"shards": []}).encode())
    assert preparation_steps.step_removals(s3, PLATFORM, "web-2026") is None
    steps = [
        {"step": "gopher-quality", "removed_documents": 3, "removed_tokens": 120},
        {"step": "dedup-exact", "removed_documents": 1200, "removed_tokens": 45000},
    ]
    _put(s3, "web-2026/preparation.json", json.dumps({"steps": steps}).encode())
    summary = preparation_steps.completed_summary(PREPARATION, PLATFORM, [], s3)
    assert summary["removed"] == [
        {"step": "gopher-quality", "documents": 3, "tokens": 120},
        {"step": "dedup-exact", "documents": 1200, "tokens": 45000},
    ]
    lines = summary["message"].splitlines()
    assert lines[2:4] == [
        "gopher-quality removed 3 document(s) (120 tokens)",
        "dedup-exact removed 1,200 document(s) (45,000 tokens)",
    ]
    assert lines[0] == "Dataset web-2026: Completed" and lines[-1].startswith("Use it with")
