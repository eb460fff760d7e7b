"""The CLI: `llmtrain templates [--json]`, `templates show|lock`, `llmtrain render`; bad input exits 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from templates_support import REPO_ROOT, TEMPLATE_NAMES, catalog, copy_catalog, platform_context

from llmtrain.cli import main
from llmtrain.environments import StackOutput


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
                                                    ["1.2.0", "fsdp", "ml.p4d.24xlarge", "2"]]
    assert fsdp[0].endswith(" default") and fsdp[2].endswith(" latest, default")


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
    assert request["TrainingJobName"] == "llmtrain-dev-exp1-a1"
    assert request["HyperParameters"]["max_steps"] == "100"
    assert request["HyperParameters"]["lr"] == "0.0001"
    assert "dry run" in err and "config/dev.yaml" in err
    assert "DRYRUN" in request["RoleArn"]


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
            "override 'zero_stage': gpt2-ddp@1.2.0 does not allow overriding it",
        ),
        (["render", "gpt2-ddp", "--run-name", "r", "--set", "max_steps=-5"], "is below the minimum 1"),
        (
            ["render", "gpt2-ddp", "--run-name", "r", "--set", "max_steps"],
            "write overrides as --set KEY=VALUE",
        ),
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


def test_console_script_runs():
    script = Path(sys.executable).parent / "llmtrain"
    result = subprocess.run([str(script), "templates", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert any(r["name"] == "llama-pretrain-fsdp" and r["version"] == "1.0.0" for r in rows)
