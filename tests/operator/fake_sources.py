"""A scripted metric source for autoscaler tests: each read answers from ``load`` (a
function of the pod names and the time) and is recorded."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpilot.autoscaler import PodSignals
from kvpilot.operator.autoscaling.metrics_source import EnginePod, MetricsReading, SourceConfig

CAPACITY = 16384.0


def pod(name: str, usage: float | None = 0.5, waiting: float | None = 0.0,
        waiting_tokens: float | None = 0.0, running: float | None = 4.0,
        preemptions: float | None = 0.0, capacity: float | None = CAPACITY) -> PodSignals:
    return PodSignals(name, usage, waiting, waiting_tokens, running, preemptions, capacity)


def loaded(usage: float, waiting: float = 0.0, **kw) -> Callable[..., MetricsReading]:
    """Every ready pod at ``usage`` with ``waiting`` queued requests."""
    def read(pods: Sequence[EnginePod], now: float) -> MetricsReading:
        return MetricsReading("fake", tuple(pod(p.name, usage, waiting, waiting * 500, **kw)
                                            for p in pods),
                              generated_tokens_per_second=100.0 * len(pods) if pods else None,
                              mean_context_tokens=1000.0)
    return read


def unreachable(pods: Sequence[EnginePod], now: float) -> MetricsReading:
    return MetricsReading("fake", tuple(PodSignals(p.name) for p in pods), reachable=False,
                          problem="Prometheus at http://prom:9090: ConnectionError: refused")


def empty(pods: Sequence[EnginePod], now: float) -> MetricsReading:
    """Answered, but no series matched (a misspelled name or label: C17)."""
    return MetricsReading("fake", tuple(PodSignals(p.name) for p in pods),
                          problem="Prometheus at http://prom:9090 returned no series for"
                                  " kv_usage: max by (pod) (kvpilot:gpu_cache_usage{...})")


class FakeSource:
    name = "fake"

    def __init__(self, load: Callable[..., MetricsReading] = unreachable) -> None:
        self.load = load
        self.reads: list[tuple[tuple[str, ...], float]] = []
        self.routers: list[tuple[str, ...]] = []  # the router pods handed to each read
        self.closed = False

    def read(self, pods: Sequence[EnginePod], now: float,
             routers: Sequence[EnginePod] = ()) -> MetricsReading:
        self.reads.append((tuple(p.name for p in pods), now))
        self.routers.append(tuple(p.name for p in routers))
        return self.load(pods, now)

    def close(self) -> None:
        self.closed = True


class SourceFactory:
    """``OperatorContext.source_factory``: hands out ``source`` and records each config."""

    def __init__(self, source: FakeSource) -> None:
        self.source = source
        self.configs: list[SourceConfig] = []

    def __call__(self, config: SourceConfig) -> FakeSource:
        self.configs.append(config)
        return self.source
