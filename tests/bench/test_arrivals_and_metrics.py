"""Pure pieces: Poisson arrivals, percentiles and summaries, counter parsing and deltas."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.bench.arrivals import poisson_arrival_times
from kvpilot.bench.cache_counters import hit_rate, parse_counters
from kvpilot.bench.client import (
    RequestRecord,
    chunk_finish_reason,
    chunk_reasoning,
    chunk_text,
    error_message,
    request_payload,
)
from kvpilot.bench.metrics import distribution_ms, error_counts, percentile, summarize_class


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("rate", [0.5, 10.0, 400.0])
def test_poisson_mean_inter_arrival_is_one_over_the_rate(seed, rate):
    times = poisson_arrival_times(201, rate, random.Random(seed))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) == 200 and times[0] == 0.0
    assert abs(sum(gaps) / len(gaps) - 1 / rate) <= 0.2 / rate
    # exponential gaps: the standard deviation is about the mean as well
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert 0.7 <= std / mean <= 1.3


def test_poisson_is_seeded_and_inf_sends_all_at_once():
    assert (poisson_arrival_times(5, 2.0, random.Random(9))
            == poisson_arrival_times(5, 2.0, random.Random(9)))
    assert poisson_arrival_times(4, math.inf, random.Random(0)) == [0.0] * 4
    with pytest.raises(ValueError, match=r"rate must be > 0 requests/s .*got -2"):
        poisson_arrival_times(3, -2.0, random.Random(0))


@given(st.integers(min_value=0, max_value=50),
       st.floats(min_value=0.001, max_value=1e4, allow_nan=False))
def test_poisson_times_are_non_decreasing(count, rate):
    times = poisson_arrival_times(count, rate, random.Random(count))
    assert len(times) == count and times == sorted(times)


def test_percentile_interpolates_like_numpy_linear():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=40),
       st.floats(min_value=0, max_value=100), st.floats(min_value=0, max_value=100))
def test_percentile_is_monotone_and_within_the_data(values, p, q):
    lo, hi = sorted((p, q))
    assert min(values) <= percentile(values, lo) <= percentile(values, hi) <= max(values)


def test_distribution_in_ms_and_none_without_samples():
    assert distribution_ms([0.001, 0.003], (50, 99)) == {
        "mean": 2.0, "p50": 2.0, "p99": pytest.approx(2.98), "count": 2}
    assert distribution_ms([], (50,)) is None
    assert set(distribution_ms([1.0], (90, 99.9))) == {"mean", "p90", "p99.9", "count"}


def record(status="ok", ttft=0.1, e2e=0.5, itl=(0.1, 0.1), out=5, prompt=10, error=None):
    r = RequestRecord(0, "main", "/v1/completions", 12, out)
    r.status, r.ttft_s, r.e2e_s, r.itl_s = status, ttft, e2e, list(itl)
    r.output_tokens, r.prompt_tokens, r.error = out, prompt, error
    return r


def test_summary_counts_throughput_and_tpot():
    records = [record(), record(e2e=0.9, out=9),
               record(status="failed", error="HTTP 500: x", ttft=None, e2e=None, itl=()),
               record(status="cancelled", e2e=None, itl=(0.2,), out=3, prompt=None)]
    s = summarize_class(records, duration_s=2.0, percentiles=(50,))
    assert (s["requests_completed"], s["requests_failed"], s["requests_cancelled"]) == (2, 1, 1)
    assert s["total_output_tokens"] == 17 and s["total_input_tokens"] == 10 + 10 + 12
    assert s["input_tokens_from_usage"] is False
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 8.5
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5-0.1)/4 and (0.9-0.1)/8
    assert s["itl_ms"]["count"] == 5 and s["e2e_ms"]["count"] == 2
    assert s["ttft_ms"]["count"] == 3
    assert record(out=1).tpot_s is None
    assert error_counts(records * 2) == [{"error": "HTTP 500: x", "count": 2}]


KVPILOT_TEXT = """\
# HELP kvpilot:prefix_cache_hits_total hits
# TYPE kvpilot:prefix_cache_hits_total counter
kvpilot:prefix_cache_hits_total{model_name="a"} 30.0
kvpilot:prefix_cache_hits_total{model_name="b"} 10.0
kvpilot:prefix_cache_hits_created{model_name="a"} 1.7e9
# TYPE kvpilot:prefix_cache_queries_total counter
kvpilot:prefix_cache_queries_total{model_name="a"} 80.0
kvpilot:prefix_cache_queries_total{model_name="b"} 20.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total 1.0
"""


def test_counters_are_summed_over_label_sets():
    assert parse_counters(KVPILOT_TEXT) == {"kvpilot:prefix_cache_hits_total": 40.0,
                                            "kvpilot:prefix_cache_queries_total": 100.0,
                                            "vllm:prefix_cache_hits_total": 1.0}


def test_hit_rate_from_deltas_prefers_kvpilot_then_vllm_else_none():
    k = "kvpilot:prefix_cache_hits_total", "kvpilot:prefix_cache_queries_total"
    v = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    before = {k[0]: 40, k[1]: 100, v[0]: 0, v[1]: 0}
    after = {k[0]: 130, k[1]: 200, v[0]: 5, v[1]: 10}
    assert hit_rate(before, after)["hit_rate"] == 0.9
    assert hit_rate({v[0]: 1, v[1]: 2}, {v[0]: 4, v[1]: 6}) == {
        "hit_rate": 0.75, "source": "vllm", "hits_delta": 3, "queries_delta": 4, "note": None}
    assert hit_rate({}, {})["hit_rate"] is None
    assert hit_rate(None, after)["note"] == "metrics endpoint not readable"
    idle = hit_rate(before, before)
    assert idle["hit_rate"] is None and idle["source"] == "kvpilot"
    assert hit_rate(after, before)["note"].startswith("counters went down")


def test_payloads_and_chunk_parsing():
    body = request_payload("m", 16, prompt="hi", extra_body={"ignore_eos": False, "seed": 1})
    assert body == {"model": "m", "max_tokens": 16, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "prompt": "hi",
                    "ignore_eos": False, "min_tokens": 16, "seed": 1}
    chat = request_payload("m", 4, messages=[{"role": "user", "content": "x"}],
                           ignore_eos=False)
    assert "prompt" not in chat and "min_tokens" not in chat and chat["messages"]
    with pytest.raises(ValueError):
        request_payload("m", 4)
    assert chunk_text({"choices": [{"text": "a"}]}) == "a"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "b"}}]}) == "b"
    assert chunk_text({"choices": [], "usage": {}}) == ""
    thinking = {"choices": [{"delta": {"reasoning_content": "hmm"}}]}
    assert chunk_text(thinking) == "" and chunk_reasoning(thinking) == "hmm"
    assert chunk_reasoning({"choices": [{"text": "a"}]}) == ""
    assert chunk_finish_reason({"choices": [{"text": "a", "finish_reason": "length"}]}) == "length"
    assert chunk_finish_reason({"choices": [{"delta": {}, "finish_reason": None}]}) is None
    assert chunk_finish_reason({"choices": [], "usage": {}}) is None
    assert error_message(b'{"error": {"message": "too long", "code": 400}}') == "too long"
    assert error_message(b'{"detail": "x"}') == '{"detail": "x"}'
    assert error_message(b"") == "(empty body)"
