"""Children repaired from their own watch events, within seconds, with a back-off.

A child (the engine or router Deployment, their Services) deleted from under the operator,
or edited by hand, used to come back only at the next resync (``--resync-seconds``, 300 s
by default). Now the child watches say when:

* ``DELETED`` of a child whose owner still exists and is not being deleted;
* a change of what someone wrote to the child: ``metadata.generation`` for kinds that
  keep one (a Deployment's spec, its replica count through the scale subresource), else
  ``metadata.resourceVersion`` (a Service has no generation and no status that changes).
  A Deployment's status updates move neither, so they never trigger a repair.

Then the owner is reconciled at once (server-side apply, force: every field kvpilot sets
goes back to its value; fields it does not set are left to whoever set them, as apply
does). Our own applies move the generation too: :class:`RecordingApi` records what each
apply stored, so its watch event matches and triggers nothing (when the event outruns the
record, one reconcile that changes nothing follows).

The back-off (:class:`RepairBackoff`) keeps a fight with another controller from becoming
a hot loop: the first repair of an owner is immediate; while repairs keep coming, each
waits twice as long as the one before (1 s, 2 s, ... capped at
:data:`MAX_BACKOFF_SECONDS`), and :data:`RESET_AFTER_SECONDS` without one resets it (short,
so the autoscaler's own scale-ups minutes apart never build it up). A repair that has to
wait is skipped, with a log line: the next event or the resync does it.

What is remembered per child (:class:`ChildFingerprints`) is in memory only: after an
operator restart the first event of each child records it, and the ``resume`` handlers
reconcile every owner anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.api import KubeApi

INITIAL_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 60.0
RESET_AFTER_SECONDS = 30.0


def fingerprint(body: Mapping[str, Any]) -> str | None:
    """What a writer of ``body`` moved: ``g<generation>`` when the kind keeps one, else
    ``rv<resourceVersion>``; None when the object carries neither."""
    meta = body.get("metadata") or {}
    generation = meta.get("generation")
    if isinstance(generation, int) and generation > 0:
        return f"g{generation}"
    version = meta.get("resourceVersion")
    return f"rv{version}" if version else None


@dataclass
class ChildFingerprints:
    """The last :func:`fingerprint` seen per child uid (thread-safe: Kopf runs sync
    handlers in a thread pool)."""

    _seen: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def changed(self, body: Mapping[str, Any]) -> bool:
        """Record ``body``'s fingerprint; True when it differs from the last one seen for
        the same uid (False for a child seen for the first time, or without a uid)."""
        uid = (body.get("metadata") or {}).get("uid")
        now = fingerprint(body)
        if not uid or now is None:
            return False
        with self._lock:
            before = self._seen.get(uid)
            self._seen[uid] = now
        return before is not None and before != now

    def record(self, body: Mapping[str, Any]) -> None:
        """Remember ``body``'s fingerprint as ours (what an apply of ours stored)."""
        uid = (body.get("metadata") or {}).get("uid")
        now = fingerprint(body)
        if uid and now is not None:
            with self._lock:
                self._seen[uid] = now

    def forget(self, body: Mapping[str, Any]) -> None:
        """Drop a deleted child."""
        uid = (body.get("metadata") or {}).get("uid")
        with self._lock:
            self._seen.pop(uid or "", None)


@dataclass
class _OwnerState:
    last: float
    wait: float


@dataclass
class RepairBackoff:
    """Per owner, when the next repair may run (see the module docstring)."""

    initial: float = INITIAL_BACKOFF_SECONDS
    maximum: float = MAX_BACKOFF_SECONDS
    reset_after: float = RESET_AFTER_SECONDS
    _owners: dict[tuple[str, str], _OwnerState] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self, namespace: str, name: str, now: float) -> tuple[bool, float]:
        """Whether a repair of ``namespace/name`` may run at ``now`` (monotonic seconds),
        and if not, how many seconds remain. An allowed repair is counted: the next one
        waits longer."""
        key = (namespace, name)
        with self._lock:
            state = self._owners.get(key)
            if state is None or now - state.last >= self.reset_after:
                self._owners[key] = _OwnerState(last=now, wait=self.initial)
                return True, 0.0
            remaining = state.last + state.wait - now
            if remaining > 0:
                return False, remaining
            self._owners[key] = _OwnerState(last=now, wait=min(self.maximum, state.wait * 2))
            return True, 0.0

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted owner."""
        with self._lock:
            self._owners.pop((namespace, name), None)


class RecordingApi:
    """A :class:`~kvpilot.operator.api.KubeApi` that records the fingerprint of every
    object it applies, so the watch event of our own apply is not taken for someone
    else's edit. Delegates everything else (also what a test fake adds)."""

    def __init__(self, api: KubeApi, fingerprints: ChildFingerprints) -> None:
        self.inner = api
        self.fingerprints = fingerprints

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.inner.get(api_version, kind, namespace, name)

    def apply(self, obj: Mapping[str, Any], force: bool = True) -> dict[str, Any]:
        stored = self.inner.apply(obj, force)
        self.fingerprints.record(stored)
        return stored

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any],
                     resource_version: str | None = None) -> None:
        self.inner.patch_status(namespace, name, status, resource_version)

    def delete(self, api_version: str, kind: str, namespace: str, name: str,
               uid: str | None = None) -> bool:
        return self.inner.delete(api_version, kind, namespace, name, uid)

    def has_api(self, group_version: str, kind: str) -> bool:
        return self.inner.has_api(group_version, kind)

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return self.inner.list_pods(namespace, labels)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
