"""The demand held at the request router, read from a REAL vllm-router (0.1.17, the
``kv_aware`` policy we deploy) in front of a scripted engine, by both metric sources: the
pods source scraping the router's Prometheus port, and a REAL Prometheus scraping both.
The PromQL is also checked by ``promtool test rules`` on synthetic series (duplicate
scrapes, two routers).

The engine is a stand-in in a thread: it answers the router's health and model checks at
once and holds every completion until the test releases it. Its ``/metrics`` says what an
engine whose scheduler has admitted one request says: 1 running, 0 waiting; the others sit
in its input queue, counted by nobody but the router. Every server binds 127.0.0.1 on a
free port; the router and Prometheus are stopped by pid even when a test fails.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot.autoscaler import FleetSignals, PolicyState, decide
from kvpilot.operator.autoscaling.metrics_source import (
    EnginePod,
    PodScrapeSource,
    PrometheusSource,
    RouterMetricNames,
    SeriesSelector,
    router_query,
)
from kvpilot.operator.autoscaling.metrics_source.exposition import parse_router_in_flight
from kvpilot.operator.spec import parse_spec
from tests.serverproc import free_port

from .promserver import PrometheusProcess
from .tools import run, tool

ROUTER = Path(sys.executable).parent / "vllm-router"
HELD = 8  # requests sent at once; the engine admits one


class StandInEngine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, code, text, content_type="application/json"):
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/metrics"):
            inflight = self.server.inflight
            return self._send(200, "\n".join([
                "# TYPE kvpilot:gpu_cache_usage_factor gauge",
                "kvpilot:gpu_cache_usage_factor 0.5",
                "# TYPE kvpilot:num_requests_running gauge",
                f"kvpilot:num_requests_running {min(inflight, 1)}",
                "# TYPE kvpilot:num_requests_waiting gauge",
                "kvpilot:num_requests_waiting 0",
                "# TYPE kvpilot:num_waiting_tokens gauge",
                "kvpilot:num_waiting_tokens 0",
                "# TYPE kvpilot:num_preemptions counter",
                "kvpilot:num_preemptions_total 0",
                "# TYPE kvpilot:kv_cache_capacity_tokens gauge",
                "kvpilot:kv_cache_capacity_tokens 20000", ""]), "text/plain")
        if self.path.startswith("/v1/models"):
            return self._send(200, json.dumps({"object": "list", "data": [
                {"id": "stand-in", "object": "model"}]}))
        return self._send(200, "{}")  # /health and the like

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/v1/completions":  # the router's render/tokenize probes
            return self._send(404, json.dumps({"error": "not here"}))
        with self.server.lock:
            self.server.inflight += 1
        try:
            self.server.release.wait(120)
        finally:
            with self.server.lock:
                self.server.inflight -= 1
        self._send(200, json.dumps({"id": "cmpl-1", "object": "text_completion",
                                    "model": "stand-in", "choices": [
                                        {"index": 0, "text": "hi", "finish_reason": "stop"}],
                                    "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                              "total_tokens": 4}}))


@pytest.fixture(scope="module")
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInEngine)
    server.daemon_threads = True
    server.inflight, server.lock, server.release = 0, threading.Lock(), threading.Event()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def router(engine):
    port, metrics_port = free_port(), free_port()
    worker = f"http://127.0.0.1:{engine.server_address[1]}"
    log = tempfile.NamedTemporaryFile(prefix="kvpilot-router-", suffix=".log", delete=False)  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", worker,
         "--policy", "kv_aware", "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(metrics_port), "--health-check-interval-secs", "600"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start:\n{Path(log.name).read_text()}")
            try:
                if (httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
                        and httpx.get(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=1).status_code == 200):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield {"url": f"http://127.0.0.1:{port}", "metrics_port": metrics_port,
               "worker": worker}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def wait_until(what, check, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def send(url, count):
    def one(i):
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "stand-in", "prompt": f"request {i}", "max_tokens": 4})

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.slow
def test_both_sources_read_the_requests_a_real_router_holds(engine, router):
    names = RouterMetricNames()
    pod = EnginePod("chat-0", "127.0.0.1", engine.server_address[1])
    router_pod = EnginePod("chat-router-0", "127.0.0.1", router["metrics_port"])
    labels = {"namespace": "llm", "inference_deployment": "chat"}
    prom = PrometheusProcess([(f"127.0.0.1:{pod.port}", {**labels, "pod": pod.name}),
                              (f"127.0.0.1:{router_pod.port}",
                               {**labels, "pod": router_pod.name})])
    pods_source = PodScrapeSource("llm/chat")
    engine.release.clear()
    threads = send(router["url"], HELD)
    try:
        prom.wait_ready()
        wait_until("every request to reach the engine", lambda: engine.inflight == HELD)
        # The router's own page: the requests it has in flight, per engine URL.
        page = httpx.get(router_pod.metrics_url, timeout=5).text
        assert parse_router_in_flight(page, names) == {router["worker"]: float(HELD)}
        # Pods source: 8 in flight at the router, the engine counts 1 running, 0 waiting.
        reading = pods_source.read([pod], time.monotonic(), routers=[router_pod])
        assert reading.problem is None and reading.pods[0].num_running == 1.0
        assert reading.router_queued == HELD - 1
        # The policy: no engine queues, yet the router's held requests scale the fleet.
        auto = parse_spec({"model": {"uri": "embedded://smollm2-135m-instruct"},
                           "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}).autoscaling
        assert auto is not None
        quiet = decide(FleetSignals(reading.pods), PolicyState(), auto, 0.0)
        assert quiet.direction == "hold"
        held = decide(FleetSignals(reading.pods, 0, reading.router_queued), PolicyState(),
                      auto, 0.0)
        assert (held.direction, held.rule, held.desired_replicas) == ("up", "queue_drain", 2)
        # A real Prometheus scraping the router and the engine: the same answer.
        prom.wait_for("Prometheus to see the router's requests", lambda: prom.query(
            f"{router_query(names, SeriesSelector('llm', 'chat'))} == {HELD}"), timeout=60)
        prom.wait_for("Prometheus to see the engine", lambda: prom.query(
            'kvpilot:num_requests_running{pod="chat-0"} == 1'), timeout=60)
        prom_source = PrometheusSource(prom.url, SeriesSelector("llm", "chat"))
        queried = prom_source.read([pod], time.time())
        assert queried.router_queued == HELD - 1 and queried.pods[0].num_running == 1.0
        prom_source.close()
    finally:
        engine.release.set()
        for thread in threads:
            thread.join(timeout=30)
        prom.stop()
    # Finished: nothing held. The router's gauge returns to 0 (60 s: on a loaded two-core
    # machine the router once took longer than 30 s; the message shows what it still counts).
    assert not [t for t in threads if t.is_alive()], "a request did not finish after the release"
    seen: list[object] = []

    def router_idle() -> bool:
        seen[:] = [parse_router_in_flight(httpx.get(router_pod.metrics_url, timeout=5).text, names)]
        return seen[0] == {router["worker"]: 0.0}

    try:
        wait_until("the router to see them finish", router_idle, timeout=60.0)
    except AssertionError as e:
        raise AssertionError(f"{e}; the router's in-flight gauge last read {seen}") from None
    assert pods_source.read([pod], time.monotonic(), routers=[router_pod]).router_queued == 0.0
    pods_source.close()


@pytest.mark.tools
def test_promtool_the_router_query_sums_routers_and_drops_duplicate_scrapes(tmp_path):
    """Two router pods, one of them scraped by two jobs, another deployment's router and a
    series of a router policy for another worker: the query adds the routers up per engine
    worker, once per router, and only for this deployment."""
    query = router_query(RouterMetricNames(), SeriesSelector("llm", "chat"))
    s = 'vllm_router_running_requests{namespace="llm",inference_deployment="%s",pod="%s",' \
        'worker="%s",job="%s"}'
    a, b = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    series = [
        (s % ("chat", "chat-router-0", a, "pods"), "5+0x10"),
        (s % ("chat", "chat-router-0", a, "extra"), "5+0x10"),  # the same router, twice
        (s % ("chat", "chat-router-0", b, "pods"), "2+0x10"),
        (s % ("chat", "chat-router-1", a, "pods"), "3+0x10"),
        (s % ("other", "other-router-0", a, "pods"), "50+0x10"),  # another deployment
    ]
    (tmp_path / "empty.yaml").write_text("groups: []\n")
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["empty.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m",
                   "input_series": [{"series": k, "values": v} for k, v in series],
                   "promql_expr_test": [{"expr": query, "eval_time": "5m", "exp_samples": [
                       {"labels": f'{{worker="{a}"}}', "value": 8},
                       {"labels": f'{{worker="{b}"}}', "value": 2}]}]}]}))
    result = run([tool("promtool"), "test", "rules", "test.yaml"], cwd=tmp_path)
    assert "SUCCESS" in result.stdout
