"""The ``prometheus`` metric source: PromQL instant queries through prometheus-api-client.

One read sends the queries of :func:`.promql.signal_queries` one after the other within a
total time budget (``timeout_seconds``, default 5 s) and no retries: the next interval is
the retry. The answers are matched to the ready pods by the ``pod`` label; a pod with no
sample in a query's answer has that signal missing (``None``), never zero (case C17). A
transport error (connection refused, timeout) ends the read: every value left is missing
and, if nothing was answered at all, the reading is unreachable (case C15).

The SLO's signals (per-pod ITL and TTFT histograms over the rate window, tokens per
step) come from the same loop: bucket answers are grouped per pod and ``le`` into a
:class:`~kvpilot.autoscaler.LatencyWindow` with the ``_sum`` answer (None when a pod has
no ``+Inf`` bucket or no sum); an empty answer is an engine without them, left out of
``problem``.

Last, within the same budget, :func:`.promql.router_query` reads the router pods'
in-flight requests per engine; :func:`.reading.router_queued` turns them into the demand
held at the router. Its failure or an empty answer leaves ``router_queued`` None (counted
as 0) and does not make the engine signals missing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from kvpilot.autoscaler import LatencyWindow
from kvpilot.operator.autoscaling.metrics_source.episodes import EpisodeLog
from kvpilot.operator.autoscaling.metrics_source.names import EngineMetricNames, RouterMetricNames
from kvpilot.operator.autoscaling.metrics_source.promql import (
    BUCKET_SIGNALS,
    DEFAULT_RATE_WINDOW,
    OPTIONAL_SIGNALS,
    SeriesSelector,
    router_query,
    signal_queries,
)
from kvpilot.operator.autoscaling.metrics_source.reading import (
    EnginePod,
    MetricsReading,
    fleet_kv_window,
    fleet_requests_finished,
    mean_context,
    parse_kv_window,
    pod_signals,
    router_queued,
)
from kvpilot.operator.logs import ObjectLog

QUERY_BUDGET_SECONDS = 5.0
_log = logging.getLogger(__name__)
PodValues = dict[str, dict[str, float]]  # signal -> pod -> value
PodBuckets = dict[str, dict[str, dict[float, float]]]  # signal -> pod -> le -> value


def _per_pod_le(result: list[Mapping[str, Any]], pod_label: str) -> dict[str, dict[float, float]]:
    """``{pod: {le: value}}`` from a bucket answer; samples without a pod or a numeric
    ``le``, or with a value that is not a number, are left out."""
    out: dict[str, dict[float, float]] = {}
    for item in result:
        labels = item.get("metric") or {}
        pod = labels.get(pod_label)
        if not isinstance(pod, str) or not pod:
            continue
        try:
            bound, value = float(labels["le"]), float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        out.setdefault(pod, {})[bound] = value
    return out


def latency_window(buckets: Mapping[float, float] | None, total: float | None
                   ) -> LatencyWindow | None:
    """A pod's histogram increase from its ``{le: increase}`` answer and its ``_sum``
    increase; None when either is missing, there is no ``+Inf`` bucket, or a value is not
    a finite number >= 0. ``increase()`` extrapolates each bucket on its own, so the
    counts are made monotonic (running maximum) as ``histogram_quantile`` does."""
    if not buckets or total is None or math.inf not in buckets:
        return None
    if not math.isfinite(total) or total < 0:
        return None
    fixed, top = [], 0.0
    for bound in sorted(buckets):
        value = buckets[bound]
        if math.isnan(bound) or not math.isfinite(value) or value < 0:
            return None
        top = max(top, value)
        fixed.append((bound, top))
    try:
        return LatencyWindow(tuple(fixed), total)
    except ValueError:
        return None


def _cache_configs(result: list[Mapping[str, Any]], pod_label: str
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """From cache-config info samples: ``num_gpu_blocks`` x ``block_size`` per pod, and
    the KV window (``sliding_window`` label) of the pods that have one."""
    capacities: dict[str, float] = {}
    windows: dict[str, float] = {}
    for item in result:
        labels = item.get("metric") or {}
        try:
            value = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
        except (KeyError, TypeError, ValueError):
            continue
        pod = labels.get(pod_label)
        if value > 0 and isinstance(pod, str) and pod:
            capacities[pod] = value
            window = parse_kv_window(labels.get("sliding_window"))
            if window is None:
                windows.pop(pod, None)
            else:
                windows[pod] = float(window)
    return capacities, windows


def _per_pod(result: list[Mapping[str, Any]], pod_label: str) -> dict[str, float]:
    """``{pod: value}`` from an instant-vector answer (values arrive as strings); with
    another label (``worker``), ``{worker: value}``."""
    out: dict[str, float] = {}
    for item in result:
        pod = (item.get("metric") or {}).get(pod_label)
        if not isinstance(pod, str) or not pod:  # no pod label: not one of ours
            continue
        try:
            out[pod] = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
    return out


class PrometheusSource:
    """PromQL against one Prometheus for one InferenceDeployment's series.

    Args:
        url: Prometheus base URL (``spec.autoscaling.metrics.url``).
        selector: which series belong to the fleet.
        names: the series names (a misspelled one yields missing data).
        rate_window: the ``rate()`` window.
        timeout_seconds: the budget for one whole read.
        router_names: the router series names.
    """

    name = "prometheus"

    def __init__(self, url: str, selector: SeriesSelector, names: EngineMetricNames | None = None,
                 rate_window: str = DEFAULT_RATE_WINDOW,
                 timeout_seconds: float = QUERY_BUDGET_SECONDS,
                 router_names: RouterMetricNames | None = None,
                 log: ObjectLog | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the Prometheus url must start with http:// or https://; got {url!r}")
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0; got {timeout_seconds}")
        self.url = url.rstrip("/")
        self.selector = selector
        self.names = names or EngineMetricNames()
        self.queries = signal_queries(self.names, selector, rate_window)
        self.router_names = router_names or RouterMetricNames()
        self.router_query = router_query(self.router_names, selector)
        self.timeout_seconds = timeout_seconds
        self._client = PrometheusConnect(url=self.url, retry=Retry(total=0),
                                         timeout=timeout_seconds)
        self._log = log or _log  # the resource's logger, naming it
        self._episodes = EpisodeLog(self._log)

    def close(self) -> None:
        self._client.close()

    def _run_queries(self) -> tuple[PodValues, list[str], list[str], bool, PodBuckets]:
        """(values, failed query notes, empty signals, any answer at all, histogram
        buckets); the routers' in-flight requests per worker, when answered, under
        ``values["router_in_flight"]``, and the pods' KV windows under
        ``values["kv_window"]``."""
        values: PodValues = {}
        buckets: PodBuckets = {}
        failed: list[str] = []
        empty: list[str] = []
        answered = down = False
        deadline = time.monotonic() + self.timeout_seconds
        pod = self.selector.pod_label
        for signal, query in self.queries.items():
            left = deadline - time.monotonic()
            if left <= 0:
                failed.append(f"{signal}: no time left of the {self.timeout_seconds:g} s budget")
                break
            try:
                result = self._client.custom_query(query, timeout=left)
            except requests.RequestException as exc:
                failed.append(f"{type(exc).__name__}: {exc}")
                down = True
                break
            except (PrometheusApiClientException, ValueError, KeyError) as exc:
                answered = True
                failed.append(f"{signal}: {exc}")
                continue
            answered = True
            if signal == "cache_config":
                values[signal], values["kv_window"] = _cache_configs(result, pod)
            elif signal in BUCKET_SIGNALS:
                buckets[signal] = _per_pod_le(result, pod)
            else:
                values[signal] = _per_pod(result, pod)
            if not result and signal != "cache_config" and signal not in OPTIONAL_SIGNALS:
                empty.append(signal)
        left = deadline - time.monotonic()
        if answered and not down and left > 0:
            try:
                result = self._client.custom_query(self.router_query, timeout=left)
            except (requests.RequestException, PrometheusApiClientException, ValueError,
                    KeyError) as exc:
                self._log.debug("router query %s failed: %s", self.router_query, exc)
            else:
                values["router_in_flight"] = _per_pod(result, self.router_names.worker_label)
        return values, failed, empty, answered, buckets

    def read(self, pods: Sequence[EnginePod], now: float,
             routers: Sequence[EnginePod] = ()) -> MetricsReading:
        values, failed, empty, answered, buckets = self._run_queries()

        def get(signal: str, name: str) -> float | None:
            return values.get(signal, {}).get(name)

        def latency(signal: str, name: str) -> LatencyWindow | None:
            return latency_window(buckets.get(f"{signal}_buckets", {}).get(name),
                                  get(f"{signal}_sum", name))

        signals, rates = [], []
        prompt = generated = finished = 0.0
        finished_each = [get("requests_finished", p.name) for p in pods]
        windows: list[int | None] = []  # of the pods that reported a KV capacity
        for p in pods:
            capacity = get("kv_capacity", p.name) or get("cache_config", p.name)
            signals.append(pod_signals(p.name, get("kv_usage", p.name),
                                       get("num_waiting", p.name), get("waiting_tokens", p.name),
                                       get("num_running", p.name), get("preemption_rate", p.name),
                                       capacity, latency("itl", p.name), latency("ttft", p.name),
                                       get("step_tokens", p.name),
                                       get("prompt_token_rate", p.name),
                                       get("cached_token_rate", p.name)))
            if signals[-1].kv_capacity_tokens is not None:
                window = get("kv_window", p.name)
                windows.append(int(window) if window is not None else None)
            rates.append(get("generation_rate", p.name))
            counters = (get("prompt_tokens", p.name), get("generation_tokens", p.name),
                        get("requests_finished", p.name))
            if None not in counters:
                prompt, generated, finished = (a + (b or 0.0) for a, b in
                                               zip((prompt, generated, finished), counters))
        problem = None
        if failed:
            problem = f"Prometheus at {self.url}: {'; '.join(failed[:2])}"
        elif pods and empty:
            shown = ", ".join(f"{s}: {self.queries[s]}" for s in empty[:2])
            problem = (f"Prometheus at {self.url} returned no series for {shown}"
                       f"{' (and more)' if len(empty) > 2 else ''}")
        key = f"{self.selector.namespace}/{self.selector.name} prometheus"
        if problem and (failed or all(s.kv_usage is None for s in signals)):
            self._episodes.failing(key, problem, now)
        else:
            self._episodes.ok(key, now)
        return MetricsReading(
            source=self.name,
            pods=tuple(signals),
            generated_tokens_per_second=(sum(r for r in rates if r is not None)
                                         if rates and None not in rates else None),
            mean_context_tokens=mean_context(prompt, generated, finished),
            reachable=answered,
            problem=problem,
            router_queued=router_queued(values.get("router_in_flight", {}), pods, signals),
            requests_finished=fleet_requests_finished(finished_each),
            kv_window_tokens=fleet_kv_window(windows),
        )
