"""Typed, validated reads of a raw (camelCase) spec object, and the error they raise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class SpecError(ValueError):
    """A field the operator cannot use. ``field`` is the dotted path under ``spec`` (or a
    ``metadata.`` path); the message names the field, the value and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        where = field if field.startswith("metadata.") else f"spec.{field}"
        super().__init__(f"{where}: got {value!r}; {allowed}")


class FieldReader:
    """Typed access to one object of the spec. A missing field takes its value from
    ``defaults`` (dotted paths); every error names the full path, the value and the range."""

    def __init__(self, raw: Any, path: str, defaults: Mapping[str, Any]) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SpecError(path, raw, "an object is required")
        self.raw, self.path, self.defaults = raw, path, defaults

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str) -> Any:
        value = self.raw.get(key)
        return self.defaults.get(self._key(key)) if value is None else value

    def integer(self, key: str, lo: int, hi: int, required: bool = True) -> int | None:
        value = self._get(key)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise SpecError(self._key(key), value, f"an integer in [{lo}, {hi}] is required")
        return value

    def number(self, key: str, lo: float, hi: float, required: bool = True,
               lo_open: bool = False, hi_open: bool = False) -> float | None:
        value = self._get(key)
        if value is None and not required:
            return None
        bad = isinstance(value, bool) or not isinstance(value, (int, float))
        if bad or value > hi or value < lo or (lo_open and value == lo) or (hi_open and value == hi):
            interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            raise SpecError(self._key(key), value, f"a number in {interval} is required")
        return float(value)

    def choice(self, key: str, allowed: tuple[Any, ...]) -> Any:
        value = self._get(key)
        if isinstance(value, bool) or value not in allowed:
            raise SpecError(self._key(key), value, f"one of {', '.join(map(str, allowed))}")
        return value

    def string(self, key: str, required: bool = False) -> str | None:
        value = self._get(key)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise SpecError(self._key(key), value, "a non-empty string is required")
        return value

    def boolean(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise SpecError(self._key(key), value, "true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self.raw.get(key) or {}
        if not isinstance(value, Mapping):
            raise SpecError(self._key(key), value, "an object is required")
        return dict(value)

    def items(self, key: str) -> tuple[Any, ...]:
        value = self.raw.get(key) or []
        if not isinstance(value, list):
            raise SpecError(self._key(key), value, "a list is required")
        return tuple(value)
