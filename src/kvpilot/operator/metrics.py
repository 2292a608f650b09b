"""The operator's own Prometheus metrics (served on ``--metrics-port``, default 9090).

=============================================  =======  =====================================
series                                         type     meaning
=============================================  =======  =====================================
``kvpilot_operator_info{version}``             gauge=1  the operator is up (alert: OperatorDown)
``kvpilot_operator_reconcile_total{result}``   counter  reconciles by result: success,
                                                        invalid_spec, apply_failed, conflict,
                                                        transient
``kvpilot_operator_reconcile_duration_seconds``  histo  time per reconcile
``kvpilot_operator_desired_replicas``          gauge    replicas applied to the Deployment
``kvpilot_operator_ready_replicas``            gauge    ready engine pods
``kvpilot_operator_min_replicas``,             gauge    autoscaling bounds (autoscaled only;
``kvpilot_operator_max_replicas``                       alert: AutoscalerPinnedAtMax)
``kvpilot_operator_scale_events_total``        counter  resizes by ``direction`` (up, down;
                                                        alert: ReplicaFlapping)
``kvpilot_operator_engine_restarts_total``     counter  engine container restarts seen, by
                                                        ``reason`` (OOMKilled, Error, ...;
                                                        :mod:`kvpilot.operator.restarts`)
=============================================  =======  =====================================

Per-resource series carry ``namespace`` and ``inference_deployment`` labels, the same
labels the engine series get from the PodMonitor, so alerts join them. Scrape the operator
with ``honor_labels: true`` so ``namespace`` is not renamed to ``exported_namespace``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot import __version__ as kvpilot_version
from kvpilot.operator.constants import SERIES_LABEL

RESULTS = ("success", "invalid_spec", "apply_failed", "conflict", "transient")
_KEYS = ("namespace", SERIES_LABEL)


class OperatorMetrics:
    """All operator series in one registry (a fresh one per instance, so tests and the
    process never share state)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.info = Gauge("kvpilot_operator_info", "kvpilot operator build (always 1)",
                          ["version"], registry=r)
        self.info.labels(version=kvpilot_version).set(1)
        # prometheus_client appends _total to counter names.
        self.reconciles = Counter("kvpilot_operator_reconcile", "Reconciles by result",
                                  ["result"], registry=r)
        for result in RESULTS:
            self.reconciles.labels(result=result)
        self.duration = Histogram("kvpilot_operator_reconcile_duration_seconds",
                                  "Seconds per reconcile", registry=r,
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.desired = Gauge("kvpilot_operator_desired_replicas",
                             "Replicas applied to the engine Deployment", _KEYS, registry=r)
        self.ready = Gauge("kvpilot_operator_ready_replicas", "Ready engine pods", _KEYS,
                           registry=r)
        self.min_replicas = Gauge("kvpilot_operator_min_replicas", "autoscaling.minReplicas",
                                  _KEYS, registry=r)
        self.max_replicas = Gauge("kvpilot_operator_max_replicas", "autoscaling.maxReplicas",
                                  _KEYS, registry=r)
        self.scale_events = Counter("kvpilot_operator_scale_events",
                                    "Engine Deployment resizes", [*_KEYS, "direction"],
                                    registry=r)
        self.engine_restarts = Counter("kvpilot_operator_engine_restarts",
                                       "Engine container restarts seen, by termination reason",
                                       [*_KEYS, "reason"], registry=r)
        self._restart_series: set[tuple[str, str, str]] = set()
        # Created by the first set_leader(): absent without --leader-elect, so that the
        # KVPilotOperatorNoLeader alert cannot fire on an operator that elects no one.
        self.leader: Gauge | None = None
        self.child_repairs = Counter("kvpilot_operator_child_repairs",
                                     "Children seen deleted or edited by someone else, by kind, "
                                     "cause (deleted, changed) and result (repaired, deferred by "
                                     "the back-off)", ["kind", "cause", "result"], registry=r)

    def count_restarts(self, namespace: str, name: str, reason: str, count: int) -> None:
        """Add ``count`` engine restarts of ``reason`` for a resource."""
        self._restart_series.add((namespace, name, reason))
        self.engine_restarts.labels(namespace, name, reason).inc(count)

    def set_leader(self, leading: bool) -> None:
        """This replica started or stopped leading (``kvpilot_operator_leader``)."""
        if self.leader is None:
            self.leader = Gauge("kvpilot_operator_leader",
                                "1 while this replica holds the leader Lease and acts, 0 while it "
                                "follows (absent without --leader-elect)", registry=self.registry)
        self.leader.set(1 if leading else 0)

    def count_repair(self, kind: str, cause: str, result: str) -> None:
        """One child repair (``kvpilot.operator.repair``) of ``kind`` for ``cause``."""
        self.child_repairs.labels(kind=kind, cause=cause, result=result).inc()

    def count_reconcile(self, result: str, seconds: float) -> None:
        if result not in RESULTS:
            raise ValueError(f"result must be one of {RESULTS}; got {result!r}")
        self.reconciles.labels(result=result).inc()
        self.duration.observe(seconds)

    def observe(self, namespace: str, name: str, status: Mapping[str, Any],
                autoscaling: Mapping[str, Any] | None) -> None:
        """Update the per-resource gauges from a status patch and the spec's autoscaling.

        Also creates the resource's resize counters at 0, so the first resize shows in
        ``increase()`` (a counter series born at 1 loses its first increment)."""
        for direction in ("up", "down"):
            self.scale_events.labels(namespace, name, direction)
        if "desiredReplicas" in status:
            self.desired.labels(namespace, name).set(status["desiredReplicas"])
        if "readyReplicas" in status:
            self.ready.labels(namespace, name).set(status["readyReplicas"])
        if autoscaling:
            self.min_replicas.labels(namespace, name).set(autoscaling.get("minReplicas", 1))
            self.max_replicas.labels(namespace, name).set(autoscaling["maxReplicas"])
        else:
            self._remove((self.min_replicas, self.max_replicas), namespace, name)

    def count_scale(self, namespace: str, name: str, before: int, after: int) -> None:
        if after != before:
            direction = "up" if after > before else "down"
            self.scale_events.labels(namespace, name, direction).inc()

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted resource's series (so no alert fires on a ghost)."""
        self._remove((self.desired, self.ready, self.min_replicas, self.max_replicas),
                     namespace, name)
        for direction in ("up", "down"):
            with contextlib.suppress(KeyError):
                self.scale_events.remove(namespace, name, direction)
        for labels in [k for k in self._restart_series if k[:2] == (namespace, name)]:
            self._restart_series.discard(labels)
            with contextlib.suppress(KeyError):
                self.engine_restarts.remove(*labels)

    @staticmethod
    def _remove(gauges: tuple[Gauge, ...], namespace: str, name: str) -> None:
        for gauge in gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)
