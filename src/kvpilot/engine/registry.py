"""Name -> implementation registries behind the engine's pick-by-name flags.

One small generic class serves ``--tool-call-parser``
(:mod:`kvpilot.engine.server.tool_parsers`), ``--reasoning-parser``
(:mod:`kvpilot.engine.server.reasoning`) and ``--attention-backend``
(:mod:`kvpilot.engine.attention.backend`), after vLLM's ``ToolParserManager`` and
``ReasoningParserManager``: an implementation is registered eagerly with the
``register`` decorator, or lazily as ``"module:attribute"`` (imported on first use, so a
CPU install never imports triton). ``get`` raises a ValueError that names the kind, the
bad value and the names allowed; the order of the names is the order of registration.

A registry reads like a read-only mapping (``in``, iteration, ``len``, ``keys``,
``items``, ``reg[name]``), so ``dict(reg)`` lists what is registered; only ``get``
(which raises ValueError instead of returning a default) differs from ``Mapping.get``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")

UNKNOWN = "unknown {kind} {name!r}; expected one of: {allowed}"


class Registry(Generic[T]):
    """Implementations of one kind (e.g. ``"tool call parser"``) by name.

    Args:
        kind: what is registered, in words; it starts the error messages.
        unknown: the message for an unknown name, a ``str.format`` template with
            ``{kind}``, ``{name!r}`` and ``{allowed}`` (the names, comma-separated, in
            registration order).
    """

    def __init__(self, kind: str, *, unknown: str = UNKNOWN) -> None:
        self.kind = kind
        self._unknown = unknown
        self._loaders: dict[str, Callable[[], T]] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers its argument (a class or a factory) as ``name``
        and returns it unchanged. Raises ValueError when ``name`` is taken."""

        def decorate(obj: T) -> T:
            self._add(name, lambda: obj)
            return obj

        return decorate

    def register_lazy(self, name: str, target: str) -> None:
        """Register ``"module:attribute"`` as ``name``, imported by the first ``get``.
        Raises ValueError when ``name`` is taken or ``target`` has no ``:``."""
        module, sep, attribute = target.partition(":")
        if not sep or not module or not attribute:
            raise ValueError(f"{self.kind} {name!r}: target {target!r} is not 'module:attribute'")

        def load() -> T:
            try:
                obj: T = getattr(importlib.import_module(module), attribute)
            except ImportError as e:
                raise ValueError(f"{self.kind} {name!r} is not available here: {e}") from e
            return obj

        self._add(name, load)

    def _add(self, name: str, loader: Callable[[], T]) -> None:
        if name in self._loaders:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._loaders[name] = loader

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._loaders)

    def unknown(self, name: str) -> ValueError:
        """The error for a name that is not registered (to raise)."""
        return ValueError(self._unknown.format(kind=self.kind, name=name,
                                               allowed=", ".join(self._loaders)))

    def get(self, name: str) -> T:
        """The implementation registered as ``name`` (importing a lazy one).

        Raises:
            ValueError: ``name`` is not registered (the message lists the names), or a
                lazy implementation cannot be imported here.
        """
        loader = self._loaders.get(name)
        if loader is None:
            raise self.unknown(name)
        return loader()

    def __getitem__(self, name: str) -> T:
        """Like ``get``, but KeyError for an unknown name (the mapping protocol)."""
        if name not in self._loaders:
            raise KeyError(name)
        return self._loaders[name]()

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def keys(self) -> tuple[str, ...]:
        """The names (``dict(registry)`` uses it)."""
        return self.names()

    def items(self) -> list[tuple[str, T]]:
        """(name, implementation) pairs; lazy implementations are imported."""
        return [(name, self[name]) for name in self._loaders]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self._loaders)})"
