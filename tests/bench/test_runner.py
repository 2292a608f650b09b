"""The load generator end to end against the fake server: timing, token counts,
concurrency, arrivals, multi-turn histories, hit rate, failures and the run timeout."""

from __future__ import annotations

import itertools
import time

import pytest

from kvpilot.bench import (
    BACKGROUND,
    MAIN,
    BenchConfig,
    BenchError,
    RequestSpec,
    format_report,
    run_benchmark,
)
from tests.bench.fake_server import MODEL, reply_token

TTFT_S, ITL_S = 0.10, 0.02
SLACK_S = 0.06  # scheduling noise on a busy 2-core machine; the delays are lower bounds


def small(url: str, **kw) -> BenchConfig:
    defaults = dict(base_url=url, random_input_len=16, output_len=8, num_prompts=6,
                    timeout_s=20)
    defaults.update(kw)
    return BenchConfig(**defaults)


def test_latencies_and_token_counts_match_the_injected_delays(fake):
    server = fake(ttft_s=TTFT_S, itl_s=ITL_S)
    result = run_benchmark(small(server.url, num_prompts=4, output_len=10))
    s = result.summary
    assert result.model == MODEL
    assert s["requests_completed"] == 4 and s["requests_failed"] == 0
    assert s["total_output_tokens"] == 40
    assert s["total_input_tokens"] == sum(len(b["prompt"].split()) for b in server.state.bodies)
    assert TTFT_S <= s["ttft_ms"]["mean"] / 1000 <= TTFT_S + SLACK_S
    assert s["itl_ms"]["count"] == 4 * 9
    assert ITL_S * 0.8 <= s["itl_ms"]["p50"] / 1000 <= ITL_S + SLACK_S / 4
    assert ITL_S * 0.95 <= s["itl_ms"]["mean"] / 1000 <= ITL_S + SLACK_S / 4
    assert s["e2e_ms"]["mean"] / 1000 >= TTFT_S + 9 * ITL_S
    # E2E = TTFT + the nine gaps + the wait for [DONE]; TPOT = (E2E - TTFT) / 9
    e2e_ms = s["ttft_ms"]["mean"] + 9 * s["itl_ms"]["mean"]
    assert s["e2e_ms"]["mean"] == pytest.approx(e2e_ms, abs=10)
    assert s["tpot_ms"]["mean"] == pytest.approx((s["e2e_ms"]["mean"]
                                                  - s["ttft_ms"]["mean"]) / 9)
    assert set(s["ttft_ms"]) == {"mean", "p50", "p99", "count"}
    for r in result.records:
        assert r.status == "ok" and r.usage_reported and r.output_tokens == 10
        assert r.reply.split()[0].startswith("r") and len(r.reply.split()) == 10


def test_requests_carry_fixed_output_lengths_and_stream_options(fake):
    server = fake()
    run_benchmark(small(server.url, num_prompts=2, output_len=7, extra_body={"top_k": 5}))
    for body in server.state.bodies:
        assert body["model"] == MODEL and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == body["min_tokens"] == 7 and body["ignore_eos"] is True
        assert body["top_k"] == 5
    run_benchmark(small(server.url, num_prompts=1, ignore_eos=False, model="named"))
    assert "ignore_eos" not in server.state.bodies[-1]
    assert "min_tokens" not in server.state.bodies[-1]
    assert server.state.bodies[-1]["model"] == "named"


def test_output_tokens_fall_back_to_chunk_counts_without_usage(fake):
    server = fake(send_usage=False)
    result = run_benchmark(small(server.url, num_prompts=3, output_len=5))
    assert result.summary["requests_completed"] == 3
    assert result.summary["total_output_tokens"] == 15
    assert result.summary["input_tokens_from_usage"] is False
    assert all(not r.usage_reported and r.prompt_tokens is None for r in result.records)


def test_max_concurrency_is_never_exceeded(fake):
    server = fake(ttft_s=0.02, itl_s=0.005)
    result = run_benchmark(small(server.url, num_prompts=20, max_concurrency=3))
    assert result.summary["requests_completed"] == 20
    assert server.state.max_in_flight == 3


def test_unlimited_concurrency_sends_everything_at_once(fake):
    server = fake(ttft_s=0.2, itl_s=0.001)
    result = run_benchmark(small(server.url, num_prompts=12, output_len=2))
    assert server.state.max_in_flight == 12
    assert max(r.send_time_s for r in result.records) < 0.15


def test_poisson_arrivals_spread_requests_at_the_requested_rate(fake):
    server = fake()
    rate = 100.0
    result = run_benchmark(small(server.url, num_prompts=100, output_len=1,
                                 request_rate=rate, seed=3))
    sends = sorted(r.send_time_s for r in result.records)
    mean_gap = (sends[-1] - sends[0]) / (len(sends) - 1)
    assert abs(mean_gap - 1 / rate) <= 0.2 / rate
    assert sends[0] == pytest.approx(0.0, abs=0.02)


