"""What every handler shares: :class:`OperatorContext`, passed to Kopf as ``memo``, and
how Events are posted."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, cast

import kopf

from kvpilot.operator.api import KubeApi
from kvpilot.operator.autoscaling.metrics_source import MetricsSource, SourceConfig, build_source
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.repair import ChildFingerprints, RecordingApi, RepairBackoff
from kvpilot.operator.restarts import RestartTracker

EventPoster = Callable[[Mapping[str, Any], str, str, str], None]


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


def post_kopf_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event through Kopf's queue (safe from sync handlers' threads)."""
    # kopf.event reads the object reference from any mapping; its annotation names Body.
    kopf.event(cast(kopf.Body, body), type=type_, reason=reason, message=message)


@dataclass(frozen=True)
class OperatorContext:
    """Everything handlers need, passed to Kopf as ``memo`` (copied per object).

    Attributes:
        api: the Kubernetes API (a fake in tests).
        options: operator-wide settings.
        metrics: the operator's Prometheus series.
        clock: returns the current time (timezone-aware).
        post_event: posts an Event on an object.
        source_factory: builds the autoscaler's metric source for a resource (a fake in
            tests).
        restarts: engine restart counts last seen per pod (shared by every copy of the
            memo: Kopf copies it shallowly per object).
        fingerprints, repairs: what each child last looked like and the per-owner repair
            back-off (:mod:`kvpilot.operator.repair`; shared likewise).
        monotonic: seconds for the back-off (a fake in tests).

    ``api`` is wrapped in a :class:`~kvpilot.operator.repair.RecordingApi`.
    """

    api: KubeApi
    options: OperatorOptions
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    clock: Callable[[], datetime] = _utc_now
    post_event: EventPoster = post_kopf_event
    source_factory: Callable[[SourceConfig], MetricsSource] = build_source
    restarts: RestartTracker = field(default_factory=RestartTracker)
    fingerprints: ChildFingerprints = field(default_factory=ChildFingerprints)
    repairs: RepairBackoff = field(default_factory=RepairBackoff)
    monotonic: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        # Every apply records what it stored, so our own writes' watch events are known
        # as ours (kvpilot.operator.repair).
        if not isinstance(self.api, RecordingApi):
            object.__setattr__(self, "api", RecordingApi(self.api, self.fingerprints))
