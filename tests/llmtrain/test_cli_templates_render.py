"""The CLI: `llmtrain templates [--json]`, `templates show|lock`, `llmtrain render`; bad input exits 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from templates_support import REPO_ROOT, TEMPLATE_NAMES, catalog, copy_catalog, platform_context

from llmtrain.cli import main
from llmtrain.core.environments import StackOutput
from llmtrain.core.errors import LlmtrainError


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_templates_table_lists_every_version(capsys):
    code, out, _ = run(capsys, "templates")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "VERSION", "STRATEGY", "INSTANCE", "TYPE", "COUNT"]
    assert [line.split()[:2] for line in lines[1:]] == [[name, version] for name, version in _versions()]
    fsdp = [line for line in lines if line.startswith("llama-pretrain-fsdp ")]
    assert [line.split()[1:5] for line in fsdp] == [["1.0.0", "fsdp", "ml.p4d.24xlarge", "2"],
                                                    ["1.1.0", "fsdp", "ml.p4d.24xlarge", "2"],
                                                    ["1.2.0", "fsdp", "ml.p4d.24xlarge", "2"],
                                                    ["1.3.0", "fsdp", "ml.p4d.24xlarge", "2"]]
    assert fsdp[0].endswith(" default") and fsdp[3].endswith(" latest, default")


def test_templates_json_is_a_list_of_objects(capsys):
    code, out, _ = run(capsys, "templates", "--json")
    rows = json.loads(out)
    assert code == 0
    assert [(r["name"], r["version"]) for r in rows] == _versions()
    assert [(r["name"], r["version"]) for r in rows if r["latest"]] == \
        [(name, catalog().versions(name)[-1]) for name in TEMPLATE_NAMES]
    smp = next(r for r in rows if r["name"] == "llama-pretrain-smp")
    assert (smp["strategy"], smp["instance_type"], smp["default"]) == ("smp", "ml.p4d.24xlarge", False)


def _versions() -> list[tuple[str, str]]:
    return [(name, version) for name in TEMPLATE_NAMES for version in catalog().versions(name)]


def test_templates_show_prints_the_version(capsys):
    code, out, _ = run(capsys, "templates", "show", "gpt2-ddp@latest")
    assert code == 0
    assert json.loads(out)["distribution"]["strategy"] == "ddp"


def test_render_prints_a_dry_run_request(capsys):
    code, out, err = run(
        capsys,
        "render",
        "llama-pretrain-fsdp@1.0.0",
        "--run-name",
        "exp1",
        "--set",
        "max_steps=100",
        "--set",
        "lr=1e-4",
    )
    assert code == 0
    request = json.loads(out)
    assert request["TrainingJobName"] == "llmtrain-dev-default-exp1-a1"
    assert request["HyperParameters"]["max_steps"] == "100"
    assert request["HyperParameters"]["lr"] == "0.0001"
    assert "dry run" in err and "config/dev.yaml" in err
    assert "DRYRUN" in request["RoleArn"]


def test_render_as_a_team_of_an_environment(capsys):
    """prod has two teams: render asks which, then renders with the team's prefix, limits and data."""
    prod = ("render", "gpt2-ddp", "--run-name", "r1", "--env", "prod")
    code, _, err = run(capsys, *prod)
    assert code == 2
    assert "environment 'prod' has several teams (pretrain, finetune): choose one with --team" in err
    code, _, err = run(capsys, *prod, "--team", "pretrain")
    assert code == 2 and "team 'pretrain': template 'gpt2-ddp' is not one of its templates" in err
    code, _, err = run(capsys, *prod, "--team", "ops")
    assert code == 2 and "has no team 'ops'; its teams: pretrain, finetune" in err

    code, out, err = run(capsys, *prod, "--team", "finetune")
    assert code == 0, err
    request = json.loads(out)
    assert request["TrainingJobName"] == "llmtrain-prod-finetune-r1-a1"
    assert "llmtrain-prod-finetune-sagemaker-execution" in request["RoleArn"]
    # The template's default channel (a relative prefix) lies in the team's datasets.
    (train,) = [c for c in request["InputDataConfig"] if c["ChannelName"] == "train"]
    assert train["DataSource"]["S3DataSource"]["S3Uri"] == (
        "s3://llmtrain-prod-datasets-222222222222-us-west-2/teams/finetune/tokens/sst2/train/"
    )
    assert request["EnableInterContainerTrafficEncryption"] is True
    bigger = ("--set", "instance_count=8", "--set", "instance_type=ml.p4d.24xlarge")
    code, _, err = run(capsys, *prod, "--team", "finetune", *bigger)
    assert code == 2 and "team 'finetune': instance_count 8 is above its cap of 4 instances per job" in err


