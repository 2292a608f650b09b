"""benchmarks/vllm_cpu.py's serving workloads time their requests with kvpilot bench's
client; run against the bench's fake server (no engine, no vLLM), each workload still
returns the result fields the script has always written."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.bench.fake_server import Behaviour, FakeServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vllm_cpu

pytestmark = pytest.mark.server

SIZES = {"serve_prompt": 8, "serve_requests": 6, "serve_concurrency": 3, "serve_output": 5,
         "lp_streams": 2, "lp_repeats": 1, "lp_stream_prompt": 8, "lp_stream_output": 60, "lp_len": 32,
         "mt_system": 20, "mt_user": 5, "mt_turns": 2, "mt_convs": 2, "mt_output": 3}


@pytest.fixture(scope="module")
def fake():
    with FakeServer(Behaviour(ttft_s=0.01, itl_s=0.01, metrics="vllm")) as server:
        yield server


def test_serve_counts_tokens_gaps_and_finish_reasons(fake):
    out = asyncio.run(vllm_cpu.serve_client(fake.url, SIZES, seed=1))
    assert out["output_tokens"] == 6 * 5 and out["chunks"] == 6 * 5
    assert out["itl_ms"]["n"] == 6 * 4 and out["ttft_ms"]["n"] == 6
    assert out["itl_ms"]["p50"] >= 5  # the fake's 10 ms gaps
    assert out["finish_reasons"] == ["length"]
    assert set(out) == {"wall_s", "output_tokens", "output_tok_s", "chunks", "itl_ms", "ttft_ms", "finish_reasons"}


def test_long_prompt_splits_the_gaps_around_the_prefill(fake):
    out = asyncio.run(vllm_cpu.long_prompt_client(fake.url, SIZES, seed=2))
    assert set(out) == {"itl_during_prefill_ms", "itl_before_ms", "long_ttft_ms", "repeats"}
    assert out["itl_before_ms"]["n"] >= 2 * 3  # each stream's first gaps, before the long prompt
    assert out["long_ttft_ms"]["n"] == 1 and out["long_ttft_ms"]["p50"] >= 5


def test_multi_turn_reads_the_hit_rate_and_sends_the_replies_back(fake):
    out = asyncio.run(vllm_cpu.multi_turn_client(fake.url, SIZES, seed=3))
    assert out["requests"] == 2 * 2 and out["queries"] > 0 and 0 < out["hit_rate"] <= 1
    assert out["prompt_tokens"] > 0 and out["ttft_ms"]["n"] == 4
    second_turns = [b for b in fake.state.bodies if len(b.get("messages", [])) > 2]
    assert second_turns and all(m["content"] for b in second_turns for m in b["messages"]
                                if m["role"] == "assistant")


def test_a_failed_request_raises(fake):
    fake.behaviour = Behaviour(fail_every=1)
    try:
        with pytest.raises(RuntimeError, match="HTTP 500: injected failure"):
            asyncio.run(vllm_cpu.serve_client(fake.url, SIZES, seed=4))
    finally:
        fake.behaviour = Behaviour(ttft_s=0.01, itl_s=0.01, metrics="vllm")
