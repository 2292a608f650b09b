"""Metric sources for the autoscaler: where the engines' signals come from.

=============  ===========================================================================
``pods``       :class:`PodScrapeSource` scrapes each ready pod's ``/metrics`` over httpx
``prometheus`` :class:`PrometheusSource` sends PromQL (:mod:`.promql`) through
               prometheus-api-client
=============  ===========================================================================

Both answer a :class:`MetricsReading` of ``PodSignals`` (``None`` = missing, never zero)
plus the FinOps inputs and the demand held at the fleet's request router
(``router_queued``), and neither raises for an unreachable or empty source.
"""

from kvpilot.operator.autoscaling.metrics_source.factory import SOURCES, SourceConfig, build_source
from kvpilot.operator.autoscaling.metrics_source.names import EngineMetricNames, RouterMetricNames
from kvpilot.operator.autoscaling.metrics_source.pods import PodScrapeSource
from kvpilot.operator.autoscaling.metrics_source.prometheus import PrometheusSource
from kvpilot.operator.autoscaling.metrics_source.promql import (
    SeriesSelector,
    router_query,
    signal_queries,
)
from kvpilot.operator.autoscaling.metrics_source.reading import (
    EnginePod,
    MetricsReading,
    MetricsSource,
    router_queued,
)

__all__ = [
    "SOURCES",
    "EngineMetricNames",
    "EnginePod",
    "MetricsReading",
    "MetricsSource",
    "PodScrapeSource",
    "PrometheusSource",
    "RouterMetricNames",
    "SeriesSelector",
    "SourceConfig",
    "build_source",
    "router_query",
    "router_queued",
    "signal_queries",
]
