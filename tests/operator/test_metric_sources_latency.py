"""The SLO's signals in both metric sources: per-pod ITL and TTFT histogram windows and
tokens per step. Pods: the difference of two scrapes (first scrape None, a reset reads as
the value since it). Prometheus: increase() answers by pod and le. Engines without the
series: None, never 0, and no problem reported."""

from __future__ import annotations

import math

import httpx
import pytest

from kvpilot.autoscaler import LatencyWindow
from kvpilot.operator.autoscaling.metrics_source import (
    EnginePod,
    PrometheusSource,
    SeriesSelector,
)
from kvpilot.operator.autoscaling.metrics_source.exposition import (
    HistogramSample,
    histogram_increase,
    mean_increase,
    parse_engine_metrics,
)
from kvpilot.operator.autoscaling.metrics_source.names import EngineMetricNames
from kvpilot.operator.autoscaling.metrics_source.prometheus import latency_window

from .engine_pages import page
from .test_metric_sources import PODS, sample

INF = math.inf
ITL_BOUNDS = (0.05, 0.1, 0.2)


def histogram_lines(name: str, counts: tuple[float, ...], total: float) -> list[str]:
    """A histogram as our engine writes it: cumulative ``counts`` for ITL_BOUNDS and +Inf."""
    lines = [f"# TYPE {name} histogram"]
    for bound, count in zip((*ITL_BOUNDS, "+Inf"), counts):
        lines.append(f'{name}_bucket{{le="{bound}",model_name="m"}} {count}')
    lines += [f'{name}_count{{model_name="m"}} {counts[-1]}',
              f'{name}_sum{{model_name="m"}} {total}']
    return lines


def latency_page(itl=(10, 50, 90, 100), itl_sum=9.0, ttft=(0, 1, 4, 5), ttft_sum=0.8,
                 steps=(4000.0, 100.0)) -> str:
    lines = [*histogram_lines("kvpilot:inter_token_latency_seconds", itl, itl_sum),
             *histogram_lines("kvpilot:time_to_first_token_seconds", ttft, ttft_sum),
             "# TYPE kvpilot:iteration_tokens_total histogram",
             'kvpilot:iteration_tokens_total_bucket{le="+Inf",model_name="m"} ' f"{steps[1]}",
             f'kvpilot:iteration_tokens_total_count{{model_name="m"}} {steps[1]}',
             f'kvpilot:iteration_tokens_total_sum{{model_name="m"}} {steps[0]}']
    return page() + "\n".join(lines) + "\n"


def test_the_page_parser_reads_the_histograms():
    sample_ = parse_engine_metrics(latency_page(), EngineMetricNames())
    assert sample_.itl == HistogramSample(((0.05, 10.0), (0.1, 50.0), (0.2, 90.0), (INF, 100.0)), 9.0)
    assert sample_.ttft is not None and sample_.ttft.count == 5
    assert sample_.iteration_tokens == (4000.0, 100.0)
    old = parse_engine_metrics(page(), EngineMetricNames())
    assert (old.itl, old.ttft, old.iteration_tokens) == (None, None, None)


def test_a_histogram_without_its_inf_bucket_or_with_a_bad_sample_is_none():
    text = latency_page().replace('le="+Inf",model_name="m"} 100', 'le="9",model_name="m"} 100')
    assert parse_engine_metrics(text, EngineMetricNames()).itl is None
    text = latency_page().replace('le="0.1",model_name="m"} 50', 'le="0.1",model_name="m"} -1')
    assert parse_engine_metrics(text, EngineMetricNames()).itl is None


def test_histogram_increase_differences_and_resets():
    before = HistogramSample(((0.1, 10.0), (INF, 20.0)), 2.0)
    after = HistogramSample(((0.1, 15.0), (INF, 40.0)), 5.0)
    assert histogram_increase(before, after) == LatencyWindow(((0.1, 5.0), (INF, 20.0)), 3.0)
    # Restarted pod: the counters went down, so the window is everything since the reset.
    restarted = HistogramSample(((0.1, 3.0), (INF, 4.0)), 0.5)
    assert histogram_increase(after, restarted) == LatencyWindow(((0.1, 3.0), (INF, 4.0)), 0.5)
    # New bucket bounds (another engine version): a reset too.
    rebucketed = HistogramSample(((0.2, 30.0), (INF, 41.0)), 5.5)
    assert histogram_increase(after, rebucketed).buckets == ((0.2, 30.0), (INF, 41.0))
    assert histogram_increase(None, after) is None and histogram_increase(after, None) is None
    assert mean_increase((100.0, 10.0), (400.0, 20.0)) == 30.0
    assert mean_increase((400.0, 20.0), (60.0, 2.0)) == 30.0  # reset
    assert mean_increase((400.0, 20.0), (400.0, 20.0)) is None  # no step ran
    assert mean_increase(None, (1.0, 1.0)) is None


