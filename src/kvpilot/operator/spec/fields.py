"""What every section of the spec reads with: :class:`SpecError` (field, value, what is
allowed) and :class:`FieldReader`, typed access to one object of the spec with the CRD's
defaults applied. Standard library only."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, TypeVar, cast

_T = TypeVar("_T")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class SpecError(ValueError):
    """A field the operator cannot use. ``field`` is the dotted path under ``spec`` (or a
    ``metadata.`` path); the message names the field, the value and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        where = field if field.startswith("metadata.") else f"spec.{field}"
        super().__init__(f"{where}: got {value!r}; {allowed}")


def is_dns_subdomain(name: str) -> bool:
    """A Kubernetes object name of the DNS-1123 subdomain kind (Secrets, RuntimeClasses,
    Leases): at most 253 lowercase letters, digits, '-' and '.'."""
    return len(name) <= 253 and _DNS_SUBDOMAIN_RE.fullmatch(name) is not None


class FieldReader:
    """Typed access to one object of the spec. A missing field takes its value from
    ``defaults`` (dotted paths); every error is a :class:`SpecError` naming the full path,
    the value and the allowed range. ``raw`` None reads as an empty object."""

    def __init__(self, raw: Any, path: str, defaults: Mapping[str, Any]) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SpecError(path, raw, "an object is required")
        self.raw: Mapping[str, Any] = raw
        self.path, self.defaults = path, defaults

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str) -> Any:
        value = self.raw.get(key)
        return self.defaults.get(self._key(key)) if value is None else value

    def integer(self, key: str, lo: int, hi: int) -> int:
        """A required integer in [lo, hi] (bools refused)."""
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise SpecError(self._key(key), value, f"an integer in [{lo}, {hi}] is required")
        return value

    def optional_integer(self, key: str, lo: int, hi: int) -> int | None:
        """:meth:`integer`, or None when the field is absent and has no default."""
        return None if self._get(key) is None else self.integer(key, lo, hi)

    def number(self, key: str, lo: float, hi: float, lo_open: bool = False,
               hi_open: bool = False) -> float:
        """A required number in the interval (open at an end when ``*_open``), as float."""
        value = self._get(key)
        bad = (isinstance(value, bool) or not isinstance(value, (int, float))
               or math.isnan(value))
        if bad or value > hi or value < lo or (lo_open and value == lo) or (hi_open and value == hi):
            interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            raise SpecError(self._key(key), value, f"a number in {interval} is required")
        return float(value)

    def optional_number(self, key: str, lo: float, hi: float, lo_open: bool = False,
                        hi_open: bool = False) -> float | None:
        """:meth:`number`, or None when the field is absent and has no default."""
        if self._get(key) is None:
            return None
        return self.number(key, lo, hi, lo_open, hi_open)

    def choice(self, key: str, allowed: tuple[_T, ...]) -> _T:
        """One of ``allowed`` (compared by equality; bools refused)."""
        value = self._get(key)
        if isinstance(value, bool) or value not in allowed:
            raise SpecError(self._key(key), value, f"one of {', '.join(map(str, allowed))}")
        return cast(_T, value)

    def string(self, key: str) -> str | None:
        """A non-empty string, or None when absent."""
        return None if self._get(key) is None else self.required_string(key)

    def required_string(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not value:
            raise SpecError(self._key(key), value, "a non-empty string is required")
        return value

    def boolean(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise SpecError(self._key(key), value, "true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        """A copy of an object field ({} when absent)."""
        value = self.raw.get(key) or {}
        if not isinstance(value, Mapping):
            raise SpecError(self._key(key), value, "an object is required")
        return dict(value)

    def items(self, key: str) -> tuple[Any, ...]:
        """The entries of a list field (() when absent)."""
        value = self.raw.get(key) or []
        if not isinstance(value, list):
            raise SpecError(self._key(key), value, "a list is required")
        return tuple(value)
