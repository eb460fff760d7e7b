"""The catalog: loading, name@version resolution, semver order, and the immutability lock."""

from __future__ import annotations

import io
import json
import shlex
import shutil
import tarfile

import pytest
import yaml
from templates_support import REPO_ROOT, TEMPLATE_NAMES, catalog, copy_catalog

from llmtrain.cli import main
from llmtrain.core.catalog import DEFAULT_TEMPLATE, Catalog, SemVer, parse_ref
from llmtrain.core.errors import LockError, TemplateNotFoundError, TemplateSpecError


@pytest.fixture(scope="module")
def repo_catalog() -> Catalog:
    return catalog()


def test_catalog_holds_every_template_and_the_default(repo_catalog):
    assert tuple(repo_catalog.names()) == TEMPLATE_NAMES
    assert DEFAULT_TEMPLATE == "llama-pretrain-fsdp"
    assert repo_catalog.versions(DEFAULT_TEMPLATE) == ["1.0.0", "1.1.0", "1.2.0", "1.3.0"]


@pytest.mark.parametrize(("ref", "version"), [("gpt2-ddp", "1.3.0"), ("gpt2-ddp@latest", "1.3.0"),
                                              ("gpt2-ddp@1.0.0", "1.0.0"), ("gpt2-ddp@1.1.0", "1.1.0")])
def test_references_resolve_to_the_version(repo_catalog, ref, version):
    spec = repo_catalog.resolve(ref)
    assert (spec.name, spec.version) == ("gpt2-ddp", version)


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
    assert extended.versions("gpt2-ddp") == ["1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.9.0", "1.10.0",
                                             "2.0.0-rc.1"]
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


def _copy_code(repo) -> None:
    shutil.copytree(REPO_ROOT / "examples" / "byo_script", repo / "examples" / "byo_script")
    shutil.copytree(
        REPO_ROOT / "training_jobs", repo / "training_jobs", ignore=shutil.ignore_patterns("__pycache__")
    )


