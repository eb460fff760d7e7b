"""`make demo`'s script, the README's main command, run as a user runs it (after `make synth`).

Its settings are the platform's rules' first user: a demo override that a later rule refuses (a
channel outside the team's datasets prefix did) breaks the README's first command, so the script
itself runs here: two local jobs of llama-pretrain-fsdp, the second resuming the first.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from local_e2e_support import JOB_TIMEOUT_SECONDS, REPO_ROOT, cli_env, losses_by_step

pytestmark = pytest.mark.slow


def test_the_demo_trains_evaluates_and_resumes(tmp_path):
    env = {**cli_env(), "WORKDIR": str(tmp_path)}
    result = subprocess.run(["scripts/demo.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=2 * JOB_TIMEOUT_SECONDS)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    run = tmp_path / "demo"
    assert "resumed from" in output and "step_00000030 at step 30" in output
    assert sorted(losses_by_step(run)) == list(range(1, 61))
    assert sorted(losses_by_step(run, "eval:loss")) == [10, 20, 30, 40, 50, 60]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["TrainingJobStatus"], summary["HyperParameters"]["max_steps"]) == ("Completed", "60")
    assert (run / "metrics.png").stat().st_size > 0