def test_render_from_stack_outputs_is_launchable(capsys, tmp_path):
    platform = platform_context()
    outputs = {
        "llmtrain-dev-network": {
            StackOutput.SUBNET_IDS: ",".join(platform.subnet_ids),
            StackOutput.SECURITY_GROUP_ID: platform.security_group_ids[0],
        },
        "llmtrain-dev-storage": {
            StackOutput.KEY_ARN: platform.kms_key_arn,
            StackOutput.DATASETS_BUCKET: "real-datasets",
            StackOutput.CHECKPOINTS_BUCKET: "real-checkpoints",
            StackOutput.ARTIFACTS_BUCKET: "real-artifacts",
            StackOutput.CODE_BUCKET: "real-code",
        },
        "llmtrain-dev-access": {StackOutput.EXECUTION_ROLE_ARN: "arn:aws:iam::111111111111:role/exec"},
        "llmtrain-prod-storage": {StackOutput.CODE_BUCKET: "not-this-one"},
    }
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps(outputs))
    code, out, err = run(capsys, "render", "gpt2-ddp", "--run-name", "r2", "--outputs", str(path))
    assert code == 0 and "dry run" not in err
    request = json.loads(out)
    assert request["RoleArn"] == "arn:aws:iam::111111111111:role/exec"
    assert json.loads(request["HyperParameters"]["sagemaker_submit_directory"]).startswith("s3://real-code/")
    del outputs["llmtrain-dev-storage"][StackOutput.CODE_BUCKET]
    path.write_text(json.dumps(outputs))
    code, _, err = run(capsys, "render", "gpt2-ddp", "--run-name", "r2", "--outputs", str(path))
    assert code == 2 and "the stack outputs lack 'CodeBucketName'" in err


def test_render_with_a_platform_file(capsys, tmp_path):
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(platform_context().to_dict()))
    code, out, _ = run(
        capsys,
        "render",
        "byo-script",
        "--run-name",
        "r3",
        "--platform",
        str(path),
        "--attempt",
        "2",
        "--instance-type",
        "ml.g5.4xlarge",
        "--owner",
        "ada",
    )
    request = json.loads(out)
    assert code == 0
    assert request["TrainingJobName"] == "llmtrain-test-r3-a2"
    assert request["ResourceConfig"]["InstanceType"] == "ml.g5.4xlarge"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["render", "nope", "--run-name", "r"], "unknown template 'nope'"),
        (["render", "gpt2-ddp@7.0.0", "--run-name", "r"], "has no version '7.0.0'"),
        (
            ["render", "gpt2-ddp", "--run-name", "r", "--set", "zero_stage=3"],
            "override 'zero_stage': gpt2-ddp@1.3.0 does not allow overriding it",
        ),
        (["render", "gpt2-ddp", "--run-name", "r", "--set", "max_steps=-5"], "is below the minimum 1"),
        (
            ["render", "gpt2-ddp", "--run-name", "r", "--set", "instance_count=2"],
            "more than one node needs an EFA-capable instance type",
        ),
        (["render", "gpt2-ddp", "--run-name", "bad_name"], "run input 'run_name'"),
        (["render", "gpt2-ddp", "--run-name", "r", "--env", "staging"], "--env staging: no "),
        (["templates", "show", "gpt2-ddp@x"], "not a semantic version"),
    ],
)
def test_invalid_input_exits_2_with_a_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert message in err
    assert err.startswith(f"llmtrain {argv[0]}: error: ")


