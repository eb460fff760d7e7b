"""Fixtures for every test: one user cache (llmtrain.core.user_cache) per test session."""

from __future__ import annotations

import os

import pytest
from shared_tmp import workers_shared_folder

from llmtrain.core.user_cache import CACHE_VARIABLE


@pytest.fixture(scope="session", autouse=True)
def shared_data_cache(tmp_path_factory):
    """The user cache llmtrain keeps prepared shipped data, tokenizer facts and the CPU's bf16 answer
    in: fresh for each test session, never the developer's own, and one for both pytest-xdist
    workers (their shared temporary folder), so each dataset is prepared once."""
    shared = workers_shared_folder(tmp_path_factory)
    before = os.environ.get(CACHE_VARIABLE)
    os.environ[CACHE_VARIABLE] = str(shared / "llmtrain-cache")
    yield shared / "llmtrain-cache"
    if before is None:
        os.environ.pop(CACHE_VARIABLE, None)
    else:
        os.environ[CACHE_VARIABLE] = before
