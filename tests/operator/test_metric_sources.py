"""Pod scraping over httpx's mock transport, Prometheus answers from a scripted HTTP
server, once-per-episode logging and the fleet observation (ready vs pending pods). The
same sources against a real engine and a real Prometheus: test_metric_sources_real.py."""

from __future__ import annotations

import dataclasses
import logging
import time

import httpx
import pytest

from kvpilot.operator.autoscaling.fleet import fleet_from
from kvpilot.operator.autoscaling.metrics_source import (
    EnginePod,
    PrometheusSource,
    SeriesSelector,
)
from kvpilot.operator.autoscaling.metrics_source.episodes import EpisodeLog
from tests.serverproc import free_port

from .engine_pages import page

# ---------------------------------------------------------------- pod scraping
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


def test_pods_source_reads_the_fleets_kv_window(scraped):
    pages, source = scraped
    pages.pages = {"10.0.0.1": page(window="4096"), "10.0.0.2": page(window="4096")}
    assert source.read(PODS, now=1.0).kv_window_tokens == 4096
    # An engine without the label (older, or in the middle of a rollout): no window.
    pages.pages["10.0.0.2"] = page()
    assert source.read(PODS, now=2.0).kv_window_tokens is None
    pages.pages["10.0.0.2"] = page(window="None")
    assert source.read(PODS, now=3.0).kv_window_tokens is None
    # A pod that could not be scraped reported no capacity: it does not count.
    pages.pages["10.0.0.2"] = httpx.ConnectError("refused")
    assert source.read(PODS, now=4.0).kv_window_tokens == 4096


def test_pods_source_failures_are_missing_and_logged_once_per_episode(scraped, caplog):
    pages, source = scraped
    caplog.set_level(logging.DEBUG, logger="kvpilot.operator.autoscaling.metrics_source.pods")
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
    assert server.queries == [*source.queries.values(), source.router_query]
    assert reading.kv_window_tokens is None  # no sliding_window label: older engines
    source.close()


@pytest.mark.parametrize("window_b,expected", [("4096", 4096), ("8192", 8192), ("None", None),
                                               ("garbage", None)])
def test_prometheus_reads_the_kv_window_from_the_cache_config_label(prom, window_b, expected):
    server, url = prom
    server.answers = {
        "gpu_cache_usage_factor": [sample("chat-a", 0.5), sample("chat-b", 0.5)],
        "cache_config_info": [
            sample("chat-a", 1, num_gpu_blocks="10", block_size="16", sliding_window="4096"),
            sample("chat-b", 1, num_gpu_blocks="20", block_size="16", sliding_window=window_b)],
    }
    source = PrometheusSource(url, SeriesSelector("llm", "chat"))
    reading = source.read([EnginePod("chat-a"), EnginePod("chat-b")], now=1.0)
    assert [p.kv_capacity_tokens for p in reading.pods] == [160.0, 320.0]
    assert reading.kv_window_tokens == expected
    assert "sliding_window" in source.queries["cache_config"]
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
    assert dataclasses.astuple(reading.pods[0])[1:] == (None,) * 11  # every signal, SLO ones too
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


# ---------------------------------------------------------------- demand held at the router
def router_page(**in_flight):
    """A vllm-router 0.1.17 /metrics page as it was observed (no TYPE lines, blank lines)
    with ``vllm_router_running_requests`` for each ``{worker URL: requests}``."""
    lines = ['vllm_router_active_workers 2', '']
    for url, value in in_flight.items():
        lines.append(f'vllm_router_running_requests{{worker="{url}"}} {value}')
    lines += ['', 'vllm_router_requests_total{route="/v1/completions"} 6']
    return "\n".join(lines) + "\n"


def signals(name, running, waiting):
    from kvpilot.autoscaler import PodSignals

    return PodSignals(name, 0.5, waiting, 0.0, running, 0.0, 20000.0)


def test_router_queued_matches_worker_urls_to_ready_pods():
    from kvpilot.operator.autoscaling.metrics_source import router_queued

    pods = [EnginePod("chat-a", "10.0.0.1"), EnginePod("chat-b", "10.0.0.2")]
    sigs = [signals("chat-a", running=4, waiting=1), signals("chat-b", running=2, waiting=0)]
    in_flight = {"http://10.0.0.1:8000": 9.0, "http://10.0.0.2:8000": 2.0}
    assert router_queued(in_flight, pods, sigs) == 4.0  # 11 routed - 7 counted
    # A worker that is no ready pod (draining, not ready yet, another port) is left out.
    assert router_queued({**in_flight, "http://10.0.0.9:8000": 30.0,
                          "http://10.0.0.1:9999": 5.0}, pods, sigs) == 4.0
    # Scrape skew: one engine counts more than its router has; the sum is clamped once.
    assert router_queued({"http://10.0.0.1:8000": 3.0, "http://10.0.0.2:8000": 4.0},
                         pods, sigs) == 0.0
    # An engine whose running or waiting count is missing cannot be compared: left out.
    partial = [signals("chat-a", running=None, waiting=1), sigs[1]]
    assert router_queued(in_flight, pods, partial) == 0.0
    # No router series at all (no router, or a policy that tracks no load): unknown.
    assert router_queued({}, pods, sigs) is None
    # IPv6 pod IPs and bad URLs.
    v6 = [EnginePod("chat-6", "fd00::7")]
    assert router_queued({"http://[FD00::7]:8000": 3.0, "not a url": 5.0, "http://:80": 1.0},
                         v6, [signals("chat-6", 1, 0)]) == 2.0


