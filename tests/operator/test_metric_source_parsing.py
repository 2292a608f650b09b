"""The pure parts of the metric sources: the /metrics parser, value validation, metric
and label names, the PromQL text and the source factory."""

from __future__ import annotations

import dataclasses

import pytest

from kvpilot.operator.autoscaling.metrics_source import (
    EngineMetricNames,
    EnginePod,
    PodScrapeSource,
    PrometheusSource,
    SeriesSelector,
    SourceConfig,
    build_source,
    signal_queries,
)
from kvpilot.operator.autoscaling.metrics_source.exposition import (
    ExpositionError,
    parse_engine_metrics,
)
from kvpilot.operator.autoscaling.metrics_source.reading import fleet_kv_window, pod_signals

from .engine_pages import page

NAMES = EngineMetricNames()


def test_parse_reads_every_signal_and_sums_counters_over_labels():
    sample = parse_engine_metrics(page(), NAMES)
    assert (sample.kv_usage, sample.num_waiting, sample.waiting_tokens, sample.num_running) == (
        0.25, 3.0, 300.0, 5.0)
    assert (sample.preemptions, sample.generation_tokens, sample.prompt_tokens) == (7, 1000, 3000)
    assert sample.requests_finished == 4.0  # stop + length
    assert sample.kv_capacity_tokens == 20000.0


@pytest.mark.parametrize("garbage", ["-5", "+Inf", "-Inf", "NaN"])
def test_a_counter_or_gauge_that_is_no_measurement_is_missing(garbage):
    """Found in review: a generation counter of -5 or +Inf reached the FinOps arithmetic,
    which raised, and every autoscaler tick after it failed while that pod lived."""
    sample = parse_engine_metrics(page(generated=garbage, usage=garbage), NAMES)
    assert sample.generation_tokens is None
    # A negative gauge is a value here; pod_signals refuses it as KV usage (tested above).
    assert sample.kv_usage == (-5.0 if garbage == "-5" else None)
    assert sample.prompt_tokens == 3000  # the rest of the page still counts


def test_c17_a_misspelled_counter_is_missing_not_zero():
    names = dataclasses.replace(NAMES, preemptions="kvpilot:num_preemptions")
    assert parse_engine_metrics(page(), names).preemptions is None
    assert parse_engine_metrics("", NAMES).kv_usage is None


def test_capacity_falls_back_to_cache_config_info():
    assert parse_engine_metrics(page(capacity=False), NAMES).kv_capacity_tokens == 1456 * 16


@pytest.mark.parametrize("capacity", [True, False])
def test_the_kv_window_is_the_sliding_window_label_of_cache_config_info(capacity):
    sample = parse_engine_metrics(page(capacity=capacity, window="4096"), NAMES)
    assert sample.kv_window_tokens == 4096
    assert sample.kv_capacity_tokens == (20000.0 if capacity else 1456 * 16)


@pytest.mark.parametrize("label", [None, "None", "", "0", "-4096", "4096.0", "abc", "\u0664"])
def test_no_window_label_or_a_garbage_one_is_no_window(label):
    """An engine without the label (older), a full-attention model ("None", as vLLM
    formats a missing value) or a value that is no positive integer: no window, and the
    rest of the page reads as before."""
    sample = parse_engine_metrics(page(capacity=False, window=label), NAMES)
    assert sample.kv_window_tokens is None
    assert sample.kv_capacity_tokens == 1456 * 16 and sample.kv_usage == 0.25


@pytest.mark.parametrize("windows,expected", [
    ([], None), ([4096], 4096), ([4096, 4096], 4096), ([4096, 8192], 8192),
    ([4096, None], None), ([None], None),
])
def test_the_fleet_window_is_the_largest_only_when_every_pod_has_one(windows, expected):
    assert fleet_kv_window(windows) == expected


def test_a_page_that_is_not_prometheus_text_is_an_error():
    with pytest.raises(ExpositionError, match="not Prometheus text format"):
        parse_engine_metrics("kvpilot:gpu_cache_usage_factor{ oops", NAMES)


@pytest.mark.parametrize("usage,expected", [(0.4, 0.4), (1.5, None), (-0.1, None),
                                            (float("nan"), None), (float("inf"), None)])
def test_values_out_of_range_are_missing(usage, expected):
    assert pod_signals("p", usage, 1, 1, 1, 0, 100).kv_usage == expected


def test_metric_names_and_labels_are_validated():
    with pytest.raises(ValueError, match="metric name for kv_usage must match"):
        EngineMetricNames(kv_usage="kvpilot gpu")
    with pytest.raises(ValueError, match="pod_label must be a Prometheus label name"):
        SeriesSelector("llm", "chat", pod_label="pod-name")
    with pytest.raises(ValueError, match="rate_window must be a PromQL duration"):
        signal_queries(NAMES, SeriesSelector("llm", "chat"), "1 minute")
    with pytest.raises(ValueError, match=r"metrics\.url is required"):
        SourceConfig("prometheus", None, "llm", "chat")
    with pytest.raises(ValueError, match=r"metrics\.source must be one of prometheus, pods"):
        SourceConfig("datadog", None, "llm", "chat")


def test_promql_is_the_documented_text_and_escapes_label_values():
    queries = signal_queries(NAMES, SeriesSelector("llm", "chat"))
    assert queries["preemption_rate"] == (
        'max by (pod) (rate(kvpilot:num_preemptions_total'
        '{namespace="llm",inference_deployment="chat"}[1m]))')
    assert queries["kv_usage"] == (
        'max by (pod) (kvpilot:gpu_cache_usage_factor'
        '{namespace="llm",inference_deployment="chat"})')
    assert queries["cache_config"] == (
        'max by (pod, num_gpu_blocks, block_size, sliding_window) (kvpilot:cache_config_info'
        '{namespace="llm",inference_deployment="chat"})')
    odd = SeriesSelector('we"ird', "a\\b").matchers()
    assert odd == '{namespace="we\\"ird",inference_deployment="a\\\\b"}'


def test_engine_pod_urls():
    assert EnginePod("p", "10.0.0.5").metrics_url == "http://10.0.0.5:8000/metrics"
    assert EnginePod("p", "fd00::5", 9000).metrics_url == "http://[fd00::5]:9000/metrics"
    assert EnginePod("p").metrics_url is None


def test_build_source_picks_the_kind():
    pods = build_source(SourceConfig("pods", None, "llm", "chat"))
    prom = build_source(SourceConfig("prometheus", "http://prom:9090/", "llm", "chat"))
    assert isinstance(pods, PodScrapeSource) and isinstance(prom, PrometheusSource)
    assert prom.url == "http://prom:9090"
    pods.close()
    prom.close()