def test_pods_source_reads_latency_windows_between_scrapes(scraped):
    pages, source = scraped
    pages.pages = {"10.0.0.1": latency_page(), "10.0.0.2": page()}
    first = source.read(PODS, now=100.0)
    assert all(p.itl is None and p.ttft is None and p.step_tokens is None for p in first.pods)
    pages.pages["10.0.0.1"] = latency_page(itl=(20, 100, 180, 200), itl_sum=19.0,
                                           ttft=(0, 2, 8, 10), ttft_sum=1.7, steps=(7000.0, 160.0))
    second = source.read(PODS, now=115.0)
    a, b = second.pods
    assert a.itl == LatencyWindow(((0.05, 10.0), (0.1, 50.0), (0.2, 90.0), (INF, 100.0)), 10.0)
    assert a.itl.quantile(0.9) == pytest.approx(0.2)
    assert a.ttft.count == 5 and a.ttft.sum_seconds == pytest.approx(0.9)
    assert a.step_tokens == pytest.approx(3000 / 60)
    # An engine without the histograms: None, and that is no missing load signal.
    assert (b.itl, b.ttft, b.step_tokens) == (None, None, None)
    assert b.missing == () and second.problem is None
    # The pod restarted: the window is what it counted since.
    pages.pages["10.0.0.1"] = latency_page(itl=(1, 2, 3, 4), itl_sum=0.3, ttft=(0, 0, 1, 1),
                                           ttft_sum=0.15, steps=(80.0, 4.0))
    third = source.read(PODS, now=130.0)
    assert third.pods[0].itl.count == 4 and third.pods[0].itl.sum_seconds == pytest.approx(0.3)
    assert third.pods[0].step_tokens == pytest.approx(20.0)


def test_a_pod_that_cannot_be_scraped_reports_no_window(scraped):
    pages, source = scraped
    pages.pages = {"10.0.0.1": latency_page(), "10.0.0.2": latency_page()}
    source.read(PODS, now=1.0)
    pages.pages["10.0.0.2"] = httpx.ConnectError("refused")
    reading = source.read(PODS, now=16.0)
    assert reading.pods[1].itl is None and reading.pods[1].kv_usage is None
    assert reading.pods[0].itl is not None and reading.pods[0].itl.count == 0


def test_prometheus_builds_windows_by_pod_and_le(prom):
    server, url = prom
    server.answers = {
        "gpu_cache_usage_factor": [sample("chat-a", 0.5), sample("chat-b", 0.4)],
        "inter_token_latency_seconds_bucket": [
            sample("chat-a", 9.8, le="0.05"), sample("chat-a", 50.1, le="0.1"),
            sample("chat-a", 49.9, le="0.2"),  # increase() extrapolation: not monotonic
            sample("chat-a", 100.0, le="+Inf"),
            sample("chat-b", 3.0, le="0.05")],  # no +Inf bucket: no window
        "inter_token_latency_seconds_sum": [sample("chat-a", 9.0), sample("chat-b", 1.0)],
        "iteration_tokens_total_sum": [sample("chat-a", 50.0), sample("chat-b", "NaN")],
    }
    source = PrometheusSource(url, SeriesSelector("llm", "chat"))
    reading = source.read([EnginePod("chat-a"), EnginePod("chat-b")], now=1.0)
    a, b = reading.pods
    assert a.itl == LatencyWindow(((0.05, 9.8), (0.1, 50.1), (0.2, 50.1), (INF, 100.0)), 9.0)
    assert b.itl is None and a.ttft is None and b.ttft is None
    assert a.step_tokens == 50.0 and b.step_tokens is None  # 0/0 = NaN: missing
    # The optional series' empty answers are not reported as a problem.
    assert "itl" not in (reading.problem or "") and "ttft" not in (reading.problem or "")
    queries = source.queries
    assert queries["itl_buckets"] == (
        "max by (pod, le) (increase(kvpilot:inter_token_latency_seconds_bucket"
        '{namespace="llm",inference_deployment="chat"}[1m]))')
    assert queries["step_tokens"] == (
        "max by (pod) (increase(kvpilot:iteration_tokens_total_sum"
        '{namespace="llm",inference_deployment="chat"}[1m])) / max by (pod)'
        " (increase(kvpilot:iteration_tokens_total_count"
        '{namespace="llm",inference_deployment="chat"}[1m]))')
    source.close()


