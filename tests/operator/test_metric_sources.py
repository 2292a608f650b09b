"""Pod scraping over httpx's mock transport, Prometheus answers from a scripted HTTP
server, once-per-episode logging and the fleet observation (ready vs pending pods). The
same sources against a real engine and a real Prometheus: test_metric_sources_real.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from kvpilot.operator.fleet import fleet_from
from kvpilot.operator.metrics_source import (
    EnginePod,
    PodScrapeSource,
    PrometheusSource,
    SeriesSelector,
)
from kvpilot.operator.metrics_source.episodes import EpisodeLog
from tests.serverproc import free_port

from .engine_pages import page


# ---------------------------------------------------------------- pod scraping
class Pages:
    """httpx mock transport: ``pages[host]`` is the text (or an exception) to answer."""

    def __init__(self):
        self.pages = {}
        self.requests = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(str(request.url))
        answer = self.pages.get(request.url.host)
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            return httpx.Response(404, text="not found")
        return httpx.Response(200, text=answer)


@pytest.fixture
def scraped():
    pages = Pages()
    client = httpx.Client(transport=httpx.MockTransport(pages))
    yield pages, PodScrapeSource("llm/chat", client=client)
    client.close()


PODS = [EnginePod("chat-a", "10.0.0.1"), EnginePod("chat-b", "10.0.0.2")]


def test_pods_source_turns_counters_into_rates_from_its_memory(scraped):
    pages, source = scraped
    pages.pages = {"10.0.0.1": page(preemptions=10, generated=1000),
                   "10.0.0.2": page(preemptions=0, generated=500)}
    first = source.read(PODS, now=100.0)
    assert [p.preemption_rate for p in first.pods] == [None, None]  # lost memory: missing
    assert first.generated_tokens_per_second is None
    assert first.pods[0].missing == ("preemption_rate",)
    pages.pages = {"10.0.0.1": page(preemptions=13, generated=1600),
                   "10.0.0.2": page(preemptions=0, generated=800)}
    second = source.read(PODS, now=115.0)
    assert [p.preemption_rate for p in second.pods] == [pytest.approx(0.2), 0.0]
    assert second.generated_tokens_per_second == pytest.approx((600 + 300) / 15)
    assert second.mean_context_tokens == pytest.approx((3000 + 1600 + 3000 + 800) / 8)
    assert second.kv_capacity_tokens == 20000.0
    assert second.reachable and second.problem is None
    # The pod restarted: its counter went down; the new value is the increase.
    pages.pages["10.0.0.1"] = page(preemptions=2, generated=100)
    third = source.read(PODS, now=125.0)
    assert third.pods[0].preemption_rate == pytest.approx(0.2)
    assert sorted(set(pages.requests)) == ["http://10.0.0.1:8000/metrics",
                                           "http://10.0.0.2:8000/metrics"]


def test_pods_source_failures_are_missing_and_logged_once_per_episode(scraped, caplog):
    pages, source = scraped
    caplog.set_level(logging.DEBUG, logger="kvpilot.operator.metrics_source.pods")
    pages.pages = {"10.0.0.1": httpx.ConnectError("refused"), "10.0.0.2": page()}
    for t in range(4):
        reading = source.read(PODS, now=100.0 + 15 * t)
        assert reading.reachable and reading.pods[0].kv_usage is None
        assert reading.pods[1].kv_usage == 0.25
        assert "chat-a (ConnectError: refused)" in reading.problem
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 of 2 ready pods" in warnings[0].getMessage()
    pages.pages["10.0.0.2"] = "garbage{ page"
    pages.pages["10.0.0.1"] = httpx.ReadTimeout("slow")
    everything_failed = source.read(PODS, now=200.0)
    assert not everything_failed.reachable
    assert all(p.kv_usage is None for p in everything_failed.pods)
    pages.pages = {"10.0.0.1": page(), "10.0.0.2": page()}
    assert source.read(PODS, now=215.0).problem is None
    assert any("recovered after" in r.getMessage() for r in caplog.records
               if r.levelno == logging.INFO)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_pods_source_with_no_pods_or_no_ip(scraped):
    pages, source = scraped
    empty = source.read([], now=1.0)
    assert empty.pods == () and empty.reachable
    no_ip = source.read([EnginePod("chat-c")], now=2.0)
    assert not no_ip.reachable and "the pod has no IP yet" in no_ip.problem
    assert pages.requests == []


# ---------------------------------------------------------------- Prometheus answers
class ScriptedPrometheus(BaseHTTPRequestHandler):
    """/api/v1/query: answers ``server.answers`` by the query's first matching key."""

    def do_GET(self):
        query = parse_qs(urlsplit(self.path).query)["query"][0]
        self.server.queries.append(query)
        status, payload = 200, {"status": "success", "data": {"resultType": "vector",
                                                              "result": []}}
        for key, answer in self.server.answers.items():
            if key in query:
                status, payload = answer if isinstance(answer, tuple) else (200, {
                    "status": "success", "data": {"resultType": "vector", "result": answer}})
                break
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def prom():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedPrometheus)
    server.answers, server.queries = {}, []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def sample(pod, value, **labels):
    return {"metric": {"pod": pod, **labels}, "value": [1.0, str(value)]}