def test_pods_source_reads_the_router_pods_and_subtracts_what_engines_count(scraped):
    pages, source = scraped
    routers = [EnginePod("chat-router-0", "10.0.1.1", 29000),
               EnginePod("chat-router-1", "10.0.1.2", 29000)]
    pages.pages = {"10.0.0.1": page(waiting=0), "10.0.0.2": page(waiting=0),
                   "10.0.1.1": router_page(**{"http://10.0.0.1:8000": 9,
                                              "http://10.0.0.2:8000": 5}),
                   "10.0.1.2": router_page(**{"http://10.0.0.1:8000": 2})}
    reading = source.read(PODS, now=100.0, routers=routers)
    # 16 routed; the engines count running 5 + waiting 0 each.
    assert reading.router_queued == 6.0
    assert reading.problem is None and reading.reachable
    assert "http://10.0.1.1:29000/metrics" in pages.requests
    # Without router pods nothing is asked of them and the held demand is unknown.
    assert source.read(PODS, now=115.0).router_queued is None


def test_router_scrape_failures_count_zero_and_are_logged_once(scraped, caplog):
    pages, source = scraped
    routers = [EnginePod("chat-router-0", "10.0.1.1", 29000)]
    pages.pages = {"10.0.0.1": page(), "10.0.0.2": page(),
                   "10.0.1.1": httpx.ConnectError("refused")}
    for t in range(3):
        reading = source.read(PODS, now=100.0 + 15 * t, routers=routers)
        assert reading.router_queued is None  # counted as 0 by the autoscaler
        assert reading.problem is None  # the engines were read: no missing engine data
        assert reading.pods[0].kv_usage == 0.25
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 of 1 router pods" in warnings[0]
    # A router page without the series (a policy that tracks no load) is no failure.
    pages.pages["10.0.1.1"] = router_page()
    assert source.read(PODS, now=200.0, routers=routers).router_queued is None


def test_prometheus_reads_the_routers_in_flight_per_engine(prom):
    server, url = prom
    server.answers = {
        "gpu_cache_usage_factor": [sample("chat-a", 0.5), sample("chat-b", 0.5)],
        "num_requests_running": [sample("chat-a", 4), sample("chat-b", 4)],
        "num_requests_waiting": [sample("chat-a", 0), sample("chat-b", 1)],
        "vllm_router_running_requests": [
            {"metric": {"worker": "http://10.0.0.1:8000"}, "value": [1.0, "12"]},
            {"metric": {"worker": "http://10.0.0.2:8000"}, "value": [1.0, "5"]},
            {"metric": {"worker": "http://10.0.0.3:8000"}, "value": [1.0, "40"]},  # stale pod
        ],
    }
    source = PrometheusSource(url, SeriesSelector("llm", "chat"))
    assert source.router_query == (
        'sum by (worker) (max by (pod, worker) (vllm_router_running_requests'
        '{namespace="llm",inference_deployment="chat"}))')
    pods = [EnginePod("chat-a", "10.0.0.1"), EnginePod("chat-b", "10.0.0.2")]
    reading = source.read(pods, now=1.0)
    assert reading.router_queued == 8.0  # 17 routed to ready pods - 9 counted
    assert server.queries[-1] == source.router_query
    # No router series: unknown, and not reported as missing engine data.
    del server.answers["vllm_router_running_requests"]
    empty = source.read(pods, now=2.0)
    assert empty.router_queued is None
    assert "router" not in (empty.problem or "")
    # The router query failing leaves the engine signals intact.
    server.answers["vllm_router_running_requests"] = (400, {"status": "error", "error": "x"})
    failed = source.read(pods, now=3.0)
    assert failed.router_queued is None and failed.pods[0].kv_usage == 0.5
    source.close()


def test_fleet_lists_ready_router_pods_on_their_metrics_port():
    def router_obj(name, ready=True, ports=None):
        obj = pod_obj(name, ready=ready, ip="10.0.1.5")
        obj["spec"] = {"containers": [{"name": "router", "ports": ports or []}]}
        return obj

    fleet = fleet_from({"spec": {"replicas": 2}}, [pod_obj("c-1")], [
        router_obj("r-2", ports=[{"name": "http", "containerPort": 8000},
                                 {"name": "metrics", "containerPort": 9100}]),
        router_obj("r-1"),
        router_obj("r-3", ready=False),
    ])
    assert [(p.name, p.port) for p in fleet.routers] == [("r-1", 29000), ("r-2", 9100)]
    assert fleet.routers[1].metrics_url == "http://10.0.1.5:9100/metrics"
    assert fleet.pending_replicas == 1  # routers are neither supply nor engines
