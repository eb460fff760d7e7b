"""Another account's CDK app (examples/cdk_consumer) on the installed construct library.

Both wheels (llmtrain and llmtrain-constructs) are built and installed into a new virtual environment
outside the checkout (tests/support/wheel_install.py: it sees only what the wheels declare), the
example is copied out of the checkout, and `cdk synth` (the pinned CDK CLI) synthesizes its app there,
without AWS credentials or network, with cdk-nag: its own catalog
(one template, its own lock, its own training code) and a template of the platform's catalog that the
llmtrain wheel ships. Then cfn-lint and checkov read what it synthesized.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from infra_helpers import cfn_lint_unexplained, checkov_reports
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from wheel_install import CONSTRUCTS_SOURCES, LLMTRAIN_SOURCES, Wheel, build_wheel, provide

from llmtrain.core.catalog import Catalog
from training_constructs.lambda_code import LAMBDA_RUNTIME, stage_lambda_code
from training_constructs.launcher import VENDORED_PACKAGES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cdk_consumer"
REGION = "eu-west-1"
slow = pytest.mark.slow


def example_catalog() -> Catalog:
    return Catalog.load(root=EXAMPLE / "templates", repo_root=EXAMPLE)


def test_the_examples_catalog_is_published_and_its_program_trains_and_resumes(tmp_path):
    catalog = example_catalog()
    catalog.check_lock()
    (spec,) = catalog.all()
    assert spec.ref == "acme-charlm@1.0.0" and not spec.code.is_platform
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text((ROOT / "README.md").read_text()[:5000])
    program = [sys.executable, str(EXAMPLE / spec.code.source / spec.code.entry_point)]
    tiny = ["--hidden_size", "16", "--num_layers", "1", "--sequence_length", "16"]
    places = ["--train_dir", str(data), "--model_dir", str(tmp_path / "model"),
              "--checkpoint_dir", str(tmp_path / "checkpoints")]

    def train(steps: int) -> list[str]:
        run = subprocess.run([*program, *places, *tiny, "--max_steps", str(steps)], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        return run.stdout.splitlines()

    assert [line.split(" loss=")[0] for line in train(2)] == ["[metrics] step=1", "[metrics] step=2"]
    assert [line.split(" loss=")[0] for line in train(3)] == [
        "resumed from step-2.pt (step 2)", "[metrics] step=3"
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2.pt", "step-3.pt"]
    assert (tmp_path / "model" / "model.pt").is_file()


def documented_commands() -> list[str]:
    """The commands of the example's README (its bash block), without their comments."""
    block = (EXAMPLE / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def documented(prefix: str) -> str:
    [command] = [command for command in documented_commands() if command.startswith(prefix)]
    return command


def test_the_readme_documents_every_step_from_a_new_folder():
    """A new virtual environment, the wheels and PyPI (not `--no-index`: the wheels require aws-cdk-lib
    and more, which no release holds), the CLI and its Node, the synth, torch to train here, a run."""
    assert [command.split()[0:2] for command in documented_commands()] == [
        ["python3", "-m"], ["pip", "install"], ["npm", "ci"], ["npx", "cdk"], ["llmtrain", "templates"],
        ["pip", "install"], ["SM_CHANNEL_TRAIN=data/", "SM_MODEL_DIR=out/"],
    ]
    assert "--no-index" not in documented("pip install --find-links")


def test_the_construct_readme_shows_the_examples_cdk_json_and_its_pinned_cli_and_node():
    """constructs/README.md shows the consumer's cdk.json (its app on the venv's python3) and the
    package.json pins of the CDK CLI and of a supported Node (issue 36), as the example has them."""
    readme = (ROOT / "constructs" / "README.md").read_text()
    shown = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", readme, flags=re.S)]
    assert json.loads((EXAMPLE / "cdk.json").read_text()) in shown
    pins = json.loads((EXAMPLE / "package.json").read_text())["devDependencies"]
    assert {"devDependencies": pins, "private": True} in shown
    assert pins == json.loads((ROOT / "package.json").read_text())["devDependencies"]
    assert int(pins["node"].split(".")[0]) in (22, 24)


@dataclass(frozen=True)
class Installed:
    place: Path
    env: dict[str, str]
    app: Path

    def run(self, *argv: str, cwd: Path | None = None, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), cwd=cwd or self.place, env=self.env, capture_output=True, text=True,
                              **kwargs)

    def documented(self, prefix: str, **kwargs) -> subprocess.CompletedProcess:
        """The README's command that starts with `prefix`, as a shell runs it in the app's folder."""
        return self.run("bash", "-c", documented(prefix), cwd=self.app, **kwargs)


