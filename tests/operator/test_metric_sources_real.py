"""Both metric sources against a REAL engine (``kvpilot serve`` with the embedded SmolLM2)
and a REAL Prometheus (Debian's package) scraping it on 127.0.0.1 every second.

The engine runs one sequence at a time (``--max-num-seqs 1``), so with three long
generations in flight its queue holds still (1 running, 2 waiting with a known number of
prompt tokens) long enough to compare: the pods source against the engine's own
``/metrics``, then the Prometheus source against the pods source. Also: a misspelled
counter (no ``_total``) and a label that matches nothing are missing data, never zero
(C17); a stopped Prometheus is missing data and the autoscaler holds the count (C15).
Every server binds 127.0.0.1 on a free port, every wait is bounded, and both processes
are stopped by pid even when a test fails.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import datetime, timezone

import httpx
import pytest

from kvpilot.operator.autoscaling.metrics_source import (
    EngineMetricNames,
    EnginePod,
    PodScrapeSource,
    PrometheusSource,
    SeriesSelector,
    SourceConfig,
    build_source,
)
from kvpilot.operator.autoscaling.metrics_source.exposition import parse_engine_metrics
from tests.serverproc import ServerProcess

from .fleet_harness import Fleet
from .promserver import PrometheusProcess

pytestmark = pytest.mark.slow
LABELS = {"namespace": "llm", "inference_deployment": "chat", "pod": "chat-0"}
NAMES = EngineMetricNames()
LONG = 1500  # tokens per generation: long enough to hold the queue still while we compare


@pytest.fixture(scope="module")
def engine():
    server = ServerProcess("--max-num-seqs", "1", "--max-num-batched-tokens", "512")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prometheus(engine):
    prom = PrometheusProcess([(f"127.0.0.1:{engine.port}", LABELS)])
    try:
        prom.wait_ready()
        prom.wait_for("the first scrape of the engine", lambda: prom.query(
            'up{pod="chat-0"} == 1'), timeout=30)
        yield prom
    finally:
        prom.stop()


def engine_metrics(engine):
    return parse_engine_metrics(httpx.get(f"{engine.url}/metrics", timeout=5).text, NAMES)


def wait_until(what, check, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Traffic:
    """Streaming completions in threads; closing them aborts the requests (C09)."""

    def __init__(self, engine, count: int, max_tokens: int) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(engine.url, i, max_tokens),
                                         daemon=True) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self, url: str, i: int, max_tokens: int) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "prompt": f"Request {i}: " + "tell me a long story. " * 20}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:
            return

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def finish_short_requests(engine, count: int = 2) -> None:
    for i in range(count):
        r = httpx.post(f"{engine.url}/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": f"Say hi {i}", "max_tokens": 8})
        assert r.status_code == 200, r.text


def test_pods_and_prometheus_sources_read_the_same_signals_as_the_engine(engine, prometheus):
    finish_short_requests(engine)
    pod = EnginePod("chat-0", "127.0.0.1", engine.port)
    pods_source = PodScrapeSource("llm/chat")
    prom_source = PrometheusSource(prometheus.url, SeriesSelector("llm", "chat"))
    traffic = Traffic(engine, count=3, max_tokens=LONG)
    try:
        raw = wait_until("1 running and 2 waiting", lambda: (m := engine_metrics(engine))
                         and m.num_running == 1 and m.num_waiting == 2 and m)
        first = pods_source.read([pod], time.monotonic())
        assert first.pods[0].preemption_rate is None  # no previous sample yet: missing
        # Not a fixed sleep: on a loaded machine one step can outlast it, and the rate
        # would honestly be zero. Wait until tokens were generated since that sample.
        since = engine_metrics(engine).generation_tokens
        wait_until("a token generated after the first read", lambda: (
            engine_metrics(engine).generation_tokens > since))
        reading = pods_source.read([pod], time.monotonic())
        (signals,) = reading.pods
        # The pods source says what /metrics says.
        assert (signals.num_running, signals.num_waiting) == (1.0, 2.0)
        assert signals.waiting_tokens == raw.waiting_tokens > 0
        assert signals.kv_usage == pytest.approx(raw.kv_usage, abs=0.01)
        assert signals.kv_capacity_tokens == raw.kv_capacity_tokens > 0
        assert signals.preemption_rate == 0.0  # present and zero, not missing
        assert reading.generated_tokens_per_second > 0
        assert reading.reachable and reading.problem is None
        # Prometheus has scraped the same state: the same signals.
        prometheus.wait_for("Prometheus to see the queue", lambda: prometheus.query(
            'kvpilot:num_requests_waiting{pod="chat-0"} == 2') and prometheus.query(
            'rate(kvpilot:generation_tokens_total{pod="chat-0"}[1m]) > 0'))
        prom = prom_source.read([EnginePod("chat-0")], time.time())
        (from_prom,) = prom.pods
        assert prom.reachable and prom.problem is None
        assert (from_prom.num_running, from_prom.num_waiting) == (1.0, 2.0)
        assert from_prom.waiting_tokens == signals.waiting_tokens
        assert from_prom.kv_usage == pytest.approx(signals.kv_usage, abs=0.01)
        assert from_prom.kv_capacity_tokens == signals.kv_capacity_tokens
        assert from_prom.preemption_rate == 0.0
        assert prom.generated_tokens_per_second > 0
        # SmolLM2 has no sliding window: sliding_window="None" on the info series, read
        # through the PromQL grouping as through the page.
        assert prom.kv_window_tokens is None and reading.kv_window_tokens is None
        assert prometheus.query('kvpilot:cache_config_info{pod="chat-0",sliding_window="None"}')

        # C17: a counter without _total, and a label matching nothing -> missing, not 0.
        misspelled = dataclasses.replace(NAMES, preemptions="kvpilot:num_preemptions")
        bad_prom = PrometheusSource(prometheus.url, SeriesSelector("llm", "chat"), misspelled)
        (bad,) = bad_prom.read([EnginePod("chat-0")], time.time()).pods
        assert bad.preemption_rate is None and bad.missing == ("preemption_rate",)
        assert bad.num_waiting == 2.0
        bad_pods = PodScrapeSource("llm/chat", misspelled)
        bad_pods.read([pod], time.monotonic())
        (bad_scraped,) = bad_pods.read([pod], time.monotonic() + 1).pods
        assert bad_scraped.missing == ("preemption_rate",)
        nobody = PrometheusSource(prometheus.url, SeriesSelector("llm", "chta")).read(
            [EnginePod("chat-0")], time.time())
        assert nobody.reachable and all(v is None for v in dataclasses.astuple(
            nobody.pods[0])[1:])
        assert 'inference_deployment="chta"' in nobody.problem
        for source in (bad_prom, bad_pods):
            source.close()
    finally:
        traffic.close()

    # Idle again: the lifetime mean context is the same through both sources.
    idle = wait_until("the aborted requests to leave", lambda: (m := engine_metrics(engine))
                      and m.num_running == 0 and m.num_waiting == 0 and m)
    expected = (idle.prompt_tokens + idle.generation_tokens) / idle.requests_finished
    prometheus.wait_for("Prometheus to see the idle engine", lambda: prometheus.query(
        f'kvpilot:generation_tokens_total{{pod="chat-0"}} == {idle.generation_tokens:.0f}')
        and prometheus.query('kvpilot:num_requests_running{pod="chat-0"} == 0'))
    scraped = pods_source.read([pod], time.monotonic())
    queried = prom_source.read([EnginePod("chat-0")], time.time())
    assert scraped.mean_context_tokens == pytest.approx(expected)
    assert queried.mean_context_tokens == pytest.approx(expected)
    assert scraped.pods[0].kv_usage == queried.pods[0].kv_usage == 0.0
    pods_source.close()
    prom_source.close()


def test_both_sources_read_the_real_prefix_cache_counters(engine, prometheus):
    """The prefix-cache handover check's inputs from a real engine: the same long prompt
    sent again is mostly a cache hit, and both sources read looked-up and held prompt
    tokens per second (held <= looked up, both > 0), as the status's hit rate does."""
    from kvpilot.operator.autoscaling.plan import observed_signals

    pod = EnginePod("chat-0", "127.0.0.1", engine.port)
    pods_source = PodScrapeSource("llm/chat")
    prom_source = PrometheusSource(prometheus.url, SeriesSelector("llm", "chat"))
    try:
        before = engine_metrics(engine)
        assert before.prefix_queries is not None and before.prefix_hits is not None
        pods_source.read([pod], time.monotonic())
        prompt = "You are a careful assistant. " * 60
        for i in range(3):
            r = httpx.post(f"{engine.url}/v1/completions", timeout=60, json={
                "model": "SmolLM2-135M-Instruct", "prompt": prompt + f"Question {i}?",
                "max_tokens": 4})
            assert r.status_code == 200, r.text
        after = engine_metrics(engine)
        assert after.prefix_hits - before.prefix_hits > 0  # the second and third hit
        reading = pods_source.read([pod], time.monotonic())
        (signals,) = reading.pods
        assert signals.prompt_token_rate > 0 and 0 < signals.cached_token_rate <= signals.prompt_token_rate
        status = observed_signals(reading).to_status(datetime.now(timezone.utc))["signals"]
        assert 0 < status["prefixCacheHitRate"] < 1
        prometheus.wait_for("Prometheus to see the hits", lambda: prometheus.query(
            f'kvpilot:prefix_cache_hits_total{{pod="chat-0"}} >= {after.prefix_hits:.0f}'))
        (from_prom,) = prom_source.read([EnginePod("chat-0")], time.time()).pods
        assert from_prom.prompt_token_rate > 0
        assert 0 < from_prom.cached_token_rate <= from_prom.prompt_token_rate
    finally:
        pods_source.close()
        prom_source.close()