def test_prometheus_matches_answers_to_pods_and_reports_what_is_empty(prom):
    server, url = prom
    server.answers = {
        "gpu_cache_usage_factor": [sample("chat-a", 0.5), sample("chat-b", "NaN"),
                                   sample("old-pod", 0.9)],
        "num_requests_waiting": [sample("chat-a", 2), sample("chat-b", 0)],
        "cache_config_info": [sample("chat-a", 1, num_gpu_blocks="10", block_size="16"),
                              sample("chat-b", 1, num_gpu_blocks="20", block_size="16")],
        "kv_cache_capacity_tokens": [sample("chat-b", 999)],
    }
    source = PrometheusSource(url, SeriesSelector("llm", "chat"))
    reading = source.read([EnginePod("chat-a"), EnginePod("chat-b")], now=1.0)
    a, b = reading.pods
    assert (a.kv_usage, a.num_waiting, a.kv_capacity_tokens) == (0.5, 2.0, 160.0)
    assert (b.kv_usage, b.num_waiting, b.kv_capacity_tokens) == (None, 0.0, 999.0)
    assert a.num_running is None and a.preemption_rate is None  # empty vectors: missing
    assert reading.reachable
    assert "returned no series for waiting_tokens" in reading.problem
    assert server.queries == list(source.queries.values())
    source.close()


def test_prometheus_bad_query_answer_is_missing_for_that_signal(prom):
    server, url = prom
    server.answers = {"num_preemptions_total": (400, {"status": "error", "error": "parse"}),
                      "gpu_cache_usage_factor": [sample("chat-a", 0.3)]}
    reading = PrometheusSource(url, SeriesSelector("llm", "chat")).read(
        [EnginePod("chat-a")], now=1.0)
    assert reading.pods[0].kv_usage == 0.3 and reading.pods[0].preemption_rate is None
    assert "preemption_rate: HTTP Status Code 400" in reading.problem and reading.reachable


def test_c15_unreachable_prometheus_is_missing_data_at_once(caplog):
    url = f"http://127.0.0.1:{free_port()}"
    source = PrometheusSource(url, SeriesSelector("llm", "chat"), timeout_seconds=2)
    started = time.monotonic()
    for t in range(3):
        reading = source.read([EnginePod("chat-a")], now=float(t))
    assert time.monotonic() - started < 3  # no retries with back-off
    assert not reading.reachable
    assert dataclasses.astuple(reading.pods[0])[1:] == (None,) * 6
    assert "ConnectionError" in reading.problem and url in reading.problem
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


# ---------------------------------------------------------------- episodes and the fleet
def test_episode_log_warns_once_and_says_when_it_recovered(caplog):
    caplog.set_level(logging.DEBUG)
    log = EpisodeLog(logging.getLogger("test.episodes"))
    assert log.failing("k", "down", 0.0) is True
    assert log.failing("k", "down", 15.0) is False
    assert log.is_failing("k")
    assert log.ok("k", 30.0) is True and log.ok("k", 45.0) is False
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels[0] == ("WARNING", "k: down (logged once until it recovers)")
    assert levels[-1] == ("INFO", "k: recovered after 30 s")


def pod_obj(name, ready=True, deleting=False, ip="10.0.0.9"):
    meta = {"name": name, **({"deletionTimestamp": "x"} if deleting else {})}
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_fleet_counts_ready_pods_and_pending_supply():
    deployment = {"spec": {"replicas": 4}}
    pods = [pod_obj("c-2"), pod_obj("c-1"), pod_obj("c-3", ready=False),
            pod_obj("c-4", deleting=True)]
    fleet = fleet_from(deployment, pods)
    assert [p.name for p in fleet.ready] == ["c-1", "c-2"]
    assert (fleet.deployment_replicas, fleet.pending_replicas) == (4, 2)
    surge = fleet_from({"spec": {"replicas": 1}}, [pod_obj("a"), pod_obj("b")])
    assert surge.pending_replicas == 0
    assert fleet_from(None, pods).deployment_replicas is None
