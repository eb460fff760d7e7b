"""lambda_code: the Lambda functions' code folder, staged without Docker."""

from __future__ import annotations

import platform
import sys
import sysconfig

import aws_cdk as cdk
import pytest
from aws_cdk import aws_lambda as lambda_

from llmtrain.catalog import Catalog
from training_constructs import lambda_code as module
from training_constructs.lambda_code import LambdaCodeError, lambda_code, matching_runtime, stage_lambda_code


def _files(folder) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


def test_the_folder_holds_llmtrain_and_pure_python_yaml(tmp_path):
    folder = stage_lambda_code(staging_root=tmp_path)
    files = _files(folder)
    assert "llmtrain/handlers/launcher.py" in files and "yaml/__init__.py" in files
    assert (
        "LICENSES/yaml" in files
        and b"Permission is hereby granted" in (folder / "LICENSES" / "yaml").read_bytes()
    )
    assert not any(name.endswith((".so", ".pyc")) or "__pycache__" in name for name in files)


def test_compiled_packages_come_with_their_extension_modules(tmp_path):
    files = _files(stage_lambda_code(vendored_packages=("regex",), staging_root=tmp_path))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert any(name.startswith("regex/") and name.endswith(suffix) for name in files)
    assert not any(name.startswith("regex/tests/") for name in files)


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
        runtime=lambda_.Runtime.PYTHON_3_12,
    )
    assert function.node.default_child is not None


def test_the_runtime_matches_this_interpreter():
    runtime, architecture = matching_runtime()
    assert runtime.name == f"python{sys.version_info.major}.{sys.version_info.minor}"
    expected = "arm64" if platform.machine().lower() in ("aarch64", "arm64") else "x86_64"
    assert architecture.name == expected


def test_no_lambda_runtime_matches_a_mac(monkeypatch):
    monkeypatch.setattr(module.platform, "system", lambda: "Darwin")
    with pytest.raises(LambdaCodeError, match="synthesize on Linux"):
        matching_runtime()
