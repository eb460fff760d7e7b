"""lambda_code: the Lambda functions' code folder, staged without Docker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import aws_cdk as cdk
import pytest
from aws_cdk import aws_lambda as lambda_
from infra_helpers import ROOT, resources_of_type

from llmtrain.core.catalog import Catalog
from training_constructs.lambda_code import (
    LAMBDA_ARCHITECTURE,
    LAMBDA_RUNTIME,
    VENDORED_VERSIONS,
    LambdaCodeError,
    lambda_code,
    stage_lambda_code,
)

# ELF header: 64-bit class at byte 4, the machine (little-endian) at bytes 18-19; 0xB7 is AArch64.
ELF_AARCH64 = 0xB7


def _files(folder) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


def test_the_folder_holds_llmtrain_and_yaml_with_its_licence(tmp_path):
    folder = stage_lambda_code(staging_root=tmp_path)
    files = _files(folder)
    assert "llmtrain/handlers/launcher.py" in files and "yaml/__init__.py" in files
    assert (
        "LICENSES/yaml" in files
        and b"Permission is hereby granted" in (folder / "LICENSES" / "yaml").read_bytes()
    )
    assert not any(name.endswith(".pyc") or "__pycache__" in name for name in files)


def test_compiled_packages_are_built_for_the_lambda_runtime_not_this_interpreter(tmp_path):
    """The synthesizing Python (3.11 here) and CPU do not matter: regex and PyYAML come from their
    wheels for Python 3.14 on arm64, the functions' runtime."""
    assert (LAMBDA_RUNTIME.name, LAMBDA_ARCHITECTURE.name) == ("python3.14", "arm64")
    folder = stage_lambda_code(vendored_packages=("regex",), staging_root=tmp_path)
    compiled = sorted(name for name in _files(folder) if name.endswith(".so"))
    assert compiled and all(name.endswith(".cpython-314-aarch64-linux-gnu.so") for name in compiled)
    assert any(name.startswith("regex/") for name in compiled)
    for name in compiled:
        header = (folder / name).read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == ELF_AARCH64, name
    assert not any(name.startswith("regex/tests/") for name in _files(folder))


def test_a_fetched_wheel_is_reused_without_the_network(tmp_path):
    cache = tmp_path / "wheels"
    first = stage_lambda_code(vendored_packages=("regex",), staging_root=tmp_path / "a", wheel_cache=cache)
    wheels = sorted(path.name for path in cache.iterdir())
    # pip is told to use no index when the cache holds the wheel: an empty proxy cannot answer
    again = stage_lambda_code(vendored_packages=("regex",), staging_root=tmp_path / "b", wheel_cache=cache)
    assert sorted(path.name for path in cache.iterdir()) == wheels
    assert first.name == again.name


def test_the_vendored_packages_are_the_versions_the_library_pins_whatever_is_installed(tmp_path):
    """Two apps on one release of the library deploy the same code asset even where one has another
    `regex` installed (issue 36): here a Python whose installed regex is 2024.4.16 stages the folder
    this one does, holding the pinned regex."""
    older = tmp_path / "older"
    (older / "regex-2024.4.16.dist-info").mkdir(parents=True)
    (older / "regex-2024.4.16.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: regex\n"
                                                                   "Version: 2024.4.16\n")
    stage = ("import importlib.metadata, sys; sys.path.insert(0, sys.argv[1]); "
             "from training_constructs.lambda_code import stage_lambda_code; "
             "print(importlib.metadata.version('regex')); "
             "print(stage_lambda_code(vendored_packages=('regex',), staging_root=sys.argv[2]).name)")
    other = subprocess.run([sys.executable, "-c", stage, str(older), str(tmp_path / "other")],
                           capture_output=True, text=True, timeout=300, env=_importable_here())
    assert other.returncode == 0, other.stderr
    assert other.stdout.split() == ["2024.4.16", stage_lambda_code(vendored_packages=("regex",),
                                                                    staging_root=tmp_path / "here").name]
    folder = tmp_path / "here" / other.stdout.split()[1]
    distribution, version = VENDORED_VERSIONS["regex"]
    assert (folder / f"{distribution}-{version}.dist-info").is_dir()
    pyyaml, pyyaml_version = VENDORED_VERSIONS["yaml"]
    assert (folder / f"{pyyaml.lower()}-{pyyaml_version}.dist-info").is_dir()


def test_the_pinned_versions_are_those_the_platform_is_tested_with():
    """requirements.txt pins what the functions vendor: the tests run the code the functions run."""
    pins = {line.split("==")[0].lower(): line.split("==")[1].strip()
            for line in (ROOT / "requirements.txt").read_text().splitlines() if "==" in line}
    assert {d.lower(): v for d, v in VENDORED_VERSIONS.values()} == {
        d.lower(): pins.get(d.lower()) for d, _ in VENDORED_VERSIONS.values()}


