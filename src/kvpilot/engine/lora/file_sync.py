"""Keep the engine's adapters in step with an adapters file (``--lora-adapters-file``).

The operator writes ``spec.adapters`` into a ConfigMap that the engine pod mounts; the
kubelet refreshes the mounted file when the ConfigMap changes. At start-up the server
loads every adapter of the file before it reports ready, so a new or restarted pod never
receives a request for an adapter it lacks. Afterwards :meth:`AdapterFileSync.sync` runs
every few seconds: it loads what the file gained, unloads what it lost and reloads an
adapter whose URI changed. The operator also loads and unloads through the HTTP API for
an immediate effect; both act from the same spec, so they agree, and what the file
changes is only what the file added (an adapter loaded through the API alone, under a
name the file never listed, is left alone).

A failed load is logged with its reason and retried on the next change of the file or
after ``retry_seconds``; it never stops the other adapters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.engine.errors import (
    InvalidRequestError,
    LoRAAdapterExistsError,
    LoRAAdapterNotFoundError,
)
from kvpilot.engine.lora.manager import LoRAManager
from kvpilot.engine.lora.sources import read_adapters_file

logger = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """What one :meth:`AdapterFileSync.sync` did: names loaded, unloaded, and failed
    (name -> reason)."""

    loaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class AdapterFileSync:
    """The adapters file, applied to a :class:`LoRAManager`.

    Args:
        manager: the engine's adapters.
        path: the adapters file (a JSON list of ``{"name", "uri"}``).
        retry_seconds: how long a failed adapter waits before it is tried again while
            the file does not change.
        clock: seconds (monotonic), for tests.
    Thread safety: one caller at a time (the server's sync task).
    """

    def __init__(self, manager: LoRAManager, path: str | Path, retry_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self.path = Path(path)
        self.retry_seconds = retry_seconds
        self.clock = clock
        self.managed: dict[str, str] = {}  # name -> URI: what the file loaded
        self.failed: dict[str, tuple[str, float]] = {}  # name -> (URI, when it failed)
        self._last_text: str | None = None

    def sync(self) -> SyncResult:
        """Apply the file once (blocking: loads read disks and may fetch; call off the
        event loop). A file that cannot be read or parsed changes nothing and is logged.
        Returns what changed."""
        result = SyncResult()
        try:
            text = self.path.read_text()
            wanted = dict(read_adapters_file(self.path))
        except (OSError, ValueError) as e:
            logger.error("adapters file %s: %s; adapters unchanged", self.path, e)
            return result
        changed = text != self._last_text
        self._last_text = text
        now = self.clock()
        for name, uri in list(self.managed.items()):
            if wanted.get(name) == uri:
                continue
            current = self.manager.get(name)
            if current is not None and current.lora_path == uri:
                try:
                    self.manager.unregister(name)
                    result.unloaded.append(name)
                except LoRAAdapterNotFoundError:
                    pass  # unloaded meanwhile through the API
            del self.managed[name]
        for name, uri in wanted.items():
            current = self.manager.get(name)
            if current is not None and current.lora_path == uri:
                self.managed[name] = uri  # loaded already (at start-up or through the API)
                self.failed.pop(name, None)
                continue
            failed = self.failed.get(name)
            if failed is not None and failed[0] == uri and not changed and now - failed[1] < self.retry_seconds:
                continue
            try:
                if current is not None:  # the same name, another URI: the file's wins
                    self.manager.unregister(name)
                self.manager.register(name, uri)
            except LoRAAdapterExistsError:
                continue  # loaded meanwhile through the API: seen on the next pass
            except (InvalidRequestError, LoRAAdapterNotFoundError, OSError) as e:
                self.failed[name] = (uri, now)
                result.failed[name] = str(e)
                logger.error("adapter %r from %s: %s", name, uri, e)
                continue
            self.managed[name] = uri
            self.failed.pop(name, None)
            result.loaded.append(name)
        for name in [n for n in self.failed if n not in wanted]:
            del self.failed[name]
        if result.loaded or result.unloaded:
            logger.info("adapters file %s: loaded %s, unloaded %s", self.path, result.loaded, result.unloaded)
        return result
