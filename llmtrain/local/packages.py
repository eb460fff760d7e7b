"""The container's package install step, run locally without a network.

In the cloud, the SageMaker training toolkit runs `pip install -r requirements.txt` in the sourcedir
before the entry point, against the environment's CodeArtifact repository (a PyPI mirror reached
through VPC endpoints; the toolkit reads its ARN from CA_REPOSITORY_ARN). Locally the toolkit runs the
same step, unmodified, on this machine's Python environment, with every way pip could reach a network
closed: no index, no pip configuration of the machine or the user, an unreachable proxy for any URL
a requirement names, and git limited to local repositories. A requirement this environment does not
satisfy then fails the job before training starts, with pip naming the package
("No matching distribution found for NAME"), instead of installing anything into the environment.
So a run whose requirements.txt names a package the platform's environments do not provide fails
here first; docs/local.md says how to add one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from llmtrain.core.render import CODEARTIFACT_ENV
from llmtrain.local.job import Adjustment, LocalJob

# Nothing listens on the discard port of the loopback address: any download pip tries fails at once.
UNREACHABLE_PROXY = "http://127.0.0.1:9"
# pip reads these from the environment; the user's own settings (an index, find-links) must not
# widen what the local install can reach.
_PIP_PREFIX = "PIP_"
_NETWORK_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy",
                      "NO_PROXY", "no_proxy")
INSTALL_FAILURE_MARKERS = ("No matching distribution found for", "Could not find a version that satisfies")


def offline_install_environment(parent_env: Mapping[str, str]) -> dict[str, str]:
    """`parent_env` with pip and git unable to reach anything but this machine's environment."""
    env = {k: v for k, v in parent_env.items()
           if not k.startswith(_PIP_PREFIX) and k not in _NETWORK_VARIABLES}
    env.update({
        "PIP_NO_INDEX": "1",
        "PIP_CONFIG_FILE": os.devnull,  # neither the machine's nor the user's pip.conf
        "PIP_PROXY": UNREACHABLE_PROXY,
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "5",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
        "GIT_ALLOW_PROTOCOL": "file",
    })
    return env


def with_local_packages(plan: LocalJob) -> LocalJob:
    """The plan without the cloud's package repository: locally the toolkit must not ask CodeArtifact
    for a token (it would need AWS credentials and a network)."""
    environment = dict(plan.environment)
    repository = environment.pop(CODEARTIFACT_ENV, None)
    if repository is None:
        return replace(plan, notes=(*plan.notes, _NOTE))
    adjustment = Adjustment(
        f"Environment.{CODEARTIFACT_ENV}", repository, "(not set)",
        "requirements.txt installs from this machine's Python environment with no network; a package it "
        "lacks fails the job here, by name",
    )
    return replace(plan, environment=environment, adjustments=(*plan.adjustments, adjustment))


_NOTE = ("requirements.txt installs from this machine's Python environment with no network, as the "
         "container installs it before training; a package it lacks fails the job here, by name")


def install_failure(log_text: str) -> str | None:
    """pip's line naming the requirement the install step could not satisfy, if the log has one."""
    found = None
    for line in log_text.splitlines():
        if any(marker in line for marker in INSTALL_FAILURE_MARKERS):
            found = line.strip().removeprefix("ERROR: ")  # the last one is pip's verdict
    return found


def explain_failure(failure_text: str, log: Path | None) -> str:
    """The toolkit's failure text, led by the requirement pip could not install when that was the
    failure (the toolkit's InstallRequirementsError carries only pip's command and exit code)."""
    if "InstallRequirementsError" not in failure_text or log is None or not log.is_file():
        return failure_text
    line = install_failure(log.read_text(errors="replace"))
    if line is None:
        return failure_text
    return (f"InstallRequirementsError: requirements.txt: {line}: this Python environment lacks it and local "
            "runs install with no network; install it here (pip install) and make sure the cloud's package "
            f"source has it. {failure_text}")
