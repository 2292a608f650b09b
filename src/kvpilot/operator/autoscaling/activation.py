"""Scale to zero's activation signal: are requests waiting at the router for an engine?

With ``autoscaling.minReplicas: 0`` the router holds a request that finds no engine by
retrying it (:func:`kvpilot.operator.builders.router.hold_attempts`), and vllm-router counts
every such attempt in ``vllm_router_request_errors_total{error_type="no_available_workers"}``.
:class:`ActivationProbe` scrapes that counter from each ready router pod, directly on its
metrics port (whatever ``autoscaling.metrics.source`` says: a 15 s Prometheus scrape would
add up to 15 s to every cold start), and answers how much it grew since the previous poll.
The autoscaler loop polls it every :data:`POLL_SECONDS` while the fleet is at zero, and
once per interval otherwise::

    poll(routers) = sum over router pods of (counter now - counter at the previous poll)

A router pod seen for the first time counts 0 (its baseline; a request it holds keeps
retrying, so the next poll sees it), a counter that went down was reset (router restart:
its value is the increase), and a router that cannot be scraped adds nothing (logged once
per episode). None when there is no ready router or none could be read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvpilot.operator.autoscaling.metrics_source import EnginePod, RouterMetricNames
from kvpilot.operator.autoscaling.metrics_source.episodes import EpisodeLog
from kvpilot.operator.autoscaling.metrics_source.exposition import (
    ExpositionError,
    parse_router_no_engine,
)
from kvpilot.operator.logs import ObjectLog

# How often the loop looks for held requests while the fleet is at zero. The router
# retries a held request at least every 500 ms, so each poll sees a waiting request.
POLL_SECONDS = 1.0
SCRAPE_TIMEOUT_SECONDS = 2.0
MAX_PARALLEL_SCRAPES = 8
_log = logging.getLogger(__name__)


class ActivationProbe:
    """Counts the router attempts that found no engine, between polls. Not thread-safe:
    one poll at a time (the autoscaler loop's).

    Args:
        label: names the fleet in logs (``namespace/name``).
        client: an httpx client to use (tests); by default one is made and owned.
        names: the router series to read.
        log: where scrape failures go (the resource's logger).
    """

    def __init__(self, label: str, client: httpx.Client | None = None,
                 names: RouterMetricNames | None = None, log: ObjectLog | None = None) -> None:
        self.label = label
        self.names = names or RouterMetricNames()
        self._owns_client = client is None
        self._client = client or httpx.Client(
            timeout=httpx.Timeout(SCRAPE_TIMEOUT_SECONDS, connect=1.0), follow_redirects=False)
        self._previous: dict[tuple[str, str | None], float] = {}
        self._episodes = EpisodeLog(log or _log)

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def _read(self, pod: EnginePod) -> float | Exception:
        url = pod.metrics_url
        if url is None:
            return ValueError("the pod has no IP yet")
        try:
            response = self._client.get(url)
            response.raise_for_status()
            return parse_router_no_engine(response.text, self.names)
        except (httpx.HTTPError, ExpositionError) as exc:
            return exc

    def poll(self, routers: Sequence[EnginePod], now: float) -> float | None:
        """Attempts that found no engine since the previous poll, over ``routers`` (the
        ready router pods); None when there are none or none could be read. ``now``
        (seconds) only dates the failure log. Mutates the per-pod baselines."""
        if not routers:
            self._previous = {}
            return None
        if len(routers) == 1:
            results = [self._read(routers[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SCRAPES, len(routers))) as pool:
                results = list(pool.map(self._read, routers))
        previous, self._previous = self._previous, {}
        increase, failures = 0.0, []
        for pod, result in zip(routers, results):
            key = (pod.name, pod.ip)
            if isinstance(result, Exception):
                failures.append(f"{pod.name} ({type(result).__name__}: {result})")
                if key in previous:
                    self._previous[key] = previous[key]
                continue
            self._previous[key] = result
            before = previous.get(key)
            if before is not None:
                increase += result - before if result >= before else result
        episode = f"{self.label} activation"
        if failures:
            self._episodes.failing(
                episode, f"reading held requests failed for {len(failures)} of {len(routers)}"
                f" router pods (scale from zero cannot see them): {'; '.join(failures[:3])}",
                now)
        else:
            self._episodes.ok(episode, now)
        return None if len(failures) == len(routers) else increase
