"""Build hook: the wheel carries the platform files the `llmtrain` commands need.

`pip install` puts the template catalog (`templates/`, with its lock and the frozen code of published
versions), the training program (`training_jobs/`, which local runs package and `llmtrain data
prepare` runs) and the examples (`examples/`: the tiny corpus of the default local run, the
bring-your-own-script template's code) into the package as `llmtrain/_bundle/`, laid out as in the
repository; `llmtrain.core.sourcedir.repository_root` finds them there. An editable install (`pip install
-e .`, what `make setup` does) copies nothing: it reads the live tree.

The training program's torch-free contract (`training_jobs/contract/`), which llmtrain imports, is
also a top-level package of the wheel: `training_jobs` there holds only its `__init__.py` and
`contract/`, never the program itself (which imports torch; it runs from the bundle's copy).
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


# The top-level package whose own modules the wheel leaves out but its __init__ (the contract is its
# subpackage; the program's modules run from the bundle).
CONTRACT_ONLY_PACKAGE = "training_jobs"


class BuildWithPlatformFiles(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package == CONTRACT_ONLY_PACKAGE:
            return [module for module in modules if module[1] == "__init__"]
        return modules

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
