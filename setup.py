"""Build hook: the wheel carries the platform files the `llmtrain` commands need.

`pip install` puts the template catalog (`templates/`, with its lock and the frozen code of published
versions), the training program (`training_jobs/`, which local runs package and `llmtrain data
prepare` runs) and the examples (`examples/`: the tiny corpus of the default local run, the
bring-your-own-script template's code) into the package as `llmtrain/_bundle/`, laid out as in the
repository; `llmtrain.sourcedir.repository_root` finds them there. An editable install (`pip install
-e .`, what `make setup` does) copies nothing: it reads the live tree.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUNDLE = Path("llmtrain") / "_bundle"
BUNDLED_FOLDERS = ("templates", "training_jobs", "examples")
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", ".pytest_cache", ".ruff_cache", ".DS_Store")
# Another account's CDK app using llmtrain-constructs: an example for the construct library, not a
# file any `llmtrain` command reads.
NOT_BUNDLED = ("examples/cdk_consumer",)


class BuildWithPlatformFiles(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / BUNDLE
        shutil.rmtree(target, ignore_errors=True)
        for folder in BUNDLED_FOLDERS:
            shutil.copytree(ROOT / folder, target / folder, ignore=SKIPPED)
        for folder in NOT_BUNDLED:
            shutil.rmtree(target / folder, ignore_errors=True)


setup(cmdclass={"build_py": BuildWithPlatformFiles})
