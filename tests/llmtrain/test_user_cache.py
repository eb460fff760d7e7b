"""The user cache keeps what costs a subprocess for later commands, keyed by what it was derived from."""

from __future__ import annotations

import shutil

import pytest

from llmtrain.core import token_data
from llmtrain.core.sourcedir import repository_root
from llmtrain.core.user_cache import CACHE_VARIABLE, cache_root, cached_json
from llmtrain.local import job


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_cache_root_is_the_configured_folder_else_xdg_else_home(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "llmtrain"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "llmtrain"


def test_a_value_is_computed_once_and_an_unwritable_cache_computes_every_time(own_cache, monkeypatch):
    calls = []

    def compute():
        calls.append(1)
        return {"answer": len(calls)}

    assert cached_json("things", "k", compute) == {"answer": 1}
    assert cached_json("things", "k", compute) == {"answer": 1}
    assert len(calls) == 1 and [p.name for p in (own_cache / "things").iterdir()] == ["k.json"]
    (own_cache / "things" / "k.json").write_text("{not json")  # a damaged entry is computed again
    assert cached_json("things", "k", compute) == {"answer": 2}
    monkeypatch.setenv(CACHE_VARIABLE, "/proc/llmtrain-cache")
    assert cached_json("things", "k", compute) == {"answer": 3}
    assert cached_json("things", "k", compute) == {"answer": 4}


def test_tokenizer_facts_are_loaded_once_per_tokenizer_content(own_cache, tmp_path, monkeypatch):
    folder = tmp_path / "tokenizer"
    shutil.copytree(repository_root() / token_data.SHIPPED_TOKENIZER, folder)
    token_data.tokenizer_facts.cache_clear()
    first = token_data.tokenizer_facts(folder)
    assert first.vocab_size > 0
    # Another command (the in-process cache cleared), with the program unable to load any tokenizer:
    # the facts come from the user cache.
    token_data.tokenizer_facts.cache_clear()
    monkeypatch.setattr(token_data, "TOKENIZER_INFO_MODULE", "training_jobs.no_such_module")
    assert token_data.tokenizer_facts(folder) == first
    # A changed tokenizer file is a new key: loaded again (and here refused, not cached).
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    token_data.tokenizer_facts.cache_clear()
    with pytest.raises(token_data.TokenDataError, match="cannot load the tokenizer"):
        token_data.tokenizer_facts(folder)
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_VARIABLE, str(own_cache))
    token_data.tokenizer_facts.cache_clear()
    assert token_data.tokenizer_facts(folder) == first  # the refusal was not kept
    token_data.tokenizer_facts.cache_clear()


def test_the_cpus_bf16_answer_is_asked_of_torch_once(own_cache, monkeypatch):
    job.cpu_has_bf16_matmuls.cache_clear()
    answer = job.cpu_has_bf16_matmuls()
    job.cpu_has_bf16_matmuls.cache_clear()
    monkeypatch.setattr(job, "BF16_PROBE", f"print({not answer})")  # torch would now say otherwise
    assert job.cpu_has_bf16_matmuls() is answer
    assert len(list((own_cache / "machine").glob("bf16-matmuls-*.json"))) == 1
    job.cpu_has_bf16_matmuls.cache_clear()