def test_template_not_enabled_in_the_environment(capsys, tmp_path):
    config = tmp_path / "config"
    config.mkdir()
    data = yaml.safe_load((REPO_ROOT / "config" / "dev.yaml").read_text())
    data["job_templates"]["enabled"] = ["gpt2-ddp"]
    (config / "dev.yaml").write_text(yaml.safe_dump(data))
    code, _, err = run(capsys, "render", "byo-script", "--run-name", "r", "--config-dir", str(config))
    assert code == 2
    assert "template 'byo-script' is not enabled in environment 'dev'" in err


def test_argparse_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["render", "gpt2-ddp"])
    assert exit_info.value.code == 2
    assert "--run-name" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["render", "start", "run"])
def test_set_with_a_space_instead_of_equals_says_how_to_write_it(capsys, command):
    """`--set max_steps 5` is a usage error naming the fix, before anything else is looked at."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "gpt2-ddp", "--run-name", "r", "--set", "max_steps", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'max_steps' is not KEY=VALUE" in err and "--set max_steps=" in err
    assert "Traceback" not in err


def test_version_names_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmtrain {metadata.version('llm-sagemaker-platform')}"


def test_misspelled_names_get_a_suggestion(capsys):
    code, _, err = run(capsys, "render", "gpt2-dp", "--run-name", "r")
    assert code == 2 and "unknown template 'gpt2-dp' (did you mean 'gpt2-ddp'?)" in err
    code, _, err = run(capsys, "render", "gpt2-ddp@1.1.1", "--run-name", "r")
    assert code == 2 and "has no version '1.1.1'; available: 1.0.0, 1.1.0" in err


def test_lock_check_and_lock_a_new_version(capsys, tmp_path):
    code, out, _ = run(capsys, "templates", "lock", "--check")
    assert code == 0 and "published and unchanged" in out

    folder = copy_catalog(tmp_path)
    shutil.copy(folder / "gpt2-ddp" / "1.0.0.yaml", folder / "gpt2-ddp" / "1.0.1.yaml")
    path = folder / "gpt2-ddp" / "1.0.1.yaml"
    path.write_text(path.read_text().replace("version: 1.0.0", "version: 1.0.1"))
    code, _, err = run(capsys, "templates", "lock", "--check", "--catalog", str(folder))
    assert code == 2 and "gpt2-ddp@1.0.1 is not published" in err
    code, out, _ = run(capsys, "templates", "--catalog", str(folder), "lock")
    assert code == 0 and out.strip() == "locked gpt2-ddp@1.0.1"
    code, out, _ = run(capsys, "templates", "lock", "--check", "--catalog", str(folder))
    assert code == 0


def test_lock_a_catalog_of_ones_own_with_its_code_beside_it(capsys, tmp_path):
    """Another team's catalog (examples/cdk_consumer): its code.source paths are relative to its own
    project folder, which --code-root names."""
    project = tmp_path / "acme"
    example = REPO_ROOT / "examples" / "cdk_consumer"
    shutil.copytree(example / "templates" / "acme-charlm", project / "templates" / "acme-charlm")
    shutil.copytree(example / "training", project / "training", ignore=shutil.ignore_patterns("__pycache__"))
    folder, project = str(project / "templates"), str(project)
    code, _, err = run(capsys, "templates", "lock", "--catalog", folder)
    assert code == 2 and f"code folder {REPO_ROOT / 'training'} does not exist" in err
    code, out, _ = run(capsys, "templates", "lock", "--catalog", folder, "--code-root", project)
    assert code == 0 and out.strip() == "locked acme-charlm@1.0.0"
    # The same content as the example's own lock: the hashes depend on the files, not on where they are.
    lock = "templates/catalog.lock"
    assert (Path(project) / lock).read_text() == (example / lock).read_text()
    code, out, _ = run(capsys, "templates", "lock", "--check", "--catalog", folder, "--code-root", project)
    assert code == 0 and "published and unchanged" in out


def test_console_script_runs():
    script = Path(sys.executable).parent / "llmtrain"
    result = subprocess.run([str(script), "templates", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert any(r["name"] == "llama-pretrain-fsdp" and r["version"] == "1.0.0" for r in rows)


def test_run_local_names_the_install_commands_for_missing_packages(monkeypatch):
    """Where the toolkit or a pin of the training program is missing, `run --local` says what to install
    (torch first, the CPU build) instead of failing inside the job."""
    from llmtrain.commands import run as run_command

    installed = metadata.version

    def without_peft(name):
        if name == "peft":
            raise metadata.PackageNotFoundError(name)
        return "0.0.1" if name == "transformers" else installed(name)

    monkeypatch.setattr(metadata, "version", without_peft)
    with pytest.raises(LlmtrainError) as error:
        run_command.require_local_run_packages()
    message = str(error.value)
    assert "peft==0.21.2 (not installed)" in message and "transformers==5.23.0 (have 0.0.1)" in message
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in message
    assert "pip install 'llm-sagemaker-platform[local]'" in message
    assert f"pip install -r {REPO_ROOT / 'training_jobs' / 'requirements.txt'}" in message


def test_data_prepare_names_its_extra_when_the_tokenizer_packages_are_missing(monkeypatch, tmp_path, capsys):
    """The base install (what llmtrain-constructs brings) has no transformers: `data prepare` says which
    extra adds it, before running anything. The distribution's metadata is this checkout's pyproject.toml
    (an editable install may predate it); the installed wheel's is read in test_consumer_example.py."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = [*project["dependencies"]] + [
        f"{line}; extra == {extra!r}" for extra, lines in extras.items() for line in lines
    ]
    installed = metadata.version

    def without_transformers(name):
        if name == "transformers":
            raise metadata.PackageNotFoundError(name)
        return installed(name)

    platform = "llm-sagemaker-platform"
    monkeypatch.setattr(metadata, "requires", lambda name: declared if name == platform else None)
    monkeypatch.setattr(metadata, "version", without_transformers)
    (tmp_path / "notes.txt").write_text("some words\n")
    code = main(["data", "prepare", "--input", str(tmp_path / "notes.txt"), "--output", str(tmp_path / "t")])
    error = capsys.readouterr().err
    assert code == 2 and "lacks: transformers" in error and "(not installed)" in error
    assert "pip install 'llm-sagemaker-platform[data]'" in error and not (tmp_path / "t").exists()


def test_an_invalid_environment_file_fails_cdk_synth_with_its_message_only(tmp_path):
    """`cdk synth` runs app.py: a bad config/<env>.yaml is one line saying what to fix, exit 1."""
    (tmp_path / "dev.yaml").write_text((REPO_ROOT / "config" / "dev.yaml").read_text().replace(
        "vpc_cidr: 10.40.0.0/16", "vpc_cidr: 10.40.0.0/33"))
    env = {**os.environ, "CDK_CONTEXT_JSON": json.dumps({"config_dir": str(tmp_path)}),
           "CDK_OUTDIR": str(tmp_path / "out")}
    env["PATH"] = f"{REPO_ROOT / 'node_modules' / '.bin'}{os.pathsep}{env['PATH']}"  # the pinned Node
    result = subprocess.run([sys.executable, "app.py"], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and "dev.yaml" in result.stderr and "vpc_cidr" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 3
