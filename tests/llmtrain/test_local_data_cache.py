"""The shipped data a local run prepares is cached once per user, for every work directory."""

from __future__ import annotations

from llmtrain.core.user_cache import CACHE_VARIABLE
from llmtrain.local import data as local_data
from llmtrain.local.data import MANIFEST, data_cache_root, tiny_corpus_channels


def test_the_shipped_data_is_kept_in_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "mine"))
    assert data_cache_root(tmp_path / "work") == tmp_path / "mine" / "data"


def test_a_cache_that_cannot_be_written_falls_back_to_the_work_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, "/proc/llmtrain-cache")
    assert data_cache_root(tmp_path / "work") == tmp_path / "work" / ".data"


def test_two_work_directories_prepare_the_corpus_once(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    said: list[str] = []
    first = tiny_corpus_channels(tmp_path / "a", ["train"], log=said.append)
    second = tiny_corpus_channels(tmp_path / "b", ["train"], log=said.append)
    assert first == second and first["train"].is_relative_to(tmp_path / "cache")
    assert (first["train"] / MANIFEST).is_file()
    assert len(said) == 1 and "preparing the tiny corpus for channel 'train'" in said[0]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # No scratch folder is left beside the channel.
    assert [p.name for p in first["train"].parent.iterdir()] == ["train"]


def test_a_channel_another_run_finished_first_is_used_and_a_failed_preparation_leaves_nothing(
        tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    prepare = local_data._prepare

    def finished_meanwhile(repo, source, tokenizer, target, options):
        # Another run renames its channel into place while this one prepares: this run's rename
        # fails, and it uses the other's.
        prepare(repo, source, tokenizer, target, options)
        (target / "by-the-other-run").write_text("")
        prepare(repo, source, tokenizer, target, options)

    monkeypatch.setattr(local_data, "_prepare", finished_meanwhile)
    channels = tiny_corpus_channels(tmp_path / "work", ["train"], log=lambda _: None)
    assert (channels["train"] / "by-the-other-run").exists()
    assert [p.name for p in channels["train"].parent.iterdir()] == ["train"]

    monkeypatch.setattr(local_data, "_prepare", prepare)
    monkeypatch.setattr(local_data, "PREPARE_MODULE", "training_jobs.no_such_module")
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "other"))
    try:
        tiny_corpus_channels(tmp_path / "work", ["train"], log=lambda _: None)
    except local_data.LocalRunError as error:
        assert "preparing the tiny corpus failed" in str(error)
    else:
        raise AssertionError("a failed preparation was not reported")
    assert not list((tmp_path / "other").rglob("train*"))  # neither the channel nor its scratch folder