def _archive_files(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _change_byo_script(repo) -> tuple[bytes, bytes]:
    """(the published script, the changed one)."""
    script = repo / "examples" / "byo_script" / "train_clm.py"
    published = script.read_bytes()
    script.write_bytes(published + b"\n# a change after publishing\n")
    return published, script.read_bytes()


def test_a_published_version_keeps_its_code_when_the_code_moves_on(tmp_path):
    folder, repo = copy_catalog(tmp_path), tmp_path
    _copy_code(repo)
    published, changed = _change_byo_script(repo)

    moved_on = Catalog.load(folder, repo_root=repo)
    moved_on.check_lock()  # 1.0.0 is served from its snapshot
    old = moved_on.get("byo-script", "1.0.0")
    assert _archive_files(moved_on.sourcedir(old))["train_clm.py"] == published

    _add_version(folder, "byo-script", "1.1.0")
    extended = Catalog.load(folder, repo_root=repo)
    assert extended.lock_new_versions() == ["byo-script@1.1.0"]
    new = extended.get("byo-script", "1.1.0")
    assert _archive_files(extended.sourcedir(new))["train_clm.py"] == changed
    assert extended.snapshot_path(extended.verify(new).code).is_file()
    assert extended.verify(old).code != extended.verify(new).code
    Catalog.load(folder, repo_root=repo).check_lock()


def test_changed_code_without_its_snapshot_fails_naming_both(tmp_path):
    folder, repo = copy_catalog(tmp_path), tmp_path
    _copy_code(repo)
    catalog_copy = Catalog.load(folder, repo_root=repo)
    catalog_copy.check_lock()  # an identical copy still matches
    snapshot = catalog_copy.snapshot_path(catalog_copy.verify(catalog_copy.get("byo-script")).code)
    snapshot.unlink()
    _change_byo_script(repo)
    expected = (r"byo-script@1\.0\.0 .*the code it wraps in examples/byo_script changed.* snapshot "
                r".*_code/[0-9a-f]{64}\.tar\.gz.* missing")
    with pytest.raises(LockError, match=expected):
        Catalog.load(folder, repo_root=repo).check_lock()


def test_a_changed_yaml_is_named_alone_when_the_moved_on_code_has_its_snapshot(tmp_path):
    folder, repo = copy_catalog(tmp_path), tmp_path
    _copy_code(repo)
    _change_byo_script(repo)  # no change to 1.0.0: it runs its snapshot
    path = folder / "byo-script" / "1.0.0.yaml"
    path.write_text(path.read_text().replace("max_runtime_seconds: 14400", "max_runtime_seconds: 14401"))
    with pytest.raises(LockError) as error:
        Catalog.load(folder, repo_root=repo).check_lock()
    assert "byo-script@1.0.0 was published and has changed since: its YAML changed." in str(error.value)


def test_a_snapshot_that_is_not_the_published_code_is_refused(tmp_path):
    folder, repo = copy_catalog(tmp_path), tmp_path
    _copy_code(repo)
    catalog_copy = Catalog.load(folder, repo_root=repo)
    byo, fsdp = catalog_copy.get("byo-script"), catalog_copy.get("llama-pretrain-fsdp")
    snapshot = catalog_copy.snapshot_path(catalog_copy.verify(byo).code)
    snapshot.write_bytes(catalog_copy.sourcedir(fsdp))  # some other code under the byo hash
    _change_byo_script(repo)
    with pytest.raises(LockError, match=r"byo-script@1\.0\.0: .*does not hold the published code"):
        Catalog.load(folder, repo_root=repo).check_lock()


def test_a_missing_snapshot_of_unchanged_code_is_restored_by_the_lock_command(tmp_path):
    folder, repo = copy_catalog(tmp_path), tmp_path
    _copy_code(repo)
    catalog_copy = Catalog.load(folder, repo_root=repo)
    snapshot = catalog_copy.snapshot_path(catalog_copy.verify(catalog_copy.get("byo-script")).code)
    snapshot.unlink()
    with pytest.raises(LockError, match=r"byo-script@1\.0\.0 has no snapshot of its code .* run "
                                        r"`llmtrain templates lock --catalog "):
        Catalog.load(folder, repo_root=repo).check_lock()
    assert Catalog.load(folder, repo_root=repo).lock_new_versions() == []
    assert snapshot.is_file()
    Catalog.load(folder, repo_root=repo).check_lock()


def test_formatting_and_comments_do_not_change_the_hash(tmp_path):
    folder = copy_catalog(tmp_path)
    path = folder / "gpt2-ddp" / "1.0.0.yaml"
    path.write_text("# a new comment on top\n" + path.read_text().replace("\n\n", "\n\n\n"))
    Catalog.load(folder).check_lock()


def test_a_new_version_is_locked_and_published_ones_are_kept(tmp_path):
    folder = copy_catalog(tmp_path)
    _add_version(folder, "gpt2-ddp", "1.4.0", max_runtime_seconds=7200)
    extended = Catalog.load(folder)
    with pytest.raises(LockError, match=r"gpt2-ddp@1\.4\.0 is not published: run `llmtrain templates lock "):
        extended.check_lock()

    assert extended.lock_new_versions() == ["gpt2-ddp@1.4.0"]

    before = json.loads((REPO_ROOT / "templates" / "catalog.lock").read_text())["templates"]
    after = json.loads((folder / "catalog.lock").read_text())["templates"]
    published = ("1.0.0", "1.1.0", "1.2.0", "1.3.0")
    assert {v: after["gpt2-ddp"][v] for v in published} == before["gpt2-ddp"]
    assert set(after["gpt2-ddp"]) == {*published, "1.4.0"}
    Catalog.load(folder).check_lock()
    assert Catalog.load(folder).lock_new_versions() == []


def test_a_team_s_catalog_names_the_command_that_publishes_in_that_catalog(tmp_path, monkeypatch, capsys):
    """The platform's catalog is published with `llmtrain templates lock`; a team's own catalog (here
    the example consumer's, copied) needs its folder and code root named, or the command would check
    the platform's catalog instead. The command the error names, run as written, publishes it."""
    team = tmp_path / "acme"
    for part in ("templates", "training"):
        shutil.copytree(REPO_ROOT / "examples" / "cdk_consumer" / part, team / part)
    _add_version(team / "templates", "acme-charlm", "1.1.0", max_runtime_seconds=7200)
    monkeypatch.chdir(tmp_path)  # anywhere: the command names both folders
    with pytest.raises(LockError) as error:
        Catalog.load(team / "templates", repo_root=team).check_lock()
    command = str(error.value).split("run `", 1)[1].split("`", 1)[0]
    assert command == shlex.join(["llmtrain", "templates", "lock", "--catalog", str(team / "templates"),
                                  "--code-root", str(team)])
    assert main(shlex.split(command)[1:]) == 0
    assert "locked acme-charlm@1.1.0" in capsys.readouterr().out
    Catalog.load(team / "templates", repo_root=team).check_lock()
    assert Catalog.load().lock_command() == "llmtrain templates lock" and Catalog.load().is_platform


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