@dataclass(frozen=True)
class Example:
    """The example copied out of the checkout, with both wheels of this repository in its `wheels/`."""

    place: Path
    app: Path
    llmtrain: Wheel
    constructs: Wheel


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Example:
    place = tmp_path_factory.mktemp("consumer")
    app = place / "acme"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__", "cdk.out", "node_modules"))
    llmtrain = build_wheel(ROOT, LLMTRAIN_SOURCES, place)
    constructs = build_wheel(ROOT / "constructs", CONSTRUCTS_SOURCES, place, extras=("nag",))
    (app / "wheels").mkdir()
    for wheel in (llmtrain, constructs):
        shutil.copy2(wheel.path, app / "wheels")
    return Example(place, app, llmtrain, constructs)


@slow
def test_the_documented_install_resolves_from_the_wheels_and_pypi(example):
    """The README's `pip install` line in a new virtual environment holding nothing: pip finds the two
    wheels in `wheels/` and every package they require on PyPI (resolved, not downloaded: --dry-run)."""
    bare = example.place / "bare"
    subprocess.run([sys.executable, "-m", "venv", str(bare)], check=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))},
           "PATH": f"{bare / 'bin'}{os.pathsep}/usr/bin:/bin"}
    report = example.place / "resolved.json"
    command = f"{documented('pip install --find-links')} --dry-run --quiet --report {report}"
    resolved = subprocess.run(["bash", "-c", command], cwd=example.app, env=env, capture_output=True,
                              text=True, timeout=600)
    assert resolved.returncode == 0, resolved.stderr[-3000:]
    found = {canonicalize_name(item["metadata"]["name"]): item["download_info"]["url"]
             for item in json.loads(report.read_text())["install"]}
    wheels = (example.app / "wheels").as_uri()
    ours = {name for name, url in found.items() if url.startswith(wheels)}
    assert ours == {"llmtrain-constructs", "llm-sagemaker-platform"}, found
    assert {"aws-cdk-lib", "constructs", "cdk-nag", "boto3", "pyyaml"} <= set(found) - ours
    assert "torch" not in found


@pytest.fixture(scope="module")
def consumer(example) -> Installed:
    """The README's `pip install` line run in a new virtual environment outside the checkout that
    already holds what the wheels require (linked from this project's environment, so that nothing is
    downloaded: tests/support/wheel_install.py): it installs the two wheels from `wheels/`."""
    env = provide(example.place, [example.constructs], available=[example.llmtrain])
    installed = Installed(example.place, env, example.app)
    pip = installed.documented("pip install --find-links", timeout=600)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    platform, constructs = (tomllib.loads((folder / "pyproject.toml").read_text())["project"]["version"]
                            for folder in (ROOT, ROOT / "constructs"))
    wheels = f"llm-sagemaker-platform-{platform} llmtrain-constructs-{constructs}"
    assert f"Successfully installed {wheels}" in pip.stdout, pip.stdout[-3000:]
    return installed


