"""The autoscaling spec: what a user asks of the policy (``spec.autoscaling`` on the CR).

:class:`AutoscalingSpec` is frozen and validated once in ``__post_init__``; bad values raise
``ValueError`` naming the field (in the CRD's camelCase), the value received and what is
allowed. :meth:`AutoscalingSpec.from_crd` reads the CR's camelCase mapping.

The fields below ``interval_seconds`` are policy constants the CRD does not expose (yet);
their defaults are the ones the simulator and benchmark were run with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# CRD camelCase name -> dataclass field, for from_crd() and error messages.
_CRD_NAMES = {
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "targetCacheUsage": "target_cache_usage",
    "targetQueueDepth": "target_queue_depth",
    "startupSeconds": "startup_seconds",
    "scaleUpStabilizationSeconds": "scale_up_stabilization_seconds",
    "scaleDownStabilizationSeconds": "scale_down_stabilization_seconds",
    "intervalSeconds": "interval_seconds",
}
_FIELD_TO_CRD = {v: k for k, v in _CRD_NAMES.items()}


def _name(field_name: str) -> str:
    return _FIELD_TO_CRD.get(field_name, field_name)


@dataclass(frozen=True)
class AutoscalingSpec:
    """Targets, bounds and windows of the scaling policy.

    Attributes:
        min_replicas: lower bound, >= 1 (scale to zero is not supported: a fleet with no
            pods reports no signal to scale up from).
        max_replicas: upper bound, >= min_replicas.
        target_cache_usage: wanted mean non-evictable KV usage per replica, in (0, 1).
        target_queue_depth: waiting requests per ready replica above which the queue is
            pressure (> 0).
        startup_seconds: how long a new pod takes from creation to serving (>= 0): the
            forecast horizon.
        scale_up_stabilization_seconds: HPA-style window for the reactive rules (headroom,
            queue drain): a scale-up uses the lowest of their recommendations in this window.
            0 (default) = act on the latest observation. The forecast and the starvation
            alarm never wait for it.
        scale_down_stabilization_seconds: a scale-down needs a full window of complete
            observations whose recommendations were all below the current count.
        interval_seconds: how often the operator calls the policy (> 0); also bounds the gap
            between observations that still counts as a continuous window.
        tolerance: dead band around a target, as a ratio (HPA's default 0.1).
        starvation_usage: per-pod KV usage at or above which the starvation alarm fires.
        forecast_window_seconds: span of history the least-squares slope is fitted over.
        forecast_margin_seconds: added to ``startup_seconds`` to form the forecast horizon
            (covers the decision interval and metric lag).
    """

    min_replicas: int = 1
    max_replicas: int = 10
    target_cache_usage: float = 0.75
    target_queue_depth: float = 4.0
    startup_seconds: float = 120.0
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    interval_seconds: float = 15.0
    tolerance: float = 0.1
    starvation_usage: float = 0.95
    forecast_window_seconds: float = 120.0
    forecast_margin_seconds: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{_name(f.name)} must be a number; got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{_name(f.name)} must be finite; got {value!r}")
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) and not float(value).is_integer():
                raise ValueError(f"{_name(name)} must be a whole number; got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.min_replicas < 1:
            raise ValueError(
                "minReplicas must be >= 1 (scale to zero is not supported);"
                f" got {self.min_replicas}"
            )
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"maxReplicas must be >= minReplicas ({self.min_replicas}); got {self.max_replicas}"
            )
        if not 0.0 < self.target_cache_usage < 1.0:
            raise ValueError(f"targetCacheUsage must be in (0, 1); got {self.target_cache_usage}")
        if self.target_queue_depth <= 0:
            raise ValueError(f"targetQueueDepth must be > 0; got {self.target_queue_depth}")
        if self.interval_seconds <= 0:
            raise ValueError(f"intervalSeconds must be > 0; got {self.interval_seconds}")
        for name in (
            "startup_seconds",
            "scale_up_stabilization_seconds",
            "scale_down_stabilization_seconds",
            "forecast_margin_seconds",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{_name(name)} must be >= 0; got {getattr(self, name)}")
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1); got {self.tolerance}")
        if not self.target_cache_usage < self.starvation_usage <= 1.0:
            raise ValueError(
                f"starvation_usage must be in (targetCacheUsage={self.target_cache_usage}, 1];"
                f" got {self.starvation_usage}"
            )
        if self.forecast_window_seconds < 2 * self.interval_seconds:
            raise ValueError(
                f"forecast_window_seconds must be >= 2 x intervalSeconds "
                f"({2 * self.interval_seconds}); got {self.forecast_window_seconds}"
            )

    @property
    def forecast_horizon_seconds(self) -> float:
        """How far ahead the forecast must look: start-up time plus the margin."""
        return self.startup_seconds + self.forecast_margin_seconds

    @classmethod
    def from_crd(cls, autoscaling: Mapping[str, Any]) -> AutoscalingSpec:
        """Build from the CR's ``spec.autoscaling`` mapping (camelCase keys).

        Unknown keys (e.g. ``metrics``) are ignored; absent keys take the defaults.
        """
        kwargs = {_CRD_NAMES[k]: v for k, v in autoscaling.items() if k in _CRD_NAMES}
        return cls(**kwargs)

    def to_crd(self) -> dict[str, float | int]:
        """The CRD-visible fields, camelCase (the inverse of :meth:`from_crd`)."""
        return {crd: getattr(self, name) for crd, name in _CRD_NAMES.items()}
