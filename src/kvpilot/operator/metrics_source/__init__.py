"""Metric sources for the autoscaler: where the engines' signals come from.

=============  ===========================================================================
``pods``       :class:`PodScrapeSource` scrapes each ready pod's ``/metrics`` over httpx
``prometheus`` :class:`PrometheusSource` sends PromQL (:mod:`.promql`) through
               prometheus-api-client
=============  ===========================================================================

Both answer a :class:`MetricsReading` of ``PodSignals`` (``None`` = missing, never zero)
plus the FinOps inputs, and neither raises for an unreachable or empty source.
"""

from kvpilot.operator.metrics_source.factory import SOURCES, SourceConfig, build_source
from kvpilot.operator.metrics_source.names import EngineMetricNames
from kvpilot.operator.metrics_source.pods import PodScrapeSource
from kvpilot.operator.metrics_source.prometheus import PrometheusSource
from kvpilot.operator.metrics_source.promql import SeriesSelector, signal_queries
from kvpilot.operator.metrics_source.reading import EnginePod, MetricsReading, MetricsSource

__all__ = [
    "SOURCES",
    "EngineMetricNames",
    "EnginePod",
    "MetricsReading",
    "MetricsSource",
    "PodScrapeSource",
    "PrometheusSource",
    "SeriesSelector",
    "SourceConfig",
    "build_source",
    "signal_queries",
]
