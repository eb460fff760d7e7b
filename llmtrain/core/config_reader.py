"""Typed, validated access to one mapping of a YAML document (`ConfigReader`).

Each accessor checks a field's type and range and raises `EnvironmentConfigError` naming the file and
the dotted field (``config/dev.yaml: network.vpc_cidr: ...``); sections nest with their prefix.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from llmtrain.core.environment_model import EnvironmentConfigError


class ConfigReader:
    """Typed access to one mapping of the document; every error names the file and the dotted field."""

    _MISSING = object()

    def __init__(self, data: Any, *, prefix: str, origin: str, present: bool = True) -> None:
        self.origin = origin
        self.prefix = prefix
        self.present = present
        if data is None and not present:
            data = {}
        if not isinstance(data, dict):
            where = prefix.rstrip(".") or "the document"
            raise EnvironmentConfigError(f"{origin}: {where}: must be a mapping of field names to values")
        self.data = data

    def fail(self, key: str, message: str) -> NoReturn:
        raise EnvironmentConfigError(f"{self.origin}: {self.prefix}{key}: {message}")

    def only_keys(self, allowed: set[str]) -> None:
        for key in self.data:
            if key not in allowed:
                self.fail(str(key), f"unknown field; allowed here: {', '.join(sorted(allowed))}")

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is self._MISSING:
            self.fail(key, "is required")
        return default

    def section(self, key: str, *, required: bool = True) -> ConfigReader:
        present = self.data.get(key) is not None
        if required and not present:
            self.fail(key, "is required")
        return ConfigReader(
            self.data.get(key), prefix=f"{self.prefix}{key}.", origin=self.origin, present=present
        )

    def string(self, key: str, *, pattern: re.Pattern | None = None, hint: str = "") -> str:
        value = self.raw(key)
        if not isinstance(value, str) or (pattern is not None and not pattern.fullmatch(value)):
            self.fail(key, f"expected {hint or 'a string'}, got {value!r}")
        return value

    def optional_string(self, key: str, *, pattern: re.Pattern, hint: str) -> str | None:
        if self.raw(key, default=None) is None:
            return None
        return self.string(key, pattern=pattern, hint=hint)

    def string_list(self, key: str, *, min_items: int, pattern: re.Pattern | None = None) -> tuple[str, ...]:
        values = self.raw(key)
        if not isinstance(values, list) or not all(isinstance(item, str) for item in values):
            self.fail(key, f"expected a list of strings, got {values!r}")
        if len(values) < min_items:
            self.fail(key, f"needs at least {min_items} entries, got {len(values)}")
        for item in values:
            if pattern is not None and not pattern.fullmatch(item):
                self.fail(key, f"{item!r} is not valid (must match {pattern.pattern})")
        return tuple(values)

    def boolean(self, key: str, *, default: bool) -> bool:
        value = self.raw(key, default=default)
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {value!r}")
        return value

    def integer(self, key: str, *, default: int, minimum: int, maximum: int | None = None) -> int:
        value = self.raw(key, default=default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected a whole number, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and at most {maximum}" if maximum is not None else ""
            self.fail(key, f"must be at least {minimum}{upper}, got {value}")
        return value

    def number(self, key: str, *, default: float) -> float:
        value = self.raw(key, default=default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(key, f"expected a number, got {value!r}")
        return value