def _importable_here() -> dict[str, str]:
    """This process's environment, with its import path (the checkout's packages) for a child."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def test_staging_is_content_addressed(tmp_path):
    first = stage_lambda_code(extra_files={"data/a.json": b"{}"}, staging_root=tmp_path)
    again = stage_lambda_code(extra_files={"data/a.json": b"{}"}, staging_root=tmp_path)
    other = stage_lambda_code(extra_files={"data/a.json": b"[]"}, staging_root=tmp_path)
    assert first == again != other
    assert first.name != other.name and len(first.name) == 64
    assert (other / "data" / "a.json").read_bytes() == b"[]"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({first.name, other.name})  # no scratch left


def test_template_files_land_in_the_registry_layout(tmp_path):
    spec_file = Catalog.load().root / "gpt2-ddp" / "1.0.0.yaml"
    folder = stage_lambda_code(template_files=[spec_file], staging_root=tmp_path)
    assert (folder / "templates" / "gpt2-ddp" / "1.0.0.yaml").read_bytes() == spec_file.read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"extra_files": {"../escape.json": b""}}, "must be a relative path inside the asset"),
        ({"extra_files": {"/etc/passwd": b""}}, "must be a relative path inside the asset"),
        (
            {"vendored_packages": ("no_such_package_here",)},
            "'no_such_package_here' is not an installed package",
        ),
        ({"template_files": ["README.md"]}, "is not a template file"),
    ],
)
def test_bad_input_is_refused_with_what_to_do(tmp_path, kwargs, message):
    with pytest.raises(LambdaCodeError, match=message):
        stage_lambda_code(staging_root=tmp_path, **kwargs)


def test_the_asset_is_a_lambda_code(tmp_path):
    stack = cdk.Stack(cdk.App(), "Code")
    code = lambda_code(staging_root=tmp_path)
    function = lambda_.Function(
        stack,
        "F",
        code=code,
        handler="llmtrain.handlers.launcher.resolve",
        runtime=LAMBDA_RUNTIME,
    )
    assert function.node.default_child is not None


# The CDK's own BucketDeployment handler (it uploads the templates' code) has its runtime chosen by
# aws-cdk-lib, with no prop to change it; it moves with aws-cdk-lib upgrades.
CDK_PROVIDED_HANDLERS = ("CustomCDKBucketDeployment",)


def test_every_python_function_of_the_platform_runs_on_the_newest_runtime(platform):
    """Read off the synthesized templates of every environment: whatever Python synthesized them."""
    newest = max((name for name in dir(lambda_.Runtime) if name.startswith("PYTHON_3_")),
                  key=lambda name: int(name.removeprefix("PYTHON_3_")))
    runtimes = {}
    for scope, part, _, template in platform.all_templates():
        for logical_id, function in resources_of_type(template, "AWS::Lambda::Function").items():
            props = function["Properties"]
            if str(props.get("Runtime", "")).startswith("python") and \
                    not logical_id.startswith(CDK_PROVIDED_HANDLERS):
                runtimes[f"{scope}/{part}/{logical_id}"] = (props["Runtime"], tuple(props["Architectures"]))
    assert len(runtimes) >= 8, json.dumps(runtimes)
    assert set(runtimes.values()) == {(getattr(lambda_.Runtime, newest).name, ("arm64",))}


def test_the_asset_carries_the_functions_layers_and_no_cli_or_local_runner(tmp_path):
    files = _files(stage_lambda_code(staging_root=tmp_path))
    llmtrain_files = {name for name in files if name.startswith("llmtrain/")}
    layers = {name.split("/")[1] for name in llmtrain_files if name.count("/") > 1}
    assert layers == {"core", "planner", "lifecycle", "operations", "handlers"}
    assert "llmtrain/planner/prices.json" in files
    for outside in ("llmtrain/cli.py", "llmtrain/commands/", "llmtrain/local/", "llmtrain/client/"):
        assert not any(name.startswith(outside) for name in files), outside


def test_every_handler_imports_from_the_asset_alone(tmp_path):
    """The functions' entry points import with llmtrain taken from the asset only: nothing they need
    was left out. Compiled vendored packages are built for the Lambda runtime, so this interpreter's
    own copies of them are imported first."""
    folder = stage_lambda_code(staging_root=tmp_path, vendored_packages=("yaml", "regex"))
    script = (
        "import sys, yaml, regex\n"
        f"sys.path.insert(0, {str(folder)!r})\n"
        "import llmtrain\n"
        f"assert llmtrain.__file__.startswith({str(folder)!r}), llmtrain.__file__\n"
        "import llmtrain.handlers.launcher, llmtrain.handlers.queue, llmtrain.handlers.quotas\n"
        "import llmtrain.handlers.warm_pools, llmtrain.handlers.job_events\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('llmtrain.'))\n"
        "print(' '.join(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    assert "llmtrain.handlers.launcher" in loaded
    assert not [m for m in loaded if m.split(".")[1] in ("commands", "local", "client", "cli")]
