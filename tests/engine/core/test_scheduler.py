"""Scheduler behaviour on a fake model: budgets, chunking, decode priority,
preemption, rejection and the public cases C01, C03, C10, C12, C13."""

import pytest

from kvpilot.engine.core.request import RequestStatus
from kvpilot.engine.core.scheduler import RequestRejectedError, SchedulerConfig

from .helpers import make_request, make_scheduler, run_to_completion, step


def test_long_prompt_is_chunked_under_the_budget():
    s = make_scheduler(num_blocks=20, budget=8)
    s.add_request(make_request("a", list(range(1, 21)), max_tokens=3))
    chunks = [step(s).num_batched_tokens for _ in range(3)]
    assert chunks == [8, 8, 4]
    req = s.requests["a"]
    assert req.num_output_tokens == 1  # sampled only when the prompt was done
    out = step(s)
    assert (out.num_decodes, out.num_batched_tokens) == (1, 1)
    step(s)
    assert "a" not in s.requests
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 3


def test_c13_decodes_run_every_step_while_long_prompts_arrive():
    s = make_scheduler(num_blocks=400, block_size=4, budget=32, max_num_seqs=12)
    for i in range(8):
        s.add_request(make_request(f"d{i}", [10 + i, 11, 12], max_tokens=60))
    step(s)  # prefill all 8 short prompts in one step
    assert all(not r.is_prefilling for r in s.running)
    longs = [make_request(f"long{i}", list(range(100, 200)), max_tokens=2) for i in range(3)]
    for r in longs:
        s.add_request(r)
    chunk_sizes = []
    for _ in range(30):
        out = step(s)
        decoding = [it for it in out.scheduled[: out.num_decodes] if it.request.request_id.startswith("d")]
        assert len(decoding) == 8, "a step went by without every running decode"
        assert out.num_batched_tokens <= 32
        chunk_sizes += [it.num_tokens for it in out.scheduled[out.num_decodes :]]
    # The long prompts advanced in chunks of what the decodes left over (32 - 8 = 24).
    assert max(chunk_sizes) == 24
    assert all(r.num_output_tokens >= 1 for r in longs)  # and the prompts got through


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(num_blocks=50, budget=16, max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", [i + 1, 5, 6], max_tokens=5))
    out = step(s)
    assert [it.request.request_id for it in out.scheduled] == ["r0", "r1"]
    assert s.num_waiting == 2
    run_to_completion(s)


def test_c12_request_larger_than_the_pool_is_rejected_at_once_and_the_queue_flows():
    s = make_scheduler(num_blocks=4, block_size=4)  # 16 tokens in the pool
    with pytest.raises(RequestRejectedError) as e:
        s.add_request(make_request("huge", list(range(1, 41))))
    assert "40 tokens" in str(e.value) and "16" in str(e.value)
    with pytest.raises(RequestRejectedError, match="max_tokens is 10"):
        s.add_request(make_request("long-out", list(range(1, 10)), max_tokens=10))
    s.add_request(make_request("ok", [1, 2, 3], max_tokens=4))
    run_to_completion(s)
    assert not s.requests


def test_c04_empty_prompt_is_rejected():
    s = make_scheduler()
    with pytest.raises(RequestRejectedError, match="empty"):
        s.add_request(make_request("e", []))
    assert not s.requests and not s.waiting


def test_max_model_len_larger_than_the_pool_is_refused():
    from kvpilot.engine.core.kv_cache_manager import KVCacheManager
    from kvpilot.engine.core.scheduler import Scheduler

    with pytest.raises(ValueError, match=r"max_model_len \(100\) is larger than the KV cache \(4 blocks x 4 = 16"):
        Scheduler(SchedulerConfig(max_model_len=100, max_num_seqs=4, max_num_batched_tokens=8), KVCacheManager(4, 4))


def test_config_validation_names_the_values():
    with pytest.raises(ValueError, match=r"max_num_seqs \(300\) must be <= max_num_batched_tokens \(256\)"):
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=300)


def test_c10_preemption_by_recompute_is_counted_and_never_a_prefix_hit():
    # 6 blocks x 4 = 24 tokens; two requests of 8 + 12 tokens cannot both fit.
    s = make_scheduler(num_blocks=6, block_size=4, budget=16, max_model_len=24)
    s.add_request(make_request("old", list(range(1, 9)), max_tokens=12, ignore_eos=True))
    s.add_request(make_request("new", list(range(21, 29)), max_tokens=12, ignore_eos=True))
    preempted = []
    while s.has_unfinished_requests():
        preempted += step(s).preempted_ids
    assert preempted and set(preempted) == {"new"}
    assert s.num_preemptions_total == len(preempted)
    # Both prompts were queried once (first admissions only) and nothing was a hit,
    # even though "new" re-matched its own published blocks when it resumed.
    assert s.prefix_stats.queries == 16
    assert s.prefix_stats.hits == 0


def test_preempted_request_resumes_from_its_cached_blocks_and_finishes_identically():
    def run(num_blocks):
        s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=16, max_model_len=24)
        reqs = [
            make_request("old", list(range(1, 9)), max_tokens=12, ignore_eos=True),
            make_request("new", list(range(21, 29)), max_tokens=12, ignore_eos=True),
        ]
        for r in reqs:
            s.add_request(r)
        run_to_completion(s)
        return [r.output_token_ids for r in reqs], s.num_preemptions_total

    tight, n_tight = run(6)
    roomy, n_roomy = run(40)
    assert n_tight > 0 and n_roomy == 0
    assert tight == roomy


