"""The ``pods`` metric source: scrape each ready engine pod's ``/metrics`` directly.

For clusters without Prometheus (``autoscaling.metrics.source: pods``). Each read GETs
``http://POD_IP:8000/metrics`` of every ready pod in parallel (bounded timeouts), parses it
with prometheus_client's text parser (:mod:`.exposition`) and turns counters into rates
from the previous scrape of the same pod, kept in memory:

* ``preemption_rate`` = :func:`kvpilot.autoscaler.counter_rate` of
  ``kvpilot:num_preemptions_total`` between the last two reads (resets handled);
* generated tokens/s, the same on ``kvpilot:generation_tokens_total``;
* ``itl`` / ``ttft``: what the ``kvpilot:inter_token_latency_seconds`` and
  ``kvpilot:time_to_first_token_seconds`` histograms gained between the two scrapes
  (:func:`.exposition.histogram_increase`; a reset makes it the value since the reset);
* ``step_tokens``: the increase of ``kvpilot:iteration_tokens_total``'s ``_sum`` over
  that of its ``_count`` (None when no step ran in between).

An engine without these histograms (older than them) reports them as None, never 0:
an SLO then sizes the fleet on saturation.

The first read of a pod (a new pod, or every pod after an operator restart) has no
previous sample, so its rates are missing for one interval: the policy then holds (it
never scales down on missing data), which is the safe way to lose the memory.

The fleet's router pods (``routers``) are scraped in the same round, on their metrics
port: ``vllm_router_running_requests`` per engine, summed over the routers, minus what the
engines count is the demand held at the router (:func:`.reading.router_queued`). A router
that cannot be scraped adds nothing; when none can, ``router_queued`` is None (counted as
0) and the failure is logged once per episode, apart from the engines' own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from kvpilot.autoscaler import PodSignals, counter_rate
from kvpilot.operator.autoscaling.metrics_source.episodes import EpisodeLog
from kvpilot.operator.autoscaling.metrics_source.exposition import (
    EngineSample,
    ExpositionError,
    HistogramSample,
    histogram_increase,
    mean_increase,
    parse_engine_metrics,
    parse_router_in_flight,
)
from kvpilot.operator.autoscaling.metrics_source.names import EngineMetricNames, RouterMetricNames
from kvpilot.operator.autoscaling.metrics_source.reading import (
    EnginePod,
    MetricsReading,
    fleet_kv_window,
    fleet_requests_finished,
    mean_context,
    pod_signals,
    router_queued,
)
from kvpilot.operator.logs import ObjectLog

SCRAPE_TIMEOUT_SECONDS = 3.0
CONNECT_TIMEOUT_SECONDS = 1.0
MAX_PARALLEL_SCRAPES = 16
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Previous:
    time: float
    preemptions: float | None
    generation_tokens: float | None
    itl: HistogramSample | None = None
    ttft: HistogramSample | None = None
    iteration_tokens: tuple[float, float] | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None


class PodScrapeSource:
    """Scrapes engine pods. Not shared between resources: its counter memory is per fleet.

    Args:
        label: names this fleet in logs (``namespace/name``).
        names: the engine series to read.
        timeout_seconds: the whole request's limit per pod (connect limited to 1 s).
        client: an httpx client to use (tests); by default one is made and owned.
        router_names: the router series to read.
    """

    name = "pods"

    def __init__(self, label: str, names: EngineMetricNames | None = None,
                 timeout_seconds: float = SCRAPE_TIMEOUT_SECONDS,
                 client: httpx.Client | None = None,
                 router_names: RouterMetricNames | None = None,
                 log: ObjectLog | None = None) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0; got {timeout_seconds}")
        self.label = label
        self.names = names or EngineMetricNames()
        self.router_names = router_names or RouterMetricNames()
        timeout = httpx.Timeout(timeout_seconds, connect=min(CONNECT_TIMEOUT_SECONDS,
                                                             timeout_seconds))
        self._owns_client = client is None
        self._client = client or httpx.Client(timeout=timeout, follow_redirects=False)
        self._previous: dict[tuple[str, str | None], _Previous] = {}
        self._episodes = EpisodeLog(log or _log)  # log: the resource's, naming it

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def _page(self, pod: EnginePod) -> str:
        url = pod.metrics_url
        if url is None:
            raise ValueError("the pod has no IP yet")
        response = self._client.get(url)
        response.raise_for_status()
        return response.text

    def _scrape(self, pod: EnginePod) -> EngineSample:
        return parse_engine_metrics(self._page(pod), self.names)

    def _scrape_router(self, pod: EnginePod) -> dict[str, float]:
        return parse_router_in_flight(self._page(pod), self.router_names)

    def _scrape_all(self, pods: Sequence[EnginePod], routers: Sequence[EnginePod] = ()
                    ) -> tuple[list[EngineSample | Exception], list[dict[str, float] | Exception]]:
        def one(pod: EnginePod) -> EngineSample | Exception:
            try:
                return self._scrape(pod)
            except (httpx.HTTPError, ExpositionError, ValueError) as exc:
                return exc

        def router(pod: EnginePod) -> dict[str, float] | Exception:
            try:
                return self._scrape_router(pod)
            except (httpx.HTTPError, ExpositionError, ValueError) as exc:
                return exc

        if len(pods) + len(routers) <= 1:
            return [one(p) for p in pods], [router(p) for p in routers]
        workers = min(MAX_PARALLEL_SCRAPES, len(pods) + len(routers))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            engines = pool.map(one, pods)
            held = pool.map(router, routers)
            return list(engines), list(held)

    def _router_queued(self, pods: Sequence[EnginePod], signals: Sequence[PodSignals],
                       routers: Sequence[EnginePod],
                       results: Sequence[dict[str, float] | Exception], now: float
                       ) -> float | None:
        """Sum the routers' in-flight counts per engine and subtract what the engines
        count; None without routers or when every router scrape failed (logged)."""
        if not routers:
            return None
        in_flight: dict[str, float] = {}
        failures = []
        for pod, result in zip(routers, results):
            if isinstance(result, Exception):
                failures.append(f"{pod.name} ({type(result).__name__}: {result})")
                continue
            for worker, value in result.items():
                in_flight[worker] = in_flight.get(worker, 0.0) + value
        episode = f"{self.label} routers"
        if failures:
            self._episodes.failing(
                episode, f"scraping /metrics failed for {len(failures)} of {len(routers)}"
                f" router pods (their held requests count as 0): {'; '.join(failures[:3])}",
                now)
        else:
            self._episodes.ok(episode, now)
        if len(failures) == len(routers):
            return None
        return router_queued(in_flight, pods, signals)

    def read(self, pods: Sequence[EnginePod], now: float,
             routers: Sequence[EnginePod] = ()) -> MetricsReading:
        results, router_results = self._scrape_all(pods, routers)
        signals: list[PodSignals] = []
        rates: list[float | None] = []
        failures: list[str] = []
        prompt = generated = finished = 0.0
        finished_each: list[float | None] = []
        windows: list[int | None] = []  # of the pods that reported a KV capacity
        previous, self._previous = self._previous, {}
        for pod, result in zip(pods, results):
            if isinstance(result, Exception):
                failures.append(f"{pod.name} ({type(result).__name__}: {result})")
                signals.append(pod_signals(pod.name, None, None, None, None, None, None))
                rates.append(None)
                finished_each.append(None)
                continue
            finished_each.append(result.requests_finished)
            key = (pod.name, pod.ip)
            before = previous.get(key)
            self._previous[key] = _Previous(now, result.preemptions, result.generation_tokens,
                                            result.itl, result.ttft, result.iteration_tokens,
                                            result.prefix_queries, result.prefix_hits)
            preemption_rate = gen_rate = step_tokens = queried = cached = None
            itl = ttft = None
            if before is not None and now > before.time:
                preemption_rate = counter_rate(before.preemptions, before.time,
                                               result.preemptions, now)
                gen_rate = counter_rate(before.generation_tokens, before.time,
                                        result.generation_tokens, now)
                itl = histogram_increase(before.itl, result.itl)
                ttft = histogram_increase(before.ttft, result.ttft)
                step_tokens = mean_increase(before.iteration_tokens, result.iteration_tokens)
                queried = counter_rate(before.prefix_queries, before.time,
                                       result.prefix_queries, now)
                cached = counter_rate(before.prefix_hits, before.time, result.prefix_hits, now)
            signals.append(pod_signals(pod.name, result.kv_usage, result.num_waiting,
                                       result.waiting_tokens, result.num_running,
                                       preemption_rate, result.kv_capacity_tokens,
                                       itl, ttft, step_tokens, queried, cached))
            if signals[-1].kv_capacity_tokens is not None:
                windows.append(result.kv_window_tokens)
            rates.append(gen_rate)
            if None not in (result.prompt_tokens, result.generation_tokens,
                            result.requests_finished):
                prompt += result.prompt_tokens or 0.0
                generated += result.generation_tokens or 0.0
                finished += result.requests_finished or 0.0
        episode = f"{self.label} pods"
        problem = None
        if failures:
            problem = (f"scraping /metrics failed for {len(failures)} of {len(pods)} ready"
                       f" pods: {'; '.join(failures[:3])}")
            self._episodes.failing(episode, problem, now)
        else:
            self._episodes.ok(episode, now)
        return MetricsReading(
            source=self.name,
            pods=tuple(signals),
            generated_tokens_per_second=(sum(r for r in rates if r is not None)
                                         if rates and None not in rates else None),
            mean_context_tokens=mean_context(prompt, generated, finished),
            reachable=not pods or len(failures) < len(pods),
            problem=problem,
            router_queued=self._router_queued(pods, signals, routers, router_results, now),
            requests_finished=fleet_requests_finished(finished_each),
            kv_window_tokens=fleet_kv_window(windows),
        )