@pytest.fixture(scope="module")
def synthesized(consumer) -> Path:
    """The example synthesized with the README's `npx cdk synth` in the new virtual environment,
    outside the checkout: its cdk.out."""
    app = consumer.app
    where = ("import importlib.util as u\n"
             "for name in ('training_constructs', 'llmtrain'): print(u.find_spec(name).origin)")
    located = consumer.run("python", "-c", where, cwd=app, check=True)
    assert all(origin.startswith(str(consumer.place / "venv")) for origin in located.stdout.split()), (
        located.stdout
    )
    # `npm ci` would install what package-lock.json pins, which is what this project's lock pins: its
    # node_modules (the CDK CLI and Node 24) stands in for the download.
    example_lock, platform_lock = (json.loads(path.read_text())["packages"]
                                   for path in (app / "package-lock.json", ROOT / "package-lock.json"))
    assert example_lock[""]["devDependencies"] == platform_lock[""]["devDependencies"]
    assert {k: v for k, v in example_lock.items() if k} == {k: v for k, v in platform_lock.items() if k}
    (app / "node_modules").symlink_to(ROOT / "node_modules")
    # The functions' packages come from their wheels for the Lambda runtime, which a first synth fetches
    # into the wheel cache (constructs/README.md, "Install"): fetched here, with this checkout's network,
    # so that the synth below needs none (the installed wheels pin the same package versions).
    stage_lambda_code(vendored_packages=VENDORED_PACKAGES, staging_root=consumer.place / "staging")
    # `npx cdk synth` as its platform engineer runs it (the pinned CLI on the pinned Node, which runs
    # cdk.json's app), with no AWS credentials and no network: the CLI would look up what the app left
    # missing (issue 25: the stack's availability zones) and fail without credentials.
    offline = offline_without_credentials(consumer.env, consumer.place)
    synth = subprocess.run(["bash", "-c", documented("npx cdk synth")], cwd=app, env=offline,
                           capture_output=True, text=True, timeout=900)
    # cdk-nag runs in the app: an unacknowledged finding fails the synth.
    assert synth.returncode == 0, synth.stdout[-3000:] + synth.stderr[-3000:]
    # The CLI and jsii run on the Node package.json pins (issue 36): neither calls it end-of-life.
    assert "end-of-life" not in synth.stdout + synth.stderr, synth.stderr[-3000:]
    outdir = app / "cdk.out"
    assert "missing" not in json.loads((outdir / "manifest.json").read_text())
    return outdir


@slow
def test_the_documented_training_command_runs_with_the_documented_torch(example):
    """The README's torch line, in a new virtual environment holding this project's torch (2.13.0, the
    CPU build; PyTorch's CPU index is out of the test machine's reach), finds it installed; then the
    README's run of training/train_lm.py trains its 20 steps on a folder of text."""
    env = provide(example.place / "trainer", [], also=["torch==2.13.0"])
    trainer = Installed(example.place / "trainer", env, example.app)
    torch = trainer.documented("pip install torch", timeout=600)
    assert torch.returncode == 0 and "Requirement already satisfied: torch==2.13.0" in torch.stdout, (
        torch.stdout + torch.stderr
    )
    (example.app / "data").mkdir()
    (example.app / "data" / "notes.txt").write_text((ROOT / "README.md").read_text()[:20000])
    run = trainer.documented("SM_CHANNEL_TRAIN=", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1].startswith("[metrics] step=20 "), run.stdout[-2000:]
    assert (example.app / "out" / "model.pt").is_file() and (example.app / "ckpt").is_dir()


def offline_without_credentials(env: dict[str, str], place: Path) -> dict[str, str]:
    """`env` without AWS credentials or configuration, and with every HTTP(S) connection sent to a
    closed local port (the SDKs, the CDK CLI and pip honour the proxy variables)."""
    closed = "http://127.0.0.1:9"
    return {
        **{key: value for key, value in env.items() if not key.startswith("AWS_")},
        "AWS_CONFIG_FILE": str(place / "no-aws" / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(place / "no-aws" / "credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        **{name: closed for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")},
        "NO_PROXY": "", "no_proxy": "",
        "CDK_DISABLE_CLI_TELEMETRY": "true",
        "CDK_DISABLE_VERSION_CHECK": "1",
    }


@slow
def test_the_construct_library_installs_without_the_training_and_plotting_packages(consumer, tmp_path):
    """Synthesis never tokenizes or plots: installing llmtrain-constructs brings neither transformers nor
    matplotlib (nor numpy); the CLI it brings along says which extra `data prepare` needs."""
    heavy = "('transformers', 'matplotlib', 'numpy', 'torch')"
    probe = f"import importlib.util as u; print([n for n in {heavy} if u.find_spec(n)])"
    found = consumer.run("python", "-c", probe)
    assert found.returncode == 0 and found.stdout.strip() == "[]", found.stdout + found.stderr
    (tmp_path / "notes.txt").write_text("a few words\n" * 100)
    prepare = consumer.run("llmtrain", "data", "prepare", "--input", "notes.txt", "--output", "tokens",
                           cwd=tmp_path)
    assert prepare.returncode == 2, prepare.stdout + prepare.stderr
    assert "pip install 'llm-sagemaker-platform[data]'" in prepare.stderr
    assert "transformers" in prepare.stderr and "Traceback" not in prepare.stderr
    assert not (tmp_path / "tokens").exists()


