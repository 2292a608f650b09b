"""Children repaired from their own watch events, within seconds, with a back-off.

A child (the engine or router Deployment, their Services) deleted from under the operator,
or edited by hand, used to come back only at the next resync (``--resync-seconds``, 300 s
by default). Now the child watches say when:

* ``DELETED`` of a child whose owner still exists and is not being deleted;
* a change of what someone wrote to the child: ``metadata.generation`` for kinds that
  keep one (a Deployment's spec, its replica count through the scale subresource), else
  ``metadata.resourceVersion`` (a Service has no generation and no status that changes).
  A Deployment's status updates move neither, so they never trigger a repair. In KEDA
  mode (``spec.autoscaling.engine: keda``) the engine Deployment's count is KEDA's: a
  digest of its spec without ``replicas`` stands for the generation, so KEDA's resizes
  trigger nothing and any other edit is repaired as before.

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
wait runs when its wait is over (one timer per owner), with a log line and a
``result="deferred"`` count.

What is remembered per child (:class:`ChildFingerprints`) is in memory only: after an
operator restart the first event of each child records it, and the ``resume`` handlers
reconcile every owner anyway.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.api import KubeApi
from kvpilot.operator.constants import ANNOTATION_REPLICAS_OWNER, FIELD_MANAGER

INITIAL_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 60.0
RESET_AFTER_SECONDS = 30.0


def fingerprint(body: Mapping[str, Any]) -> tuple[str, int | str] | None:
    """What a writer of ``body`` moved: ``("g", generation)`` when the kind keeps one, else
    ``("rv", resourceVersion)``; None when the object carries neither. A Deployment whose
    replica count another controller owns (annotation ``kvpilot.dev/replicas-owner``, KEDA
    mode) is ``("spec", digest of its spec without replicas)``: KEDA's resizes move the
    generation but are not edits to undo."""
    meta = body.get("metadata") or {}
    if (meta.get("annotations") or {}).get(ANNOTATION_REPLICAS_OWNER) and body.get("spec"):
        spec = {k: v for k, v in dict(body["spec"]).items() if k != "replicas"}
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
        return ("spec", digest)
    generation = meta.get("generation")
    if isinstance(generation, int) and not isinstance(generation, bool) and generation > 0:
        return ("g", generation)
    version = meta.get("resourceVersion")
    return ("rv", str(version)) if version else None


def _newer(now: tuple[str, int | str], before: tuple[str, int | str] | None) -> bool:
    """Whether ``now`` is a write after ``before``. Generations only grow, so an event
    that arrives after our own apply but shows an older generation (the watch stream lags
    behind the apply's response) is not a change; resourceVersions are opaque strings, so
    for them any difference is."""
    if before is None:
        return False
    if now[0] == "g" and before[0] == "g":
        return int(now[1]) > int(before[1])
    return now != before


@dataclass
class ChildFingerprints:
    """The newest :func:`fingerprint` known per child uid, from its watch events and our
    own applies (thread-safe: Kopf runs sync handlers in a thread pool)."""

    _seen: dict[str, tuple[str, int | str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def changed(self, body: Mapping[str, Any]) -> bool:
        """Record ``body``'s fingerprint; True when it is newer than the last one known for
        the same uid (False for a child seen for the first time, or without a uid)."""
        uid = (body.get("metadata") or {}).get("uid")
        now = fingerprint(body)
        if not uid or now is None:
            return False
        with self._lock:
            before = self._seen.get(uid)
            newer = _newer(now, before)
            if before is None or newer or now[0] != "g":
                self._seen[uid] = now
        return newer

    def record(self, body: Mapping[str, Any]) -> None:
        """Remember ``body``'s fingerprint as ours (what an apply of ours stored): the same
        bookkeeping as :meth:`changed`, whose answer does not matter here."""
        self.changed(body)

    def forget(self, body: Mapping[str, Any]) -> None:
        """Drop a deleted child."""
        uid = (body.get("metadata") or {}).get("uid")
        with self._lock:
            self._seen.pop(uid or "", None)


def _timer(seconds: float, fn: Callable[[], None]) -> None:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()


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
    # Runs a callable after some seconds (a daemon timer thread; a fake in tests).
    schedule: Callable[[float, Callable[[], None]], None] = _timer
    _owners: dict[tuple[str, str], _OwnerState] = field(default_factory=dict)
    _due: set[tuple[str, str]] = field(default_factory=set)
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

    def later(self, namespace: str, name: str, seconds: float, repair: Callable[[], object]) -> bool:
        """Run ``repair`` in ``seconds`` (a daemon timer thread), unless one is already due
        for this owner. Returns whether this call scheduled it."""
        key = (namespace, name)
        with self._lock:
            if key in self._due:
                return False

            # The timer thread runs in the scheduling handler's context: Kopf keeps its
            # settings in context variables, and posting an Event needs them.
            context = contextvars.copy_context()

            def fire() -> None:
                with self._lock:
                    self._due.discard(key)
                context.run(repair)

            self._due.add(key)
        self.schedule(max(0.0, seconds), fire)
        return True

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

    def apply(self, obj: Mapping[str, Any], force: bool = True,
              field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        stored = self.inner.apply(obj, force, field_manager)
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
