"""The strategy layer's shape: every strategy implements the written interface, and the strategy
modules are siblings that never import each other (no cycle can form between them)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from training_jobs.trainer.strategies import protocol
from training_jobs.trainer.strategies.deepspeed_zero import DeepSpeedStrategy
from training_jobs.trainer.strategies.pipeline import PipelineStrategy
from training_jobs.trainer.strategies.smp import SmpStrategy
from training_jobs.trainer.strategies.torch_native import TorchStrategy

FOLDER = Path(protocol.__file__).parent
STRATEGY_MODULES = ("torch_native", "pipeline", "deepspeed_zero", "smp")
SHARED_MODULES = ("protocol", "setup", "optimization", "whole_model")


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol.Strategy).items()
            if inspect.isfunction(member) and not name.startswith("_")}


@pytest.mark.parametrize("strategy", [TorchStrategy, PipelineStrategy, DeepSpeedStrategy, SmpStrategy])
def test_every_strategy_implements_the_interface_with_its_signatures(strategy):
    for name, expected in _protocol_methods().items():
        method = getattr(strategy, name, None)
        assert method is not None, f"{strategy.__name__} lacks {name}"
        assert list(inspect.signature(method).parameters) == list(expected.parameters), \
            f"{strategy.__name__}.{name}{inspect.signature(method)} differs from Strategy.{name}{expected}"


def _imported_siblings(module: str) -> set[str]:
    tree = ast.parse((FOLDER / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
    return found


def test_strategy_modules_import_only_what_they_share():
    for module in STRATEGY_MODULES:
        siblings = _imported_siblings(module) & set(STRATEGY_MODULES)
        assert not siblings, f"{module} imports {siblings}: strategies share code through " \
                             f"{', '.join(SHARED_MODULES)}, never each other"
    for module in SHARED_MODULES:
        assert not _imported_siblings(module) & set(STRATEGY_MODULES), module