def test_the_install_instructions_name_only_what_pip_can_install():
    """constructs/README.md's install lines are a checkout's folders or a release's wheels by URL (at
    today's versions): llmtrain-constructs is on no package index, so `llmtrain-constructs[nag]>=1`
    cannot work."""
    readme = (ROOT / "constructs" / "README.md").read_text()
    block = readme.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    arguments = [argument for command in commands if command.startswith("pip install")
                 for argument in shlex.split(command)[2:] if not argument.startswith("-")]
    versions = {name: tomllib.loads((folder / "pyproject.toml").read_text())["project"]["version"]
                for name, folder in (("llmtrain-constructs", ROOT / "constructs"),
                                     ("llm-sagemaker-platform", ROOT))}
    kinds = set()
    for argument in arguments:
        if argument.startswith("."):
            folder = ROOT / argument.split("[", 1)[0]
            assert (folder / "pyproject.toml").is_file(), f"{argument}: not a project folder of a checkout"
            kinds.add("checkout")
            continue
        requirement = Requirement(argument)
        assert requirement.url, f"{argument}: on no package index; name a release's wheel by its URL"
        wheel = requirement.url.rsplit("/", 1)[1]
        assert wheel.startswith(f"{requirement.name.replace('-', '_')}-{versions[requirement.name]}-"), wheel
        kinds.add("release")
    assert kinds == {"checkout", "release"}, arguments


@slow
def test_the_example_synthesizes_nag_and_cfn_lint_clean_on_the_installed_wheels(synthesized):
    report = json.loads((synthesized / "validation-report.json").read_text())
    assert [v for plugin in report["pluginReports"] for v in plugin["violations"]] == []
    templates = {path.name: json.loads(path.read_text()) for path in synthesized.glob("*.template.json")}
    assert sorted(templates) == ["AcmeTraining.template.json", "AcmeTrainingData.template.json"]
    for name, template in templates.items():
        assert cfn_lint_unexplained(template, REGION) == [], name
    handlers = {
        resource["Properties"]["Handler"]: resource["Properties"]["Runtime"]
        for template in templates.values()
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::Lambda::Function"
        and resource["Properties"].get("Handler", "").startswith("llmtrain.")
    }
    assert len(handlers) == 6 and set(handlers.values()) == {LAMBDA_RUNTIME.name}, handlers


@slow
def test_checkov_finds_nothing_left_unacknowledged(synthesized):
    [report] = checkov_reports([synthesized])
    assert report.read_every_resource
    assert report.scanned == ["AcmeTraining.template.json", "AcmeTrainingData.template.json"]
    assert report.failed == []
    assert report.skipped  # the constructs' acknowledgments


@slow
def test_each_catalog_deploys_its_frozen_code_and_the_functions_know_both_templates(synthesized):
    assets = json.loads((synthesized / "AcmeTraining.assets.json").read_text())["files"]
    folders = [synthesized / asset["source"]["path"] for asset in assets.values()]
    deployed = sorted(path.read_bytes() for folder in folders for path in folder.glob("sourcedir.tar.gz"))
    acme, platform = example_catalog(), Catalog.load()
    frozen = [catalog.sourcedir(catalog.resolve(ref))
              for catalog, ref in ((acme, "acme-charlm@1.0.0"), (platform, "gpt2-ddp@1.1.0"))]
    assert deployed == sorted(frozen)
    registries = [folder / "templates" for folder in folders if (folder / "llmtrain" / "handlers").is_dir()]
    assert sorted(p.relative_to(r).as_posix() for r in registries for p in r.rglob("*.yaml")) == [
        "acme-charlm/1.0.0.yaml", "gpt2-ddp/1.1.0.yaml"
    ]
    # The functions carry the llmtrain package, not the catalog and programs its wheel bundles.
    assert not any((folder / "llmtrain" / "_bundle").exists() for folder in folders)
