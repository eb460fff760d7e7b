"""The container's package install step, run locally with the network cut (issue 19).

The SageMaker training toolkit pip-installs the sourcedir's requirements.txt before the program
starts; in the cloud from the environment's CodeArtifact mirror, locally from this machine's Python
environment with no network. These run the real toolkit, pip and torchrun in a process whose network
is cut: a network namespace with only a loopback interface (`unshare -rn`) where the machine allows
one, else every package index and proxy pointed at a closed port. A requirement the environment
satisfies installs nothing and the job completes; one it lacks fails the job, named.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
from local_e2e_support import E2E_DIR, JOB_TIMEOUT_SECONDS, REPO_ROOT

pytestmark = pytest.mark.slow

CLOSED_PORT = "http://127.0.0.1:9"
# The job a test runs inside the cut network: render the toy template with the given code folder
# and the CodeArtifact repository of a deployed environment, run it locally, print the summary.
_JOB = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {e2e!r})
    from local_e2e_support import toy_template
    from rich.console import Console
    from llmtrain.core.team_context import local_context
    from dataclasses import replace
    from llmtrain.local import LocalRunOptions, run_local
    from llmtrain.core.render import render
    from llmtrain.core.run_settings import RunInput
    from llmtrain.core.sourcedir import package_code

    code_root, workdir = Path(sys.argv[1]), Path(sys.argv[2])
    template = toy_template()
    platform = replace(local_context(), package_repository_arn={arn!r})
    request = render(template, RunInput(run_name="offline"), platform)
    options = LocalRunOptions(run_name="offline", workdir=workdir, data={{"train": code_root / "data"}})
    summary = run_local(request, package_code(template.code, code_root), options,
                        template_channels=template.inputs.channels, console=Console(width=200))
    print("SUMMARY " + json.dumps(summary))
""")
REPOSITORY_ARN = "arn:aws:codeartifact:us-east-1:111111111111:repository/llmtrain-dev/pypi-mirror"


def _network_namespace_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"], capture_output=True)
    return probe.returncode == 0


def offline_command(command: list[str]) -> tuple[list[str], dict[str, str]]:
    """`command` with no route off this machine, and the way it was cut (for the test's message)."""
    env = dict(os.environ)
    # Also inside a namespace: pip must not find a package index on this machine's disk either.
    for name in [n for n in env if n.startswith("PIP_")]:
        del env[name]
    env.update({"PIP_INDEX_URL": CLOSED_PORT, "HTTPS_PROXY": CLOSED_PORT, "HTTP_PROXY": CLOSED_PORT,
                "COLUMNS": "200"})
    if _network_namespace_works():
        script = "ip link set lo up && exec \"$@\""
        return ["unshare", "-rn", "sh", "-c", script, "offline", *command], env
    return command, env


def run_offline(code_root: Path, workdir: Path) -> tuple[dict, str]:
    script = _JOB.format(e2e=str(E2E_DIR), arn=REPOSITORY_ARN)
    command, env = offline_command([sys.executable, "-c", script, str(code_root), str(workdir)])
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_SECONDS)
    output = result.stdout + result.stderr
    line = next((line for line in output.splitlines() if line.startswith("SUMMARY ")), None)
    assert line is not None, output[-4000:]
    return json.loads(line[len("SUMMARY "):]), output


def code_folder(tmp_path: Path, requirements: str) -> Path:
    root = tmp_path / "code"
    shutil.copytree(E2E_DIR / "toy_program", root / "toy_program")
    (root / "toy_program" / "requirements.txt").write_text(requirements)
    (root / "data").mkdir()
    (root / "data" / "part-0.txt").write_text("toy data\n")
    return root


def test_cut_network_is_really_cut():
    command, env = offline_command([sys.executable, "-c", textwrap.dedent("""
        import socket, urllib.request, os
        try:
            socket.create_connection(("pypi.org", 443), timeout=5)
            print("REACHED")
        except OSError as error:
            print("NO ROUTE", error)
    """)])
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    if command[0] != "unshare":
        pytest.skip("no network namespace here: the package-index cut is checked by the jobs below")
    assert "NO ROUTE" in result.stdout, result.stdout + result.stderr


def test_requirements_the_environment_satisfies_install_offline_and_the_job_completes(tmp_path):
    # Pinned to what this environment has, as training_jobs/requirements.txt pins its packages.
    requirements = f"rich=={version('rich')}\npyyaml=={version('pyyaml')}\n"
    summary, output = run_offline(code_folder(tmp_path, requirements), tmp_path / "runs")

    assert summary["TrainingJobStatus"] == "Completed", output[-4000:]
    log = Path(summary["LocalRun"]["Logs"]["algo-1"]).read_text()
    assert "pip install -r requirements.txt" in log or "Installing dependencies from requirements.txt" in log
    assert "Requirement already satisfied: pyyaml" in log
    # The cloud's CodeArtifact repository is not asked locally, and the plan says so.
    adjustments = {a["Setting"]: a for a in summary["LocalRun"]["Adjustments"]}
    assert adjustments["Environment.CA_REPOSITORY_ARN"]["Cloud"] == REPOSITORY_ARN


def test_a_requirement_the_environment_lacks_fails_the_job_naming_it(tmp_path):
    summary, output = run_offline(code_folder(tmp_path, "rich\nllmtrain-no-such-package==1.0\n"),
                                  tmp_path / "runs")

    assert summary["TrainingJobStatus"] == "Failed"
    assert "llmtrain-no-such-package==1.0" in summary["FailureReason"], summary["FailureReason"]
    # The program never started.
    log = Path(summary["LocalRun"]["Logs"]["algo-1"]).read_text()
    assert "[metrics]" not in log