def request_number(reply: str) -> int:
    """The fake's request number from the reply it sent (" r<n>t0 r<n>t1 ...")."""
    return int(reply.split()[0][1:].split("t")[0])


def test_multi_turn_histories_contain_the_replies_received(fake):
    server = fake(ttft_s=0.01, itl_s=0.001)
    config = small(server.url, dataset="multi-turn", num_sessions=3, num_turns=4,
                   turn_input_len=10, system_prompt_len=20, output_len=3)
    result = run_benchmark(config)
    assert result.summary["requests_completed"] == 12
    systems = set()
    for session in range(3):
        turns = sorted((r for r in result.records if r.session_id == session),
                       key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2, 3]
        bodies = [server.state.bodies[request_number(r.reply) - 1] for r in turns]
        for turn, (record, body) in enumerate(zip(turns, bodies)):
            messages = body["messages"]
            assert record.endpoint == "/v1/chat/completions"
            assert [m["role"] for m in messages] == (
                ["system"] + ["user", "assistant"] * turn + ["user"])
            systems.add(messages[0]["content"])
            if turn:  # the earlier conversation, the reply the fake sent, a new message
                previous = turns[turn - 1]
                n = request_number(previous.reply)
                assert messages[:-2] == bodies[turn - 1]["messages"]
                assert messages[-2]["content"] == "".join(reply_token(n, i) for i in range(3))
                assert messages[-1]["content"] not in [m["content"] for m in messages[:-1]]
        prompt_tokens = [r.prompt_tokens for r in turns]
        assert prompt_tokens == sorted(prompt_tokens) and prompt_tokens[0] < prompt_tokens[-1]
    assert len(systems) == 1  # num_system_prompts=1: one shared system prompt


def test_multi_turn_turns_are_sequential_and_think_time_is_respected(fake):
    server = fake(ttft_s=0.01, itl_s=0.001)
    result = run_benchmark(small(server.url, dataset="multi-turn", num_sessions=2,
                                 num_turns=3, turn_input_len=5, system_prompt_len=5,
                                 output_len=2, think_time_s=0.1))
    for session in range(2):
        turns = sorted((r for r in result.records if r.session_id == session),
                       key=lambda r: r.turn)
        for a, b in itertools.pairwise(turns):
            assert b.send_time_s >= a.send_time_s + a.e2e_s + 0.1


def test_hit_rate_comes_from_counter_deltas_summed_over_labels(fake):
    server = fake(hit_share=0.75)
    server.state.hits, server.state.queries = 1000, 1000  # traffic before the run
    result = run_benchmark(small(server.url, num_prompts=5, random_input_len=40))
    cache = result.prefix_cache
    assert cache["source"] == "kvpilot"
    assert cache["queries_delta"] == server.state.queries - 1000 > 0
    assert cache["hits_delta"] == server.state.hits - 1000
    assert cache["hit_rate"] == pytest.approx(cache["hits_delta"] / cache["queries_delta"])
    assert 0.7 <= cache["hit_rate"] <= 0.75


def test_hit_rate_uses_vllm_counters_and_is_none_without_counters(fake):
    vllm = fake(metrics="vllm", hit_share=1.0)
    cache = run_benchmark(small(vllm.url, num_prompts=2)).prefix_cache
    assert cache["source"] == "vllm" and cache["hit_rate"] == 1.0
    bare = fake(metrics="none")
    result = run_benchmark(small(bare.url, num_prompts=2))
    assert result.prefix_cache["hit_rate"] is None and result.prefix_cache["source"] is None
    assert "n/a (no prefix-cache counters" in format_report(result)


def test_unreadable_metrics_endpoint_gives_no_hit_rate_and_says_why(fake):
    server = fake()
    result = run_benchmark(small(server.url, num_prompts=2,
                                 metrics_url=server.url + "/not-metrics"))
    assert result.summary["requests_completed"] == 2
    assert result.prefix_cache["hit_rate"] is None
    assert result.prefix_cache["note"] == (f"metrics endpoint not readable (GET {server.url}"
                                           "/not-metrics: HTTP 404)")