def test_latency_window_refuses_what_is_not_a_histogram():
    assert latency_window({0.1: 1.0, INF: 2.0}, 0.3) == LatencyWindow(((0.1, 1.0), (INF, 2.0)), 0.3)
    assert latency_window({0.1: 1.0}, 0.3) is None
    assert latency_window({0.1: 1.0, INF: 2.0}, None) is None
    assert latency_window({0.1: float("nan"), INF: 2.0}, 0.3) is None
    assert latency_window({0.1: 1.0, INF: 2.0}, -1.0) is None
    assert latency_window(None, 1.0) is None


def test_the_engines_own_page_parses_into_the_slo_signals():
    """The engine's registry, written as the server writes /metrics, read by the pods
    source's parser: the names and shapes agree end to end."""
    from prometheus_client import generate_latest

    from kvpilot.engine.server.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    for itl in (0.03, 0.05, 0.3):
        metrics.itl.observe(itl)
    metrics.ttft.observe(1.2)
    for tokens in (64, 16):
        metrics.iteration_tokens.observe(tokens)
    sample_ = parse_engine_metrics(generate_latest(metrics.registry).decode(), EngineMetricNames())
    assert sample_.itl is not None and sample_.itl.count == 3
    assert sample_.itl.sum == pytest.approx(0.38)
    assert sample_.ttft is not None and sample_.ttft.count == 1
    assert sample_.iteration_tokens == (80.0, 2.0)
    window = histogram_increase(HistogramSample(tuple((b, 0.0) for b, _ in sample_.itl.buckets), 0.0),
                                sample_.itl)
    # buckets 0.04 and 0.06 hold 0.03 and 0.05: the median interpolates to 0.05
    assert window is not None and window.quantile(0.5) == pytest.approx(0.05)


def prefix_page(queries: float, hits: float) -> str:
    """An engine page with the prefix cache's counters (tokens)."""
    return page() + "\n".join([
        "# TYPE kvpilot:prefix_cache_queries_total counter",
        f'kvpilot:prefix_cache_queries_total{{model_name="m"}} {queries}',
        "# TYPE kvpilot:prefix_cache_hits_total counter",
        f'kvpilot:prefix_cache_hits_total{{model_name="m"}} {hits}']) + "\n"


def test_pods_source_reads_prefix_cache_rates_between_scrapes(scraped):
    """Prompt tokens looked up and held per second, from the two counters' increase; an
    engine without them reads None (the handover check is then skipped), a restarted pod
    the value since its reset."""
    pages, source = scraped
    pages.pages = {"10.0.0.1": prefix_page(1000, 600), "10.0.0.2": page()}
    first = source.read(PODS, now=100.0)
    assert all(p.prompt_token_rate is None and p.cached_token_rate is None for p in first.pods)
    pages.pages["10.0.0.1"] = prefix_page(31000, 24600)
    a, b = source.read(PODS, now=115.0).pods
    assert a.prompt_token_rate == pytest.approx(2000.0) and a.cached_token_rate == pytest.approx(1600.0)
    assert (b.prompt_token_rate, b.cached_token_rate) == (None, None) and b.missing == ()
    pages.pages["10.0.0.1"] = prefix_page(1500, 300)  # restarted
    a = source.read(PODS, now=130.0).pods[0]
    assert a.prompt_token_rate == pytest.approx(100.0) and a.cached_token_rate == pytest.approx(20.0)


def test_prometheus_reads_prefix_cache_rates_by_pod(prom):
    server, url = prom
    server.answers = {
        "gpu_cache_usage_factor": [sample("chat-a", 0.5), sample("chat-b", 0.4)],
        "prefix_cache_queries_total": [sample("chat-a", 2000.0), sample("chat-b", -1.0)],
        "prefix_cache_hits_total": [sample("chat-a", 1500.0)],
    }
    source = PrometheusSource(url, SeriesSelector("llm", "chat"))
    reading = source.read([EnginePod("chat-a"), EnginePod("chat-b")], now=1.0)
    a, b = reading.pods
    assert (a.prompt_token_rate, a.cached_token_rate) == (2000.0, 1500.0)
    assert (b.prompt_token_rate, b.cached_token_rate) == (None, None)  # negative: refused
    assert "prefix" not in (reading.problem or "")
    assert source.queries["cached_token_rate"] == (
        "max by (pod) (rate(kvpilot:prefix_cache_hits_total"
        '{namespace="llm",inference_deployment="chat"}[1m]))')
    source.close()
