"""``spec.autoscaling`` -> the policy's own :class:`~kvpilot.autoscaler.spec.AutoscalingSpec`
(the operator, the simulator and the policy share one spec)."""

from __future__ import annotations

import re
from typing import Any

from kvpilot.autoscaler.spec import (
    AUTOSCALING_ENGINES,
    MAX_SLO_SECONDS,
    METRIC_SOURCES,
    STARVATION_USAGE,
    AutoscalingSpec,
    MetricsSourceSpec,
    SloSpec,
)
from kvpilot.operator.spec.defaults import DEFAULTS
from kvpilot.operator.spec.fields import FieldReader, SpecError

# The most engine replicas (spec.replicas, autoscaling.minReplicas and maxReplicas).
MAX_REPLICAS = 1000
# The autoscaler fits its KV forecast over two minutes: it needs a decision at least a minute.
MAX_INTERVAL_SECONDS = 60
# The smallest trigger threshold KEDA can express: it reads thresholds as milli-quantities.
KEDA_MIN_THRESHOLD = 0.001


def parse_autoscaling(raw: Any) -> AutoscalingSpec:
    """The CRD's ranges first (each error names its ``spec.autoscaling`` path), then the
    policy's own checks in :class:`AutoscalingSpec` (a ValueError left by them means the
    ranges here let through what the policy refuses: reported on ``autoscaling``).

    ``engine: keda`` (docs/autoscaling.md, "KEDA mode") needs ``metrics.source:
    prometheus`` (KEDA's triggers query that Prometheus), ``minReplicas`` >= 1 (scale
    to zero is the operator's own, through its router; KEDA mode does not do it) and
    ``nodeStartupSeconds`` 0 (node headroom follows the policy's forecast) and each target
    at least :data:`KEDA_MIN_THRESHOLD` (KEDA's thresholds are milli-quantities), and no
    ``slo`` (:func:`parse_slo`: KEDA's HPA cannot run the latency model).

    Raises:
        SpecError: a field out of range or not allowed with another, named by its path.
    """
    r = FieldReader(raw, "autoscaling", DEFAULTS)
    m = FieldReader(r.raw.get("metrics"), "autoscaling.metrics", DEFAULTS)
    source, url = m.choice("source", METRIC_SOURCES), m.string("url")
    if source == "prometheus" and (url is None or not re.fullmatch(r"https?://\S+", url)):
        raise SpecError("autoscaling.metrics.url", url,
                        "an http(s) URL is required when metrics.source is prometheus")
    engine = r.choice("engine", AUTOSCALING_ENGINES)
    if engine == "keda" and source != "prometheus":
        raise SpecError("autoscaling.metrics.source", source,
                        "prometheus is required when autoscaling.engine is keda (KEDA's"
                        " triggers query Prometheus; it cannot scrape the pods)")
    min_replicas = r.integer("minReplicas", 0, MAX_REPLICAS)
    if engine == "keda" and min_replicas == 0:
        raise SpecError("autoscaling.minReplicas", 0,
                        ">= 1 when autoscaling.engine is keda (scale to zero and its"
                        " activation through the router are kvpilot's own; use engine"
                        " kvpilot for minReplicas 0)")
    max_replicas = r.integer("maxReplicas", 1, MAX_REPLICAS)
    if min_replicas > max_replicas:
        raise SpecError("autoscaling.minReplicas", min_replicas,
                        f"must be <= autoscaling.maxReplicas ({max_replicas})")
    node_startup_seconds = r.integer("nodeStartupSeconds", 0, 3600)
    if engine == "keda" and node_startup_seconds:
        raise SpecError("autoscaling.nodeStartupSeconds", node_startup_seconds,
                        "0 when autoscaling.engine is keda (node headroom follows kvpilot's KV"
                        " forecast, which KEDA mode does not run)")
    targets = {
        "targetCacheUsage": r.number("targetCacheUsage", 0.0, STARVATION_USAGE,
                                     lo_open=True, hi_open=True),
        "targetQueueDepth": r.number("targetQueueDepth", 0.0, 10000.0, lo_open=True),
        "targetSaturation": r.number("targetSaturation", 0.0, 1.0, lo_open=True),
    }
    if engine == "keda":
        # KEDA reads a trigger threshold as a milli-quantity: under 0.001 it is a target of 0.
        # (targetSaturation's threshold is maxNumSeqs x targetSaturation, maxNumSeqs >= 1.)
        for field, value in targets.items():
            if value < KEDA_MIN_THRESHOLD:
                raise SpecError(f"autoscaling.{field}", value,
                                f">= {KEDA_MIN_THRESHOLD} when autoscaling.engine is keda (KEDA"
                                " reads its thresholds in thousandths)")
    slo = parse_slo(r.raw.get("slo"), engine)
    try:
        return AutoscalingSpec(
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_cache_usage=targets["targetCacheUsage"],
            target_queue_depth=targets["targetQueueDepth"],
            target_saturation=targets["targetSaturation"],
            startup_seconds=r.integer("startupSeconds", 0, 7200),
            scale_up_stabilization_seconds=r.integer("scaleUpStabilizationSeconds", 0, 3600),
            scale_down_stabilization_seconds=r.integer("scaleDownStabilizationSeconds", 0,
                                                       86400),
            interval_seconds=r.integer("intervalSeconds", 1, MAX_INTERVAL_SECONDS),
            node_startup_seconds=node_startup_seconds,
            scale_to_zero_after_seconds=r.integer("scaleToZeroAfterSeconds", 1, 86400),
            activation_timeout_seconds=r.integer("activationTimeoutSeconds", 1, 3600),
            metrics=MetricsSourceSpec(source, url),
            engine=engine,
            slo=slo,
        )
    except ValueError as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError("autoscaling", dict(r.raw), str(exc)) from None


