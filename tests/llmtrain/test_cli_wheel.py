"""`pip install` outside the repository: the wheel, in a new virtual environment, from an empty folder.

The wheel is built from a copy of the sources and installed into a new virtual environment outside
the checkout, offline (tests/support/wheel_install.py: the environment sees exactly the distributions
the wheel declares, linked from this project's environment, plus what a local run needs on top: torch,
which a user installs first, and the training program's `requirements.txt`). A command importing a
package the wheel does not declare fails. Everything else is the installed wheel: llmtrain from the new
site-packages, the catalog, the training program and the example data from its package data.

In that environment the README's "Train" commands run as written, in order, from a folder holding
`notes.txt` and `./my-tokenizer`: `data prepare` on the text file, the local run of the same template,
and the cloud steps (`data upload`, `start`, `status`, `runs`) against a moto server (its S3, SSM, STS
and Step Functions, with environment dev's record for team nlp and a stand-in launcher state machine,
as tests/llmtrain/deployed_support.py writes them), where `start` reaches the launcher: a Step
Functions execution. The launcher's real definition runs in test_cli_deployed.py. The section's
later block (tuning and base models) is not run here: a local tune is eight local runs
(tests/e2e/test_local_tune.py runs one), a cloud tune needs the launcher's real definition
(test_launcher_tune.py) and a base model JumpStart's catalogue (test_tune_cli.py, test_jumpstart.py).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import tomllib
import urllib.request
from pathlib import Path

import boto3
import pytest
from deployed_support import ACCOUNT, BUCKET, REGION, deploy_environment, moto_credentials, team_access
from moto.server import ThreadedMotoServer
from wheel_install import LLMTRAIN_SOURCES, Wheel, build_wheel, install

from llmtrain.local.toolkit import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What the user installs besides the wheel for `run --local` (README, "Install the CLI").
LOCAL_RUN_EXTRAS = ("torch", *(ROOT / "training_jobs" / "requirements.txt").read_text().splitlines())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(ROOT, LLMTRAIN_SOURCES, tmp_path_factory.mktemp("wheel")).path


@pytest.fixture(scope="module")
def installed(tmp_path_factory, wheel) -> dict[str, str]:
    """A new virtual environment with the wheel, its [local] extra and what a local run needs
    besides; returns the environment to run it in."""
    env = install(tmp_path_factory.mktemp("wheel-install"), [Wheel(wheel, ("local",))], also=LOCAL_RUN_EXTRAS)
    env.update({"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""})
    return env


@pytest.fixture(scope="module")
def installed_data(tmp_path_factory, wheel) -> dict[str, str]:
    """A new virtual environment with the CLI's wheel and its [data] extra alone (no torch), the
    install `llmtrain data prepare` names."""
    return install(tmp_path_factory.mktemp("data-install"), [Wheel(wheel, ("data",))])


def _llmtrain(env, cwd: Path, *argv: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["llmtrain", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_installed_cli_works_from_an_empty_folder(installed, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.run(
        [
            "python",
            "-c",
            "import importlib.util, llmtrain, llmtrain.core.sourcedir as s, training_jobs.contract as c; "
            "print(llmtrain.__file__); print(s.repository_root()); print(c.__file__); "
            "print(importlib.util.find_spec('training_jobs.trainer'))",
        ],
        cwd=work,
        env=installed,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not where[0].startswith(str(ROOT)) and "site-packages" in where[0]
    assert where[1].endswith("site-packages/llmtrain/_bundle")
    # The training contract is a package of the wheel; the program itself is only in the bundle.
    assert where[2].endswith("site-packages/training_jobs/contract/__init__.py") and where[3] == "None"

    version = _llmtrain(installed, work, "--version")
    assert (
        version.returncode == 0
        and version.stdout.strip() == f"llmtrain {PROJECT['version']}"  # the wheel's, from pyproject.toml
    )

    listing = _llmtrain(installed, work, "templates")
    assert listing.returncode == 0, listing.stderr
    assert "llama-pretrain-fsdp" in listing.stdout and "byo-script" in listing.stdout

    rendered = _llmtrain(installed, work, "render", "llama-pretrain-fsdp", "--run-name", "r1")
    assert rendered.returncode == 0, rendered.stderr
    assert '"TrainingJobName": "llmtrain-dev-default-r1-a1"' in rendered.stdout
    assert "dry run" in rendered.stderr and "stand-in environment" in rendered.stderr
    # The planner's line: its price table ships in the wheel.
    assert "plan: fits" in rendered.stderr and "not available" not in rendered.stderr
    planned = _llmtrain(installed, work, "plan", "gpt2-ddp", "--json")
    assert planned.returncode == 0 and json.loads(planned.stdout)["fits"] is True, planned.stderr


# -- the README's "Train" section ----------------------------------------------------------------------

PLACEHOLDER = "DATASETS_BUCKET"  # the README's stand-in for the bucket `data upload` prints
# What the launcher's summary looks like when a run ends (the stand-in ends every run at once).
SUMMARY = {"status": "Completed", "message": "Run done: Completed\nAttempts: 1"}
STAND_IN = {"StartAt": "Summary", "States": {"Summary": {"Type": "Pass", "Result": SUMMARY, "End": True}}}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def readme_train_commands() -> list[list[str]]:
    """The commands of the README's "Train" section, continuation lines joined, comments dropped."""
    section = (ROOT / "README.md").read_text().split("\n## Train\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def _moto_config(url: str, execute: bool) -> None:
    body = json.dumps({"stepfunctions": {"execute_state_machine": execute}}).encode()
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/config", data=body, method="POST"))


@pytest.fixture
def cloud(monkeypatch):
    """Environment dev, with team nlp, deployed in a moto server; yields the variables that point the
    installed CLI's AWS clients at it."""
    url = f"http://127.0.0.1:{free_port()}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(url.rsplit(":", 1)[1]), verbose=False)
    server.start()
    try:
        _moto_config(url, execute=True)
        moto_credentials(monkeypatch)
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        arn = boto3.client("stepfunctions", region_name=REGION).create_state_machine(
            name="llmtrain-dev-nlp-launcher", definition=json.dumps(STAND_IN),
            roleArn=f"arn:aws:iam::{ACCOUNT}:role/launcher")["stateMachineArn"]
        deploy_environment(arn, teams=[team_access(arn, team="nlp")], with_dataset=False)
        yield {"AWS_ENDPOINT_URL": url, "AWS_DEFAULT_REGION": REGION, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing"}
    finally:
        _moto_config(url, execute=False)
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
        server.stop()


def _my_tokenizer(folder: Path) -> None:
    """A tokenizer of the user's own (byte-level BPE, 258 tokens, end-of-sequence id 1, with a chat
    template): not the platform's shipped one, so the run works only if the data's tokenizer travels
    with it."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(tokenizer_models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=258, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator([(ROOT / "README.md").read_text()], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))


def test_the_readmes_train_commands_run_as_written(installed, cloud, tmp_path):
    """prepare -> run --local -> upload -> start -> status -> runs, each exiting 0 as the README has it.

    notes.txt is 7.6 MB: with the byte-level tokenizer, 1% of it holds one evaluation step of the
    cloud run (16 ranks x 4,097 tokens), which `start` checks."""
    work = tmp_path / "work"
    work.mkdir()
    readme = (ROOT / "README.md").read_text()
    (work / "notes.txt").write_text((readme + "\n\n") * 640)
    _my_tokenizer(work / "my-tokenizer")
    env = {**installed, **cloud}
    commands = readme_train_commands()
    assert [argv[:3] for argv in commands] == [
        ["llmtrain", "data", "prepare"], ["llmtrain", "run", "--local"], ["llmtrain", "data", "upload"],
        ["llmtrain", "start", "llama-pretrain-fsdp"], ["llmtrain", "status", "notes-1"],
        ["llmtrain", "runs", "--env"]]
    outputs = []
    for argv in commands:
        if any(PLACEHOLDER in arg for arg in argv):
            printed = outputs[-1].split("llmtrain start TEMPLATE --run-name RUN", 1)[1].split()
            bucket = printed[printed.index("--set") + 1].split("/")[2]
            argv = [arg.replace(PLACEHOLDER, bucket) for arg in argv]
            # the README's --set options are what `data upload` printed
            channels = [a for a in argv if a.startswith("channels.")]
            assert channels == [a for a in printed if a.startswith("channels.")]
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        outputs.append(done.stdout)

    prepared = sorted(p.name for p in (work / "tokens").iterdir())
    assert prepared == ["preparation.json", "tokenizer", "train", "validation"]
    job = work / "runs" / "notes-local" / "jobs" / "local-notes-local-a1"
    summary = json.loads((job / "summary.json").read_text())
    assert summary["TrainingJobStatus"] == "Completed"
    assert set(json.loads((job / "algo-1" / "input" / "config" / "inputdataconfig.json").read_text())) == {
        "train", "validation", "tokenizer"}
    final = {m["MetricName"]: m["Value"] for m in summary["FinalMetricDataList"]}
    assert "eval:loss" in final  # the validation split was evaluated
    assert (work / "runs" / "notes-local" / "mlflow.db").is_file()  # the [local] extra's MLflow store
    assert f"tokenizer {job}/algo-1/input/data/tokenizer" in (job / "logs" / "algo-1.log").read_text()

    executions = boto3.client("stepfunctions", region_name=REGION).list_executions(
        stateMachineArn=f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:llmtrain-dev-nlp-launcher")
    (execution,) = executions["executions"]
    sent = json.loads(boto3.client("stepfunctions", region_name=REGION).describe_execution(
        executionArn=execution["executionArn"])["input"])
    assert sent["template"] == "llama-pretrain-fsdp" and sent["run_name"] == "notes-1"
    assert sent["overrides"] == {f"channels.{c}": f"s3://{BUCKET}/teams/nlp/notes/{c}/"
                                 for c in ("train", "validation", "tokenizer")}
    assert "execution SUCCEEDED" in outputs[4] and "Run done" in outputs[4]
    assert "notes-1" in outputs[5] and "SUCCEEDED" in outputs[5]
    assert sorted(p.name for p in work.iterdir()) == ["my-tokenizer", "notes.txt", "runs", "tokens"]


def test_chat_examples_are_prepared_with_the_data_extras_packages(installed_data, tmp_path):
    """--messages-key renders each conversation with the tokenizer's chat template: jinja2, which the
    wheel's [data] extra declares (transformers does not, and without torch nothing else brings it)."""
    _my_tokenizer(tmp_path / "my-tokenizer")
    chats = [{"messages": [{"role": "user", "content": f"Name colour {i}."},
                           {"role": "assistant", "content": "Red."}]} for i in range(20)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    prepared = _llmtrain(installed_data, tmp_path, "data", "prepare", "--input", "chats.jsonl",
                         "--messages-key", "messages", "--tokenizer", "my-tokenizer",
                         "--output", "chat-tokens", "--workers", "1")
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    manifest = json.loads((tmp_path / "chat-tokens" / "manifest.json").read_text())
    assert manifest["loss_mask"] is True and manifest["num_documents"] == 20


# -- `render --env` from the wheel (issue 36 item 4) ------------------------------------------------------


def documented_render_lines() -> list[list[str]]:
    """Every `llmtrain render ... --env ...` line of the README's and docs/templates.md's code blocks
    (the synopsis, with its [options], is no command)."""
    found = []
    for page in (ROOT / "README.md", ROOT / "docs" / "templates.md"):
        blocks = page.read_text().split("```")[1::2]
        for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
            if line.startswith("llmtrain render ") and " --env " in line and "[" not in line:
                found.append(shlex.split(line, comments=True))
    return found


def test_the_documented_render_env_lines_run_from_an_empty_folder(installed_data, tmp_path):
    """From an empty folder (no config/): a clearly marked stand-in of the named environment and team,
    whose errors never point inside site-packages; from a folder with config/, its environment file."""
    lines = [argv for argv in documented_render_lines() if "--config-dir" not in argv]
    assert len(lines) >= 2 and any("prod" in argv for argv in lines), lines
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in lines:
        rendered = _llmtrain(installed_data, empty, *argv[1:])
        assert rendered.returncode == 0, (argv, rendered.stderr)
        env = argv[argv.index("--env") + 1]
        team = argv[argv.index("--team") + 1] if "--team" in argv else "default"
        request = json.loads(rendered.stdout)
        assert request["TrainingJobName"].startswith(f"llmtrain-{env}-{team}-r1"), request["TrainingJobName"]
        assert f"a stand-in environment {env!r} (team {team!r}" in rendered.stderr
        assert "site-packages" not in rendered.stderr
    unknown = _llmtrain(installed_data, empty, "quotas", "--env", "dev")
    assert unknown.returncode == 2 and "site-packages" not in unknown.stderr
    assert "no environment files here" in unknown.stderr and "--config-dir" in unknown.stderr

    # A ./config of the working folder is the environments folder.
    mine = tmp_path / "mine"
    (mine / "config").mkdir(parents=True)
    (mine / "config" / "dev.yaml").write_text((ROOT / "config" / "dev.yaml").read_text())
    configured = _llmtrain(installed_data, mine, "render", "gpt2-ddp", "--run-name", "r1", "--env", "dev")
    assert configured.returncode == 0, configured.stderr
    assert "placeholders built from config/dev.yaml" in configured.stderr, configured.stderr
    missing = _llmtrain(installed_data, mine, "render", "gpt2-ddp", "--run-name", "r1", "--env", "prod")
    assert missing.returncode == 2
    assert "--env prod: no config/prod.yaml; environments there: dev" in missing.stderr
    assert "site-packages" not in missing.stderr