def test_c15_stopped_prometheus_is_missing_data_and_the_autoscaler_holds(engine):
    """The real loop on the real Prometheus source: it decides on real data, then
    Prometheus stops: MetricsAvailable=False (SourceUnreachable), the count is held."""
    prom = PrometheusProcess([(f"127.0.0.1:{engine.port}", LABELS)])
    try:
        prom.wait_ready()
        prom.wait_for("a scrape", timeout=30, check=lambda: prom.query(
            'kvpilot:gpu_cache_usage_factor{pod="chat-0"}'))
        spec = {"model": {"uri": "embedded://smollm2-135m-instruct"},
                "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "intervalSeconds": 15,
                                "metrics": {"source": "prometheus", "url": prom.url}}}
        configs = []

        def factory(config: SourceConfig):
            configs.append(config)
            return build_source(config)

        fleet = Fleet(spec=spec, replicas=2, factory=factory)
        fleet.pods(ready=1, pending=1)  # chat-0 is the engine Prometheus scrapes
        fleet.tick(0)
        assert configs == [SourceConfig("prometheus", prom.url, "llm", "chat")]
        assert fleet.condition("MetricsAvailable")["status"] == "True"
        assert fleet.status["signals"]["cacheUsage"] == 0.0  # idle: a real zero
        assert fleet.status["capacity"]["kvCapacityTokensPerReplica"] > 0
        prom.stop()
        started = time.monotonic()
        fleet.tick()
        assert time.monotonic() - started < 10  # bounded: no retries, a time budget
        assert fleet.replicas == 2
        metrics = fleet.condition("MetricsAvailable")
        assert (metrics["status"], metrics["reason"]) == ("False", "SourceUnreachable")
        assert prom.url in metrics["message"]
        assert "cacheUsage" not in fleet.status["signals"]
        fleet.loop.close()
    finally:
        prom.stop()
