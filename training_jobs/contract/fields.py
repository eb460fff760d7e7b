"""The hyperparameter field: a dataclass field with its default, help and numeric bounds, shared by
the contract's modules (hyperparameters.py and the objectives' settings in objectives.py)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def hp(default: Any, help: str, *, minimum: float | None = None, maximum: float | None = None,
       exclusive_minimum: bool = False, exclusive_maximum: bool = False) -> Any:
    """A hyperparameter field: its default, its documentation and its numeric range."""
    metadata = {"help": help, "minimum": minimum, "maximum": maximum,
                "exclusive_minimum": exclusive_minimum, "exclusive_maximum": exclusive_maximum}
    if isinstance(default, dict | list):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)