def test_http_errors_and_broken_streams_are_counted_not_raised(fake):
    server = fake(ttft_s=0.005, itl_s=0.001, fail_every=4, break_every=5)
    result = run_benchmark(small(server.url, num_prompts=20, max_concurrency=1))
    s = result.summary
    # max_concurrency=1 keeps the order: requests 4, 8, 12, 16, 20 -> 500; 5, 10, 15 -> cut
    assert s["requests_failed"] == 8 and s["requests_completed"] == 12
    errors = {e["error"]: e["count"] for e in result.errors}
    assert errors["HTTP 500: injected failure 4"] == 1
    broken = [e for e in errors if "injected" not in e]
    assert sum(errors[e] for e in broken) == 3
    cut = [r for r in result.records if r.status == "failed" and r.text_chunks]
    assert len(cut) == 3 and all(r.text_chunks == 2 for r in cut)
    report = format_report(result)
    assert "requests failed" in report and "injected failure 4" in report


def test_failed_multi_turn_session_stops_and_counts_later_turns_as_not_sent(fake):
    server = fake(fail_every=5)
    result = run_benchmark(small(server.url, dataset="multi-turn", num_sessions=1,
                                 num_turns=8, turn_input_len=5, system_prompt_len=5))
    s = result.summary
    assert (s["requests_completed"], s["requests_failed"], s["requests_not_sent"]) == (4, 1, 3)


def test_run_timeout_bounds_the_run_and_fails_unfinished_requests(fake):
    server = fake(ttft_s=30.0)
    t0 = time.monotonic()
    result = run_benchmark(small(server.url, num_prompts=30, max_concurrency=2,
                                 timeout_s=0.5))
    assert time.monotonic() - t0 < 5
    s = result.summary
    assert result.timed_out
    assert s["requests_failed"] == 2 and s["requests_not_sent"] == 28
    assert "unfinished at the run timeout (0.5 s)" in result.errors[0]["error"]


def test_request_timeout_fails_one_request(fake):
    server = fake(ttft_s=0.5)
    result = run_benchmark(small(server.url, num_prompts=2, request_timeout_s=0.1))
    assert result.summary["requests_failed"] == 2
    assert result.errors == [{"error": "request timeout after 0.1 s", "count": 2}]


def test_background_decodes_run_while_long_prompts_arrive(fake):
    server = fake(ttft_s=0.01, itl_s=0.01)
    config = small(server.url, num_prompts=4, random_input_len=200, output_len=1,
                   request_rate=20, background_streams=2, background_input_len=8,
                   background_output_len=10_000)
    result = run_benchmark(config)
    main, bg = result.by_class[MAIN], result.by_class[BACKGROUND]
    assert main["requests_completed"] == 4 and main["requests_failed"] == 0
    assert bg["requests_cancelled"] == 2 and bg["requests_failed"] == 0
    assert bg["itl_ms"]["count"] > 10 and bg["ttft_ms"]["count"] == 2
    assert ITL_S * 0.4 <= bg["itl_ms"]["p50"] / 1000 <= 0.01 + SLACK_S / 4
    background = [r for r in result.records if r.request_class == BACKGROUND]
    for r in background:  # already decoding when the first long prompt arrived
        assert r.send_time_s < 0 and r.ttft_s is not None
        assert r.send_time_s + r.ttft_s <= 0.001
    main_ends = max(r.send_time_s + r.e2e_s for r in result.records if r.request_class == MAIN)
    assert result.duration_s == pytest.approx(main_ends, abs=0.05)
    assert server.state.max_in_flight >= 3
    header = next(line for line in format_report(result).splitlines() if "background" in line
                  and "main" in line)
    assert header.split() == ["main", "background"]


def test_custom_workload_classes_are_summarized_separately(fake):
    server = fake()
    workload = [RequestSpec("a b c", 3, 2, request_class="short"),
                RequestSpec("a b c d e f", 6, 4, request_class="long"),
                RequestSpec("a b", 2, 2, request_class="short")]
    result = run_benchmark(small(server.url), workload)
    assert list(result.by_class) == ["short", "long"]
    assert result.by_class["short"]["total_output_tokens"] == 4
    assert result.by_class["long"]["total_input_tokens"] == 6
    assert result.by_class["short"]["requests_not_sent"] == 0
    assert result.custom_workload
    assert "custom workload (classes: short, long)" in format_report(result)


def test_unreachable_server_raises_bench_error():
    with pytest.raises(BenchError, match=r"cannot list models at http://127\.0\.0\.1:9/v1/"):
        run_benchmark(BenchConfig(base_url="http://127.0.0.1:9", timeout_s=5))


def test_json_result_holds_config_summary_and_records(fake):
    server = fake()
    result = run_benchmark(small(server.url, num_prompts=3, api_key="secret", label="x"))
    data = result.to_json()
    assert data["config"]["api_key"] == "***" and data["config"]["label"] == "x"
    assert data["config"]["request_rate"] == "inf"
    assert data["summary"]["requests_completed"] == 3
    assert len(data["requests"]) == 3 and "reply" not in data["requests"][0]
    assert data["environment"]["python"]
    assert set(server.state.auth) == {"Bearer secret"}
