"""Operator-wide settings from the ``kvpilot operator`` flags (one frozen object, passed
to every reconcile; no globals)."""

from __future__ import annotations

from dataclasses import dataclass

POD_MONITOR_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class OperatorOptions:
    """Attributes:
        engine_image: image for engine pods whose spec sets no ``engine.image``.
        router_image: image for router pods whose spec sets no ``router.image``
            (docker/router.Dockerfile: vllm-router).
        pod_monitor: ``auto`` creates a PodMonitor when the monitoring.coreos.com/v1 API
            exists, ``always``/``never`` force it.
        resync_seconds: period of the slow reconcile timer that repairs drift.
        namespaces: namespaces to watch; empty = the whole cluster.
        pod_monitor_labels: ``(key, value)`` labels on every engine PodMonitor, for a
            Prometheus that selects PodMonitors by label (kube-prometheus-stack's default
            wants ``release: <its release name>``).
        headroom_priority_class: the PriorityClass of node-headroom placeholder pods
            (``autoscaling.nodeStartupSeconds``); the chart creates it below the engines'.
    """

    engine_image: str = "kvpilot/engine:0.1.0"
    router_image: str = "kvpilot/router:0.1.0"
    pod_monitor: str = "auto"
    resync_seconds: float = 300.0
    namespaces: tuple[str, ...] = ()
    pod_monitor_labels: tuple[tuple[str, str], ...] = ()
    headroom_priority_class: str = "kvpilot-headroom"

    def __post_init__(self) -> None:
        if self.pod_monitor not in POD_MONITOR_MODES:
            raise ValueError(
                f"pod_monitor must be one of {', '.join(POD_MONITOR_MODES)}; got {self.pod_monitor!r}"
            )
        if not self.engine_image:
            raise ValueError("engine_image must be a non-empty image reference")
        if not self.router_image:
            raise ValueError("router_image must be a non-empty image reference")
        for key, _ in self.pod_monitor_labels:
            if not key or "=" in key:
                raise ValueError(f"pod monitor label keys must be non-empty without '='; got {key!r}")
        if not self.headroom_priority_class:
            raise ValueError("headroom_priority_class must name a PriorityClass")
        if self.resync_seconds < 10:
            raise ValueError(f"resync_seconds must be >= 10; got {self.resync_seconds}")
