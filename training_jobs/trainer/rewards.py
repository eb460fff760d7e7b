"""GRPO's verifiable rewards: the built-in ones and functions the template's code names.

A reward function takes keywords: `prompt` and `completion` (text), and the example's other fields
(e.g. `answer`), and returns a number. `grpo_reward` names one or more, comma-separated; a
completion's reward is their sum. Built in:

- exact_match: 1 when the completion, stripped, equals the example's answer (grpo_answer_key),
  stripped; else 0.
- regex: 1 when grpo_reward_regex is found in the completion (re.search); else 0.
- numeric: 1 when the last number in the completion equals the answer as a number (within 1e-6,
  relative); else 0.

Any other name is `module:function`, imported from the job's code (its folder is on sys.path). A
function that cannot be imported, or that returns something other than a number, stops the job
before training, naming it (and the example).
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..contract.objectives import ObjectiveConfig, reward_names
from .errors import ConfigError, DataError

RewardFn = Callable[..., float]
# A number as people write answers: 7, -3.5, .5, 1e-3, 1,000 (thousands separated by commas).
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


def _answer(fields: dict[str, Any], key: str, reward: str) -> str:
    if key not in fields:
        raise DataError(f"the {reward} reward compares with the example's {key!r} field, which it lacks "
                        f"(fields: {', '.join(sorted(fields)) or 'none'}); set grpo_answer_key")
    return str(fields[key])


def _exact_match(key: str) -> RewardFn:
    def exact_match(prompt: str, completion: str, **fields: Any) -> float:
        return float(completion.strip() == _answer(fields, key, "exact_match").strip())
    return exact_match


def _regex(pattern: str) -> RewardFn:
    compiled = re.compile(pattern)

    def regex(prompt: str, completion: str, **fields: Any) -> float:
        return float(compiled.search(completion) is not None)
    return regex


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _numeric(key: str) -> RewardFn:
    def numeric(prompt: str, completion: str, **fields: Any) -> float:
        expected = _number(_answer(fields, key, "numeric").strip())
        found = _NUMBER.findall(completion)
        got = _number(found[-1]) if found else None
        return float(expected is not None and got is not None
                     and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9))
    return numeric


def _entry_point(name: str) -> RewardFn:
    module_name, _, function_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module: any import-time failure is theirs to fix
        raise ConfigError(f"invalid hyperparameter 'grpo_reward': cannot import module {module_name!r} "
                          f"of {name!r} ({type(error).__name__}: {error}); it must be importable from "
                          "the job's code folder") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"invalid hyperparameter 'grpo_reward': module {module_name!r} has no function "
                          f"{function_name!r}")
    return function


@dataclass(frozen=True)
class Rewards:
    """The run's reward functions, by name."""

    functions: tuple[tuple[str, RewardFn], ...]

    @classmethod
    def from_settings(cls, settings: ObjectiveConfig) -> Rewards:
        builtins = {"exact_match": lambda: _exact_match(settings.grpo_answer_key),
                    "regex": lambda: _regex(settings.grpo_reward_regex),
                    "numeric": lambda: _numeric(settings.grpo_answer_key)}
        return cls(tuple((name, builtins[name]() if name in builtins else _entry_point(name))
                         for name in reward_names(settings)))

    def score(self, prompt: str, completion: str, fields: dict[str, Any], where: str) -> float:
        """The completion's reward: the sum of every function's; a non-number names the example."""
        total = 0.0
        for name, function in self.functions:
            value = function(prompt=prompt, completion=completion, **fields)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise DataError(f"reward function {name} returned {value!r} for the example {where}: a "
                                "reward must be a finite number (int or float)")
            total += float(value)
        return total
