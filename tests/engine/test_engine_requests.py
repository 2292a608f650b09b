"""Engine-level request handling: bad input is refused with a clear error and the
engine keeps serving (cases C04, C12), aborts free blocks, seeds reproduce."""

from __future__ import annotations

import pytest

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def test_c04_empty_prompt_and_zero_max_tokens_are_refused_and_the_engine_keeps_serving(make_engine, tokenizer):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 49152\)"):
        engine.add_request("oov", [1, 999999], SamplingParams(max_tokens=4))
    engine.add_request("ok", tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=4, temperature=0))
    outs = drain(engine)
    assert list(outs) == ["ok"] and outs["ok"].output_text.startswith(" Paris")
    assert engine.scheduler.kv.pool.num_used == 0


def test_c12_prompt_longer_than_the_pool_is_rejected_naming_both_numbers(make_engine, tokenizer):
    engine = make_engine(num_gpu_blocks_override=8, max_model_len=128)  # 128-token pool
    long_ids = tokenizer.encode("word " * 300)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("long", long_ids, SamplingParams(max_tokens=4))
    msg = str(e.value)
    assert f"{len(long_ids)} tokens" in msg and "128 tokens" in msg
    engine.add_request("next", tokenizer.encode("Hello"), SamplingParams(max_tokens=3, temperature=0))
    assert drain(engine)["next"].num_output_tokens == 3


def test_abort_releases_blocks_immediately(make_engine, tokenizer):
    engine = make_engine()
    engine.add_request("a", tokenizer.encode("Tell me a long story about"), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv.pool.num_used > 0
    assert engine.abort_request(["a", "missing"]) == ["a"]
    assert engine.scheduler.kv.pool.num_used == 0
    assert not engine.has_unfinished_requests()
    finished = engine.take_stats().finished
    assert [f.finish_reason for f in finished] == ["abort"]
    assert engine.take_stats().finished == []  # reported exactly once


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(make_engine, tokenizer):
    ids = tokenizer.encode("My favourite animal is")
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = make_engine()
    alone.add_request("x", ids, params)
    solo = drain(alone)["x"].output_token_ids
    crowded = make_engine()
    crowded.add_request("noise", tokenizer.encode("Some other text"), SamplingParams(max_tokens=12, temperature=1.0))
    crowded.add_request("x", ids, params)
    crowded.add_request("noise2", tokenizer.encode("More"), SamplingParams(max_tokens=5, temperature=0.7, seed=9))
    assert drain(crowded)["x"].output_token_ids == solo


def test_stop_string_ends_generation_and_is_not_in_the_text(make_engine, tokenizer):
    engine = make_engine()
    ids = tokenizer.encode("The capital of France is")
    engine.add_request("s", ids, SamplingParams(max_tokens=16, temperature=0, stop=["answer"]))
    out = drain(engine)["s"]
    assert out.finish_reason == "stop" and out.stop_reason == "answer"
    assert out.output_text == " Paris.\n\nThe "


@pytest.mark.parametrize(("stop", "max_tokens", "include", "text"), [
    (".", 2, False, " Paris"), (".", 2, True, " Paris."), ("Paris", 1, False, " ")])
def test_a_stop_string_on_the_last_allowed_token_is_a_stop_not_length(
        make_engine, tokenizer, stop, max_tokens, include, text):
    """Found in review: the text was cut at the stop but finish_reason said length."""
    engine = make_engine()
    ids = tokenizer.encode("The capital of France is")
    engine.add_request("s", ids, SamplingParams(max_tokens=max_tokens, temperature=0, stop=[stop],
                                               include_stop_str_in_output=include))
    out = drain(engine)["s"]
    assert (out.finish_reason, out.stop_reason, out.output_text) == ("stop", stop, text)
    engine.scheduler.check_integrity()


def test_logprobs_are_the_model_distribution(make_engine, tokenizer):
    import math

    engine = make_engine()
    engine.add_request("l", tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=3, temperature=0, logprobs=3))
    lps = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            lps += o.new_logprobs
    assert len(lps) == 3
    for lp in lps:
        assert lp.top[0][0] == lp.token_id  # greedy picks the top token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-5


def test_fp8_kv_cache_holds_twice_the_tokens_of_bf16_with_scales_fixed_at_start_up(make_engine, tokenizer):
    fp8 = make_engine(kv_cache_dtype="fp8")
    bf16 = make_engine(kv_cache_dtype="bfloat16")
    assert fp8.config.num_blocks == 2 * bf16.config.num_blocks
    assert fp8.config.kv_cache_dtype_name == "fp8_e4m3"
    cache = fp8.runner.kv_cache
    assert not cache.needs_calibration and not cache.calibrating  # fixed before the first request
    before = [float(layer.k_scale) for layer in cache.layers]
    fp8.add_request("p", tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=2, temperature=0))
    out = drain(fp8)["p"]
    assert out.output_text.startswith(" Paris")
    scales = [float(layer.k_scale) for layer in cache.layers]
    assert all(s != 1.0 and s > 0 for s in scales)  # never a silent 1.0
    assert scales == before  # the request did not move them


def test_bfloat16_on_cpu_generates_the_same_text():
    from kvpilot.engine.llm import LLM

    llm = LLM(device="cpu", dtype="bfloat16", kv_cache_memory=0.05)
    assert llm.engine.config.kv_cache_dtype_name == "bfloat16"
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=2, temperature=0))
    assert out[0].outputs[0].text == " Paris."
