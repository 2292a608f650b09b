"""Engine container restarts, reported on the InferenceDeployment that owns the pod.

The kubelet restarts an engine container that exits, that its liveness probe declares
dead, or that the kernel's OOM killer ends at the memory limit. Kubernetes records that
only on the pod (``status.containerStatuses[].restartCount`` and ``lastState``), where
someone watching ``kubectl get infd`` never looks. The operator watches the engine pods
(it owns them through their Deployment) and, for every restart it sees happen, posts a
Warning Event ``EngineRestarted`` on the owner and counts it in
``kvpilot_operator_engine_restarts_total{namespace, inference_deployment, reason}``.

Only restarts seen happening are reported: the first time the operator sees a pod (a new
pod, or every pod after the operator itself restarted) its counts are the baseline, since
when those restarts happened is unknown. A pod deleted is forgotten.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Advice per termination reason, for the Event's message.
_ADVICE = {
    "OOMKilled": "it exceeded its memory limit: raise spec.resources.limits.memory or lower "
                 "the KV cache (engine --kv-cache-memory / --gpu-memory-utilization)",
    "Error": "it exited with an error: see `kubectl logs --previous`",
    "Completed": "it exited cleanly, as after SIGTERM when a liveness probe failed: see the "
                 "pod's events (`kubectl describe pod`)",
}


@dataclass(frozen=True)
class Restart:
    """One container's restarts seen between two observations of its pod.

    Attributes:
        pod: the pod's name.
        container: the container's name.
        added: restarts since the last observation (>= 1).
        restart_count: the container's ``restartCount`` now.
        reason: ``lastState.terminated.reason`` (``OOMKilled``, ``Error``, ``Completed``...),
            ``Unknown`` when the kubelet recorded none.
        exit_code: ``lastState.terminated.exitCode`` (None when not recorded).
    """

    pod: str
    container: str
    added: int
    restart_count: int
    reason: str
    exit_code: int | None

    def message(self) -> str:
        exit_code = "" if self.exit_code is None else f", exit code {self.exit_code}"
        advice = _ADVICE.get(self.reason, "see the pod's events (`kubectl describe pod`)")
        return (f"pod {self.pod} container {self.container} restarted ({self.reason}"
                f"{exit_code}; {self.restart_count} restarts in all): {advice}")


def restart_counts(pod: Mapping[str, Any]) -> dict[str, int]:
    """``{container name: restartCount}`` of a pod's containers (init containers too)."""
    status = pod.get("status") or {}
    counts: dict[str, int] = {}
    for key in ("initContainerStatuses", "containerStatuses"):
        for entry in status.get(key) or ():
            count = entry.get("restartCount")
            if isinstance(entry.get("name"), str) and isinstance(count, int) \
                    and not isinstance(count, bool):
                counts[entry["name"]] = count
    return counts


def _last_termination(pod: Mapping[str, Any], container: str) -> tuple[str, int | None]:
    status = pod.get("status") or {}
    for key in ("initContainerStatuses", "containerStatuses"):
        for entry in status.get(key) or ():
            if entry.get("name") == container:
                terminated = (entry.get("lastState") or {}).get("terminated") or {}
                code = terminated.get("exitCode")
                return (str(terminated.get("reason") or "Unknown"),
                        code if isinstance(code, int) and not isinstance(code, bool) else None)
    return "Unknown", None


def restarts_between(before: Mapping[str, int], pod: Mapping[str, Any]) -> list[Restart]:
    """The restarts of ``pod`` since counts ``before`` (pure). A container absent from
    ``before`` (added to the pod later) counts from 0."""
    name = str((pod.get("metadata") or {}).get("name") or "")
    out = []
    for container, count in sorted(restart_counts(pod).items()):
        added = count - before.get(container, 0)
        if added > 0:
            reason, code = _last_termination(pod, container)
            out.append(Restart(name, container, added, count, reason, code))
    return out


class RestartTracker:
    """Restart counts last seen per pod uid; thread-safe (Kopf runs sync handlers in a
    thread pool). Mutated by :meth:`observe` and :meth:`forget`."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def observe(self, pod: Mapping[str, Any]) -> list[Restart]:
        """The restarts since this pod was last observed; none the first time (baseline)."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if not uid:
            return []
        counts = restart_counts(pod)
        with self._lock:
            before = self._seen.get(uid)
            self._seen[uid] = counts
        return [] if before is None else restarts_between(before, pod)

    def forget(self, pod: Mapping[str, Any]) -> None:
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        with self._lock:
            self._seen.pop(uid, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
