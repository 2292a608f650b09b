"""Build the metric source ``spec.autoscaling.metrics`` names, for one InferenceDeployment."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpilot.operator.autoscaling.metrics_source import pods, prometheus
from kvpilot.operator.autoscaling.metrics_source.pods import PodScrapeSource
from kvpilot.operator.autoscaling.metrics_source.prometheus import PrometheusSource
from kvpilot.operator.autoscaling.metrics_source.promql import SeriesSelector
from kvpilot.operator.autoscaling.metrics_source.reading import MetricsSource
from kvpilot.operator.logs import object_logger

SOURCES = ("prometheus", "pods")


@dataclass(frozen=True)
class SourceConfig:
    """Which source reads one resource's fleet. Equal configs can share a source instance;
    a changed one (another URL) needs a new one.

    Attributes:
        kind: ``prometheus`` or ``pods``.
        url: the Prometheus base URL (``prometheus`` only).
        namespace / name: the InferenceDeployment.
    """

    kind: str
    url: str | None
    namespace: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in SOURCES:
            raise ValueError(
                f"metrics.source must be one of {', '.join(SOURCES)}; got {self.kind!r}")
        if self.kind == "prometheus" and not self.url:
            raise ValueError("metrics.url is required when metrics.source is prometheus")


def build_source(config: SourceConfig) -> MetricsSource:
    """A new source for ``config`` (the caller closes it when done)."""
    if config.kind == "prometheus":
        assert config.url is not None
        log = object_logger(logging.getLogger(prometheus.__name__), config.namespace, config.name)
        return PrometheusSource(config.url, SeriesSelector(config.namespace, config.name), log=log)
    log = object_logger(logging.getLogger(pods.__name__), config.namespace, config.name)
    return PodScrapeSource(f"{config.namespace}/{config.name}", log=log)
