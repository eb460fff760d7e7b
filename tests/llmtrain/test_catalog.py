"""The catalog: loading, name@version resolution, semver order, and the immutability lock."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from templates_support import REPO_ROOT, TEMPLATE_NAMES, catalog, copy_catalog

from llmtrain.catalog import DEFAULT_TEMPLATE, Catalog, SemVer, parse_ref
from llmtrain.errors import LockError, TemplateNotFoundError, TemplateSpecError


@pytest.fixture(scope="module")
def repo_catalog() -> Catalog:
    return catalog()


def test_catalog_holds_every_template_and_the_default(repo_catalog):
    assert tuple(repo_catalog.names()) == TEMPLATE_NAMES
    assert DEFAULT_TEMPLATE == "llama-pretrain-fsdp"
    assert repo_catalog.versions(DEFAULT_TEMPLATE) == ["1.0.0"]


@pytest.mark.parametrize("ref", ["gpt2-ddp", "gpt2-ddp@latest", "gpt2-ddp@1.0.0"])
def test_references_resolve_to_the_version(repo_catalog, ref):
    spec = repo_catalog.resolve(ref)
    assert (spec.name, spec.version) == ("gpt2-ddp", "1.0.0")


def test_parse_ref_defaults_to_latest():
    assert parse_ref("a") == ("a", "latest")
    assert parse_ref("a@2.0.0") == ("a", "2.0.0")
    with pytest.raises(TemplateNotFoundError, match="lacks a name"):
        parse_ref("@1.0.0")


@pytest.mark.parametrize(
    "ordered",
    [
        [
            "1.0.0-alpha",
            "1.0.0-alpha.1",
            "1.0.0-alpha.beta",
            "1.0.0-beta",
            "1.0.0-beta.2",
            "1.0.0-beta.11",
            "1.0.0-rc.1",
            "1.0.0",
        ],  # the semver 2.0 specification's own example
        ["0.9.9", "1.0.0", "1.2.0", "1.10.0", "2.0.0"],
    ],
)
def test_semver_precedence(ordered):
    shuffled = list(reversed(ordered))
    assert [str(v) for v in sorted(SemVer.parse(v) for v in shuffled)] == ordered


def test_latest_is_the_highest_release_not_a_prerelease(tmp_path, repo_catalog):
    folder = copy_catalog(tmp_path)
    for version in ("1.10.0", "1.9.0", "2.0.0-rc.1"):
        _add_version(folder, "gpt2-ddp", version)
    extended = Catalog.load(folder)
    assert extended.versions("gpt2-ddp") == ["1.0.0", "1.9.0", "1.10.0", "2.0.0-rc.1"]
    assert extended.resolve("gpt2-ddp@latest").version == "1.10.0"
    assert extended.resolve("gpt2-ddp@2.0.0-rc.1").version == "2.0.0-rc.1"


def test_unknown_template_names_the_catalog(repo_catalog):
    with pytest.raises(TemplateNotFoundError) as error:
        repo_catalog.resolve("llama-pretrain-nope@1.0.0")
    assert "unknown template 'llama-pretrain-nope'" in str(error.value)
    assert "llama-pretrain-fsdp" in str(error.value)


def test_unknown_version_lists_the_available_ones(repo_catalog):
    with pytest.raises(TemplateNotFoundError, match=r"has no version '9\.9\.9'; available: 1\.0\.0"):
        repo_catalog.resolve("gpt2-ddp@9.9.9")


@pytest.mark.parametrize("version", ["1.0", "v1.0.0", "01.0.0", "1.0.0.0"])
def test_malformed_version_is_rejected(repo_catalog, version):
    with pytest.raises(TemplateNotFoundError, match="not a semantic version"):
        repo_catalog.resolve(f"gpt2-ddp@{version}")


def test_file_must_live_at_name_and_version(tmp_path):
    folder = copy_catalog(tmp_path)
    shutil.move(folder / "gpt2-ddp" / "1.0.0.yaml", folder / "gpt2-ddp" / "1.0.1.yaml")
    with pytest.raises(
        TemplateSpecError, match=r"declares gpt2-ddp@1\.0\.0 but lives at gpt2-ddp/1\.0\.1\.yaml"
    ):
        Catalog.load(folder)


# --- the lock -------------------------------------------------------------------------------------


def test_every_published_version_matches_the_lock(repo_catalog):
    """Fails when a published template or the code it wraps changed without a new version."""
    repo_catalog.check_lock()


def test_a_changed_published_spec_fails_with_instructions(tmp_path):
    folder = copy_catalog(tmp_path)
    path = folder / "gpt2-ddp" / "1.0.0.yaml"
    path.write_text(path.read_text().replace("max_runtime_seconds: 21600", "max_runtime_seconds: 21601"))
    lock_before = (folder / "catalog.lock").read_text()
    changed = Catalog.load(folder)

    with pytest.raises(LockError) as error:
        changed.check_lock()
    message = str(error.value)
    assert "gpt2-ddp@1.0.0 was published and has changed since: its YAML changed" in message
    assert "publish the change as a new version" in message
    with pytest.raises(LockError, match="refusing to update the lock"):
        changed.lock_new_versions()
    assert (folder / "catalog.lock").read_text() == lock_before


def test_changed_wrapped_code_fails_naming_the_code(tmp_path):
    folder = copy_catalog(tmp_path)
    repo = tmp_path
    shutil.copytree(REPO_ROOT / "examples" / "byo_script", repo / "examples" / "byo_script")
    shutil.copytree(
        REPO_ROOT / "training_jobs", repo / "training_jobs", ignore=shutil.ignore_patterns("__pycache__")
    )
    Catalog.load(folder, repo_root=repo).check_lock()  # an identical copy still matches

    script = repo / "examples" / "byo_script" / "train_clm.py"
    script.write_text(script.read_text() + "\n# a silent change\n")
    expected = r"byo-script@1\.0\.0 .*the code it wraps in examples/byo_script changed"
    with pytest.raises(LockError, match=expected):
        Catalog.load(folder, repo_root=repo).check_lock()


def test_formatting_and_comments_do_not_change_the_hash(tmp_path):
    folder = copy_catalog(tmp_path)
    path = folder / "gpt2-ddp" / "1.0.0.yaml"
    path.write_text("# a new comment on top\n" + path.read_text().replace("\n\n", "\n\n\n"))
    Catalog.load(folder).check_lock()


def test_a_new_version_is_locked_and_published_ones_are_kept(tmp_path):
    folder = copy_catalog(tmp_path)
    _add_version(folder, "gpt2-ddp", "1.1.0", max_runtime_seconds=7200)
    extended = Catalog.load(folder)
    with pytest.raises(LockError, match=r"gpt2-ddp@1\.1\.0 is not published: run `llmtrain templates lock`"):
        extended.check_lock()

    assert extended.lock_new_versions() == ["gpt2-ddp@1.1.0"]

    before = json.loads((REPO_ROOT / "templates" / "catalog.lock").read_text())["templates"]
    after = json.loads((folder / "catalog.lock").read_text())["templates"]
    assert after["gpt2-ddp"]["1.0.0"] == before["gpt2-ddp"]["1.0.0"]
    assert set(after["gpt2-ddp"]) == {"1.0.0", "1.1.0"}
    Catalog.load(folder).check_lock()
    assert Catalog.load(folder).lock_new_versions() == []


def test_deleting_a_published_version_fails(tmp_path):
    folder = copy_catalog(tmp_path)
    (folder / "gpt2-ddp" / "1.0.0.yaml").unlink()
    with pytest.raises(
        LockError, match=r"gpt2-ddp@1\.0\.0 is published in catalog.lock but its YAML file is gone"
    ):
        Catalog.load(folder).check_lock()


def test_malformed_lock_says_how_to_recover(tmp_path):
    folder = copy_catalog(tmp_path)
    (folder / "catalog.lock").write_text("{not json")
    with pytest.raises(LockError, match="malformed .* restore it from version control"):
        Catalog.load(folder).check_lock()


def _add_version(folder, name: str, version: str, **stopping) -> None:
    data = yaml.safe_load((folder / name / "1.0.0.yaml").read_text())
    data["version"] = version
    data["stopping"].update(stopping)
    (folder / name / f"{version}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