def test_c03_exact_block_multiple_prompt_twice():
    s = make_scheduler(num_blocks=20, block_size=4)
    prompt = list(range(1, 13))  # 3 x BS
    s.add_request(make_request("first", prompt, max_tokens=5, ignore_eos=True))
    run_to_completion(s)
    second = make_request("second", prompt, max_tokens=5, ignore_eos=True)
    s.add_request(second)
    out = step(s)
    (item,) = out.scheduled
    # Only the last prompt token is recomputed, and its KV (already cached) is not rewritten.
    assert (item.start_position, item.token_ids, item.slot_mapping) == (11, [12], [-1])
    assert second.num_cached_tokens == 11
    run_to_completion(s)
    assert second.output_token_ids == _reference_outputs(prompt, 5)
    # A later request extending prompt + the first 4 generated tokens hits the whole
    # chain: the 3 prompt blocks and the block of generated tokens (their KV was
    # computed when they were fed back; the 5th token's never was).
    third = make_request("third", [*prompt, *second.output_token_ids[:4], 99])
    s.add_request(third)
    step(s)
    assert third.num_cached_tokens == 16


def _reference_outputs(prompt, n):
    s = make_scheduler(num_blocks=20, block_size=4, prefix_caching=False)
    r = make_request("ref", prompt, max_tokens=n, ignore_eos=True)
    s.add_request(r)
    run_to_completion(s)
    return r.output_token_ids


def test_c01_same_prefix_in_the_same_step_reuses_only_written_blocks():
    s = make_scheduler(num_blocks=30, block_size=4, budget=64)
    prefix = list(range(1, 13))
    a = make_request("a", [*prefix, 40], max_tokens=5, ignore_eos=True)
    b = make_request("b", [*prefix, 41], max_tokens=5, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert [it.request.request_id for it in out.scheduled] == ["a", "b"]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0  # nothing was written yet
    assert all(slot >= 0 for it in out.scheduled for slot in it.slot_mapping)
    # After the step the duplicate prefix collapses onto a's blocks.
    assert b.block_ids[:3] == a.block_ids[:3]
    run_to_completion(s)
    assert a.output_token_ids == _reference_outputs([*prefix, 40], 5)
    assert b.output_token_ids == _reference_outputs([*prefix, 41], 5)


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make_scheduler(num_blocks=10, block_size=4, budget=16, max_num_seqs=1)
    s.add_request(make_request("run", list(range(1, 10)), max_tokens=20, ignore_eos=True))
    s.add_request(make_request("wait", [1, 2], max_tokens=3))
    step(s)
    assert s.kv.pool.num_used == 3
    done = s.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["run", "wait"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert s.kv.pool.num_used == 0 and not s.requests
    s.check_integrity()


def test_stop_token_ids_and_min_tokens():
    s = make_scheduler(num_blocks=20)
    r = make_request("r", [1, 2, 3], max_tokens=10)
    s.add_request(r)
    step(s)
    first = r.output_token_ids[0]
    s2 = make_scheduler(num_blocks=20)
    r2 = make_request("r2", [1, 2, 3], max_tokens=10, stop_token_ids=[first])
    s2.add_request(r2)
    step(s2)
    assert r2.status == RequestStatus.FINISHED_STOPPED and r2.stop_reason == first
    s3 = make_scheduler(num_blocks=20)
    r3 = make_request("r3", [1, 2, 3], max_tokens=10, min_tokens=2, stop_token_ids=[first])
    s3.add_request(r3)
    step(s3)
    assert r3.status == RequestStatus.RUNNING  # min_tokens not reached: the stop token is ignored


def test_waiting_tokens_gauge_counts_unprefilled_prompt_tokens():
    s = make_scheduler(num_blocks=40, budget=8)
    s.add_request(make_request("a", list(range(1, 21))))
    s.add_request(make_request("b", list(range(1, 6))))
    assert s.num_waiting_tokens == 25
    step(s)  # a: 8 of 20 computed, b still waiting
    assert s.num_waiting_tokens == 12 + 5


def test_request_waits_for_a_long_prefix_being_computed_then_hits_it():
    s = make_scheduler(num_blocks=40, block_size=4, budget=64)
    prefix = list(range(1, 25))  # 6 blocks, over the 4-block deferral threshold
    a = make_request("a", [*prefix, 40], max_tokens=3, ignore_eos=True)
    b = make_request("b", [*prefix, 41], max_tokens=3, ignore_eos=True)
    c = make_request("c", [90, 91, 92], max_tokens=3, ignore_eos=True)
    for r in (a, b, c):
        s.add_request(r)
    out = step(s)
    # b shares a's uncomputed prefix: it waits one step; c (unrelated) is not held up.
    assert [it.request.request_id for it in out.scheduled] == ["a", "c"]
    out = step(s)
    assert "b" in [it.request.request_id for it in out.scheduled]
    assert b.num_cached_tokens == 24
    run_to_completion(s)
    assert b.output_token_ids == _reference_outputs([*prefix, 41], 3)


def test_no_deferral_without_prefix_caching_or_when_disabled():
    from kvpilot.engine.core.kv_cache_manager import KVCacheManager
    from kvpilot.engine.core.scheduler import Scheduler

    prefix = list(range(1, 25))
    for caching, defer in ((False, 4), (True, 0)):
        cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=160, defer_shared_prefix_blocks=defer)
        s = Scheduler(cfg, KVCacheManager(40, 4, caching))
        s.add_request(make_request("a", [*prefix, 40]))
        s.add_request(make_request("b", [*prefix, 41]))
        assert len(step(s).scheduled) == 2
