"""Greedy outputs do not depend on prefix caching, the token budget, or how many
requests share a batch (real SmolLM2 weights, fp32)."""

from __future__ import annotations

import pytest

from kvpilot.engine.sampling_params import SamplingParams

from .prompts import QUESTIONS, SYSTEM_PREFIX

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
PROMPTS = [SYSTEM_PREFIX + q for q in QUESTIONS] + [SYSTEM_PREFIX + q + " Please." for q in QUESTIONS]


def run_batch(engine, prompts, tokenizer):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", tokenizer.encode(p), params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
        engine.scheduler.check_integrity()
    return [outs[f"r{i}"] for i in range(len(prompts))]


def run_one_by_one(engine, prompts, tokenizer):
    return [run_batch(engine, [p], tokenizer)[0] for p in prompts]


@pytest.fixture(scope="module")
def reference(make_engine, tokenizer):
    """No prefix cache, a budget larger than any prompt, one request at a time."""
    return run_one_by_one(make_engine(enable_prefix_caching=False, max_num_batched_tokens=2048), PROMPTS, tokenizer)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [16, 64, 2048])
def test_concurrent_batch_matches_one_by_one_reference(make_engine, tokenizer, reference, prefix_caching, budget):
    assert len(PROMPTS) == 16
    engine = make_engine(enable_prefix_caching=prefix_caching, max_num_batched_tokens=budget, max_num_seqs=16)
    outs = run_batch(engine, PROMPTS, tokenizer)
    assert outs == reference
    stats = engine.scheduler.prefix_stats
    if prefix_caching:
        # All 16 requests arrive together; with a big budget they are admitted in one step
        # (before anything is published), with small budgets later ones hit the prefix.
        assert stats.queries == sum(len(tokenizer.encode(p)) for p in PROMPTS)
        if budget < 2048:
            assert stats.hits > 0
    else:
        assert stats.hits == 0


def test_prefix_cache_hits_on_sequential_shared_prefix_traffic(make_engine, tokenizer, reference):
    engine = make_engine(enable_prefix_caching=True)
    outs = run_one_by_one(engine, PROMPTS, tokenizer)
    assert outs == reference
    stats = engine.scheduler.prefix_stats
    prefix_len = len(tokenizer.encode(SYSTEM_PREFIX))
    # Every request after the first reuses at least the system prompt's full blocks.
    assert stats.hits >= (len(PROMPTS) - 1) * (prefix_len // 16) * 16
    assert stats.hit_rate > 0.7


def test_c01_identical_prefix_in_the_same_step_equals_cache_off(make_engine, tokenizer, reference):
    engine = make_engine(enable_prefix_caching=True, max_num_batched_tokens=2048)
    outs = run_batch(engine, PROMPTS[:2], tokenizer)
    assert outs == reference[:2]
    # Both arrived in the same step. The second did not read the first one's blocks
    # before they were written: it waited for them (the shared prefix is longer than the
    # deferral threshold) and then hit exactly the shared full blocks.
    a, b = (tokenizer.encode(p) for p in PROMPTS[:2])
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert engine.scheduler.prefix_stats.hits == (common // 16) * 16 > 0
    prefix_blocks = len(tokenizer.encode(SYSTEM_PREFIX)) // 16
    assert engine.scheduler.kv.num_cached_blocks >= prefix_blocks
    assert engine.scheduler.kv.radix.num_nodes < 2 * prefix_blocks + 4  # the prefix is cached once


def test_c03_exact_block_multiple_prompt_hits_all_but_the_last_token(make_engine, tokenizer):
    engine = make_engine(enable_prefix_caching=True)
    ids = tokenizer.encode(SYSTEM_PREFIX * 3)[:48]  # exactly 3 x BS
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = []
    for rid in ("a", "b"):
        engine.add_request(rid, ids, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs.append((o.output_token_ids, o.num_cached_tokens))
    (first, hit_a), (second, hit_b) = outs
    assert (hit_a, hit_b) == (0, 47)
    assert first == second
    engine.scheduler.check_integrity()


def test_c10_preemption_recomputes_identically_and_is_not_a_hit(make_engine, tokenizer):
    prompts = [SYSTEM_PREFIX + q for q in QUESTIONS[:6]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = make_engine(enable_prefix_caching=False)
    tight = make_engine(enable_prefix_caching=True, num_gpu_blocks_override=10, max_model_len=160)

    cached = {}

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", tokenizer.encode(p), params)
        outs = {}
        preempted = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.output_token_ids
                    cached[o.request_id] = o.num_cached_tokens
            preempted += engine.take_stats().num_preemptions
            engine.scheduler.check_integrity()
        return [outs[f"r{i}"] for i in range(len(prompts))], preempted

    roomy_out, _ = run(roomy)
    tight_out, preempted = run(tight)
    assert tight_out == roomy_out
    s = tight.scheduler
    assert s.num_preemptions_total == preempted > 0
    # Hits are counted at first admission only: they equal the sum of what each
    # request found cached when it was first scheduled, although preempted requests
    # re-matched their own blocks when they resumed. Queries are the prompts, once.
    assert s.prefix_stats.queries == sum(len(tokenizer.encode(p)) for p in prompts)
    assert s.prefix_stats.hits == sum(cached.values())
