"""The Node.js that runs the CDK CLI and jsii: a release they support, which the project installs.

The CDK CLI and jsii print "Node 20 is end-of-life and not supported" on every synth under Node 20
(issue 36). package.json pins Node (the `node` package: its binary in node_modules/.bin), which
`npx` and the Makefile put first on the PATH, whatever node the system has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from infra_helpers import PROJECT_NODE_BIN, ROOT

SUPPORTED_MAJORS = (22, 24)
# What jsii and the CDK CLI say under an unsupported Node (and which the variables below silence).
WARNINGS = ("end-of-life", "not supported", "has not been tested with")
# The app records the Node jsii starts (`node` on its PATH, or JSII_NODE) and synthesizes a stack.
APP = """
import json, os, shutil, subprocess, sys
import aws_cdk as cdk
node = shutil.which(os.environ.get("JSII_NODE", "node"))
version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
json.dump({"node": node, "version": version}, open(sys.argv[1], "w"))
app = cdk.App()
cdk.Stack(app, "Tiny")
app.synth()
"""


def _system_environment() -> dict[str, str]:
    """This process's environment as a shell has it: no project Node on the PATH (the tests' helpers
    put it there), and nothing that silences jsii's warnings about Node."""
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p != str(PROJECT_NODE_BIN)]
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("JSII_SILENCE", "JSII_NODE"))},
            "PATH": os.pathsep.join(path), "CDK_DISABLE_VERSION_CHECK": "1"}


def test_the_project_pins_a_supported_node():
    package = json.loads((ROOT / "package.json").read_text())
    major = int(package["devDependencies"]["node"].split(".")[0])
    assert major in SUPPORTED_MAJORS, package["devDependencies"]
    node = PROJECT_NODE_BIN / "node"
    assert node.is_file(), f"{node} is missing: `make setup` installs package.json's Node"
    installed = subprocess.run([str(node), "--version"], capture_output=True, text=True, check=True).stdout
    assert installed.strip() == f"v{package['devDependencies']['node']}"


@pytest.mark.slow
def test_npx_cdk_synth_runs_the_cli_and_jsii_on_the_pinned_node_without_a_warning(tmp_path):
    """`npx cdk synth` as the Makefile and the docs run it, from a shell whose node is the system's
    (Node 20 here): the CLI and the app's jsii run on the pinned Node, and neither warns."""
    (tmp_path / "app.py").write_text(APP)
    used = tmp_path / "node.json"
    synth = subprocess.run(
        ["npx", "--no-install", "cdk", "synth", "--quiet", "--no-notices", "-o", str(tmp_path / "out"),
         "--app", f"{sys.executable} {tmp_path / 'app.py'} {used}"],
        cwd=ROOT, env=_system_environment(), capture_output=True, text=True, timeout=600,
    )
    output = synth.stdout + synth.stderr
    assert synth.returncode == 0, output[-3000:]
    assert not [w for w in WARNINGS if w in output], output[-3000:]
    node = json.loads(used.read_text())
    assert node["node"] == str(PROJECT_NODE_BIN / "node"), node
    assert int(node["version"].lstrip("v").split(".")[0]) in SUPPORTED_MAJORS, node
    assert (tmp_path / "out" / "Tiny.template.json").is_file()
