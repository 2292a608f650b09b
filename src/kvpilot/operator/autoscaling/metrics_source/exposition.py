"""Read an engine's ``/metrics`` page (Prometheus text format) into the values the
autoscaler needs. Pure: text in, :class:`EngineSample` out; parsing is prometheus_client's.

A series absent from the page is ``None``, so a renamed or misspelled metric is missing
data, never zero (case C17). If an engine exported one series per model (it exports one),
gauges take the highest value and counters are summed per name.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.autoscaler import LatencyWindow
from kvpilot.operator.autoscaling.metrics_source.names import EngineMetricNames, RouterMetricNames
from kvpilot.operator.autoscaling.metrics_source.reading import fleet_kv_window, parse_kv_window


class ExpositionError(ValueError):
    """The page is not in the Prometheus text format."""


@dataclass(frozen=True)
class HistogramSample:
    """One scrape of a histogram's lifetime counters.

    Attributes:
        buckets: ``(upper_bound, cumulative_count)``, bounds increasing, the last
            ``math.inf``.
        sum: the ``_sum`` counter.
    """

    buckets: tuple[tuple[float, float], ...]
    sum: float

    @property
    def count(self) -> float:
        return self.buckets[-1][1]


def histogram_increase(before: HistogramSample | None, after: HistogramSample | None
                       ) -> LatencyWindow | None:
    """What a histogram gained between two scrapes, as a
    :class:`~kvpilot.autoscaler.LatencyWindow`; None when either scrape lacks it (the
    first scrape of a pod has no window yet).

    A reset (the pod restarted: the count, the sum or any bucket went down, or the bucket
    bounds changed with a new engine) makes the window the new values themselves, the
    increase since the reset, as PromQL's ``increase()`` assumes.
    """
    if before is None or after is None:
        return None
    same_bounds = [b for b, _ in before.buckets] == [b for b, _ in after.buckets]
    reset = (not same_bounds or after.sum < before.sum
             or any(a < b for (_, a), (_, b) in zip(after.buckets, before.buckets)))
    if reset:
        buckets, total = after.buckets, after.sum
    else:
        buckets = tuple((bound, a - b) for (bound, a), (_, b) in zip(after.buckets, before.buckets))
        total = after.sum - before.sum
    # Differences of cumulative counters are cumulative unless the scrape was torn
    # between series; keep them monotonic as PromQL's histogram_quantile does.
    fixed, top = [], 0.0
    for bound, count in buckets:
        top = max(top, count)
        fixed.append((bound, top))
    try:
        return LatencyWindow(tuple(fixed), total)
    except ValueError:
        return None


def mean_increase(before: tuple[float, float] | None, after: tuple[float, float] | None
                  ) -> float | None:
    """``increase(_sum) / increase(_count)`` of a histogram between two scrapes (its mean
    observation over the window), resets as in :func:`histogram_increase`; None when a
    scrape lacks it or nothing was observed in between."""
    if before is None or after is None:
        return None
    (sum_b, count_b), (sum_a, count_a) = before, after
    if count_a < count_b or sum_a < sum_b:
        total, count = sum_a, count_a
    else:
        total, count = sum_a - sum_b, count_a - count_b
    return total / count if count > 0 else None


@dataclass(frozen=True)
class EngineSample:
    """One scrape of one engine; None = the series was not on the page.

    Attributes:
        kv_usage: 0..1 (not validated here).
        num_waiting, waiting_tokens, num_running: gauges.
        preemptions, generation_tokens, prompt_tokens, requests_finished: counter values.
        kv_capacity_tokens: the capacity gauge, else ``num_gpu_blocks`` x ``block_size``
            from the cache-config info series.
        kv_window_tokens: the ``sliding_window`` label of the cache-config info series
            (the window behind which the engine frees KV blocks); None when the series
            or the label is absent (an older engine), ``"None"`` or not a positive integer.
        itl / ttft: the latency histograms' lifetime counters (None: absent, an engine
            older than them, or malformed).
        iteration_tokens: ``(_sum, _count)`` of the tokens-per-step histogram, or None.
        prefix_queries / prefix_hits: the prefix cache's counter values (tokens), or None.
    """

    kv_usage: float | None
    num_waiting: float | None
    waiting_tokens: float | None
    num_running: float | None
    preemptions: float | None
    kv_capacity_tokens: float | None
    generation_tokens: float | None
    prompt_tokens: float | None
    requests_finished: float | None
    kv_window_tokens: int | None = None
    itl: HistogramSample | None = None
    ttft: HistogramSample | None = None
    iteration_tokens: tuple[float, float] | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None


# Samples by name: (labels, value) for each series of that name.
SamplesByName = dict[str, list[tuple[dict[str, str], float]]]


def _samples(text: str) -> SamplesByName:
    by_name: SamplesByName = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                by_name[sample.name].append((dict(sample.labels), float(sample.value)))
    except ValueError as exc:  # the parser raises ValueError on malformed lines
        raise ExpositionError(f"not Prometheus text format: {exc}") from exc
    return by_name


def _gauge(by_name: SamplesByName, name: str) -> float | None:
    """The largest finite sample (NaN and +-Inf are not measurements: missing)."""
    values = [v for _, v in by_name.get(name, ()) if math.isfinite(v)]
    return max(values) if values else None


def _counter(by_name: SamplesByName, name: str) -> float | None:
    """The sum of the series; a non-finite or negative sample is no counter value, and
    makes the whole counter missing (a partial sum would fake a reset)."""
    values = [v for _, v in by_name.get(name, ())]
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return sum(values)


def _histogram(by_name: SamplesByName, name: str) -> HistogramSample | None:
    """``name``'s buckets (summed per ``le`` over its series) and ``_sum``; None when the
    page has no ``_bucket`` sample, no ``+Inf`` bucket or a sample that is no counter
    value (a partial histogram would fake a reset)."""
    per_le: dict[float, float] = {}
    for labels, value in by_name.get(f"{name}_bucket", ()):
        try:
            bound = float(labels["le"])
        except (KeyError, ValueError):
            return None
        if math.isnan(bound) or not math.isfinite(value) or value < 0:
            return None
        per_le[bound] = per_le.get(bound, 0.0) + value
    total = _counter(by_name, f"{name}_sum")
    if not per_le or math.inf not in per_le or total is None:
        return None
    buckets, top = [], 0.0
    for bound in sorted(per_le):
        top = max(top, per_le[bound])
        buckets.append((bound, top))
    return HistogramSample(tuple(buckets), total)


def _sum_count(by_name: SamplesByName, name: str) -> tuple[float, float] | None:
    total, count = _counter(by_name, f"{name}_sum"), _counter(by_name, f"{name}_count")
    return None if total is None or count is None else (total, count)


def _capacity_from_info(by_name: SamplesByName, name: str) -> float | None:
    for labels, _ in by_name.get(name, ()):
        try:
            blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            continue
        if blocks > 0 and size > 0:
            return float(blocks * size)
    return None


def _window_from_info(by_name: SamplesByName, name: str) -> int | None:
    """The ``sliding_window`` label of the info series (one per engine; with several,
    the largest when all have one)."""
    return fleet_kv_window([parse_kv_window(labels.get("sliding_window"))
                            for labels, _ in by_name.get(name, ())])


def parse_engine_metrics(text: str, names: EngineMetricNames) -> EngineSample:
    """The values of ``names`` on one ``/metrics`` page.

    Raises:
        ExpositionError: the text is not Prometheus text format.
    """
    by_name = _samples(text)
    capacity = _gauge(by_name, names.kv_capacity)
    if capacity is None or capacity <= 0:
        capacity = _capacity_from_info(by_name, names.cache_config)
    return EngineSample(
        kv_usage=_gauge(by_name, names.kv_usage),
        num_waiting=_gauge(by_name, names.num_waiting),
        waiting_tokens=_gauge(by_name, names.waiting_tokens),
        num_running=_gauge(by_name, names.num_running),
        preemptions=_counter(by_name, names.preemptions),
        kv_capacity_tokens=capacity,
        generation_tokens=_counter(by_name, names.generation_tokens),
        prompt_tokens=_counter(by_name, names.prompt_tokens),
        requests_finished=_counter(by_name, names.requests_finished),
        kv_window_tokens=_window_from_info(by_name, names.cache_config),
        itl=_histogram(by_name, names.itl),
        ttft=_histogram(by_name, names.ttft),
        iteration_tokens=_sum_count(by_name, names.iteration_tokens),
        prefix_queries=_counter(by_name, names.prefix_queries),
        prefix_hits=_counter(by_name, names.prefix_hits),
    )


def parse_router_in_flight(text: str, names: RouterMetricNames) -> dict[str, float]:
    """``{worker URL: requests in flight}`` on a router's ``/metrics`` page; empty when the
    series is absent (a routing policy that tracks no load). A sample that is not a finite,
    non-negative number, or has no worker label, is left out; duplicates of one worker
    keep the largest.

    Raises:
        ExpositionError: the text is not Prometheus text format.
    """
    out: dict[str, float] = {}
    for labels, value in _samples(text).get(names.in_flight, ()):
        worker = labels.get(names.worker_label)
        if not worker or not math.isfinite(value) or value < 0:
            continue
        out[worker] = max(value, out.get(worker, 0.0))
    return out


def parse_router_no_engine(text: str, names: RouterMetricNames) -> float:
    """The router's count of attempts that found no engine (``errors`` samples whose
    ``error_type_label`` is ``no_engine_error``, summed over routes); 0.0 when the series
    is absent (vllm-router creates it on the first such failure).

    Raises:
        ExpositionError: the text is not Prometheus text format, or a matching sample is
            not a finite, non-negative number (no counter value: better no answer than a
            fake reset).
    """
    total = 0.0
    for labels, value in _samples(text).get(names.errors, ()):
        if labels.get(names.error_type_label) != names.no_engine_error:
            continue
        if not math.isfinite(value) or value < 0:
            raise ExpositionError(f"{names.errors}{{{names.error_type_label}="
                                  f"{names.no_engine_error!r}}} is {value!r}, not a counter value")
        total += value
    return total
