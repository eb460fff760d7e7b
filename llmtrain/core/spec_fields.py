"""The strict reader of a template's YAML mappings (`Fields`): typed getters that name the field, and a
check that no key is left unread, so a typo in a template never silently falls back to a default."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmtrain.core.errors import TemplateSpecError


def fail(source: str, problem: str) -> TemplateSpecError:
    return TemplateSpecError(source, problem)


class Fields:
    """Strict reader of one YAML mapping: typed getters, and a check that no key is left unread."""

    def __init__(self, data: Any, where: str, source: str):
        if not isinstance(data, Mapping):
            raise fail(source, f"'{where}' must be a mapping, got {type(data).__name__}")
        self._data = dict(data)
        self._read: set[str] = set()
        self.where = where
        self.source = source

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., *, allow_none: bool = False):
        self._read.add(key)
        if key not in self._data:
            if default is ...:
                raise fail(self.source, f"missing required field '{self._path(key)}'")
            return default
        value = self._data[key]
        if value is None and allow_none:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int in Python; a YAML `true` must never pass for a count.
        if isinstance(value, bool) and bool not in kinds:
            raise fail(self.source, f"'{self._path(key)}' must be {_kind_name(kinds)}, got a boolean")
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds):
            raise fail(self.source, f"'{self._path(key)}' must be {_kind_name(kinds)}, got {value!r}")
        return value

    def sub(self, key: str, default: Any = ...) -> Fields:
        """The nested mapping at `key`; required unless a default is given."""
        return Fields(self.get(key, Mapping, default), self._path(key), self.source)

    def done(self) -> None:
        unknown = sorted(set(self._data) - self._read)
        if unknown:
            raise fail(
                self.source,
                f"unknown field(s) {', '.join(self._path(k) for k in unknown)} "
                f"(allowed here: {', '.join(sorted(self._read))})",
            )


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return " or ".join(names.get(k, "a mapping" if k is Mapping else "a list") for k in kinds)


def check_positive(fields: Fields, key: str, value: int | float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise fail(fields.source, f"'{fields._path(key)}' must be {bound}, got {value}")
