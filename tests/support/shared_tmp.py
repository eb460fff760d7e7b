"""The temporary folder both pytest-xdist workers of a run share (one session's for a run without xdist)."""

from __future__ import annotations

import os
from pathlib import Path


def workers_shared_folder(tmp_path_factory) -> Path:
    """The parent of the workers' own base folders under xdist, else this session's base folder. Read
    from PYTEST_XDIST_WORKER, not the worker_id fixture: make test-container's venvs have no xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