def parse_slo(raw: Any, engine: str) -> SloSpec | None:
    """``spec.autoscaling.slo`` -> :class:`~kvpilot.autoscaler.spec.SloSpec`, or None when
    absent. ``ttftSeconds`` and ``itlSeconds`` are numbers in (0, 86400] (a day), at least
    one of them set; ``percentile`` is in (0, 1), default 0.9. The profile of the
    latency prior is ``cpu`` here; :func:`kvpilot.operator.spec.parse_spec` sets ``gpu``
    for pods that ask for GPUs.

    KEDA mode refuses an SLO by name: KEDA's HPA scales on one PromQL value per trigger
    against a fixed threshold, and the latency rule needs the fitted model, the forecast
    load and the consolidation check, which only the operator's own loop runs (a
    ``histogram_quantile`` trigger would scale on the latency measured, after it is
    missed, and never hold a scale-down; docs/autoscaling.md, "KEDA mode").

    Raises:
        SpecError: a field out of range (named ``spec.autoscaling.slo.FIELD``), an SLO
            with neither target, or any SLO with ``engine: keda``.
    """
    if raw is None:
        return None
    s = FieldReader(raw, "autoscaling.slo", DEFAULTS)
    if engine == "keda":
        raise SpecError("autoscaling.slo", dict(s.raw),
                        "not allowed when autoscaling.engine is keda: KEDA's HPA cannot run"
                        " the latency model (use engine kvpilot for latency targets)")
    ttft = s.optional_number("ttftSeconds", 0.0, MAX_SLO_SECONDS, lo_open=True)
    itl = s.optional_number("itlSeconds", 0.0, MAX_SLO_SECONDS, lo_open=True)
    if ttft is None and itl is None:
        raise SpecError("autoscaling.slo", dict(s.raw),
                        "ttftSeconds or itlSeconds (or both) is required: an SLO without a"
                        " target would be ignored")
    percentile = s.number("percentile", 0.0, 1.0, lo_open=True, hi_open=True)
    try:
        return SloSpec(ttft_seconds=ttft, itl_seconds=itl, percentile=percentile)
    except ValueError as exc:  # NaN passes the range checks above; SloSpec refuses it
        raise SpecError("autoscaling.slo", dict(s.raw), str(exc)) from None
