"""LoRA adapters in the scheduling core: prefix-cache isolation by adapter, and the
``max_loras`` admission rule (vLLM v1's ``scheduled_loras``), block by block on CPU."""

from __future__ import annotations

import pytest

from kvpilot.engine.core.block_pool import CacheIntegrityError
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import RequestStatus
from kvpilot.engine.core.scheduler import SchedulerConfig

from .helpers import adapter, make_request, make_scheduler, run_to_completion, step

A, B, C = adapter("alpha", 1), adapter("beta", 2), adapter("gamma", 3)
PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks of 4


def admit(kv: KVCacheManager, req) -> int:
    nodes, hit = kv.match_prefix(req)
    assert kv.can_admit(req, nodes)
    kv.admit(req, nodes, hit)
    return hit


def compute_all(kv: KVCacheManager, req) -> None:
    req.num_computed_tokens = req.num_tokens
    kv.publish(req)


# ------------------------------------------------------------------ the request
def test_request_carries_the_adapter_and_its_namespace():
    base = make_request("b", PROMPT)
    assert base.lora_request is None and base.lora_int_id == 0 and base.lora_name is None
    assert base.lora_weights is None
    assert base.cache_namespace == (None, None)
    r = make_request("r", PROMPT, lora=A, salt="s")
    assert r.lora_request is A and r.lora_int_id == 1 and r.lora_name == "alpha"
    assert r.cache_namespace == ("alpha", "s")


# -------------------------------------------------------- prefix-cache isolation
def test_the_same_prompt_under_two_adapters_and_the_base_never_shares_kv():
    kv = KVCacheManager(30, 4)
    writers = [make_request(f"w{i}", PROMPT, lora=lora) for i, lora in enumerate((None, A, B))]
    for w in writers:
        assert admit(kv, w) == 0  # nothing cached yet in its namespace
        compute_all(kv, w)
    # Three separate chains: no block is shared between namespaces.
    blocks = [w.block_ids[:3] for w in writers]
    chains = [set(b) for b in blocks]
    assert chains[0].isdisjoint(chains[1]) and chains[0].isdisjoint(chains[2]) and chains[1].isdisjoint(chains[2])
    for w in writers:
        kv.free(w)
    kv.check_integrity()
    # Within a namespace the prefix hits, and exactly on that namespace's blocks.
    for w, own, lora in zip(writers, blocks, (None, A, B), strict=True):
        reader = make_request(f"r-{w.request_id}", [*PROMPT, 99], lora=lora)
        assert admit(kv, reader) == 12
        assert reader.block_ids[:3] == own
        kv.free(reader)
    # An adapter never hits the base's or another adapter's blocks.
    gamma = make_request("g", PROMPT, lora=C)
    assert admit(kv, gamma) == 0
    assert set(gamma.block_ids).isdisjoint(set().union(*chains))
    kv.check_integrity([gamma])


def test_adapter_and_salt_together_form_the_namespace():
    kv = KVCacheManager(30, 4)
    w = make_request("w", PROMPT, lora=A, salt="t")
    admit(kv, w)
    compute_all(kv, w)
    kv.free(w)
    assert admit(kv, make_request("x", PROMPT, lora=A)) == 0  # same adapter, no salt
    assert admit(kv, make_request("y", PROMPT, salt="t")) == 0  # same salt, no adapter
    # An adapter named like a salt is not that salt.
    assert admit(kv, make_request("z", PROMPT, lora=adapter("t", 9))) == 0
    assert admit(kv, make_request("hit", PROMPT, lora=A, salt="t")) == 12


def test_in_flight_block_hashes_differ_by_adapter():
    base, a, b = (make_request(n, PROMPT, lora=lora) for n, lora in (("0", None), ("a", A), ("b", B)))
    hashes = [r.block_hashes(4, 3) for r in (base, a, b)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert set(hashes[i]).isdisjoint(hashes[j])
    assert make_request("a2", PROMPT, lora=A).block_hashes(4, 3) == hashes[1]
    # A renamed registration (another id, same name) is the same namespace, as in vLLM.
    assert make_request("a3", PROMPT, lora=adapter("alpha", 7)).block_hashes(4, 3) == hashes[1]


def test_in_flight_dedup_does_not_defer_across_adapters():
    """A waiting request is deferred for a prefix being computed by a running request
    of its own namespace only: another adapter's identical prompt is admitted at once."""
    sched = make_scheduler(num_blocks=40, budget=64, max_loras=2, max_model_len=160)
    prefix = list(range(1, 25))  # 6 blocks, over the 4-block deferral threshold
    first = make_request("first", [*prefix, 40], lora=A)
    same = make_request("same", [*prefix, 41], lora=A)
    other = make_request("other", [*prefix, 42], lora=B)
    for r in (first, same, other):
        sched.add_request(r)
    out = step(sched)
    assert [it.request.request_id for it in out.scheduled] == ["first", "other"]
    assert other.num_cached_tokens == 0
    out = step(sched)
    assert "same" in [it.request.request_id for it in out.scheduled]
    assert same.num_cached_tokens == 24  # it waited for alpha's blocks, then hit them
    run_to_completion(sched)


# ------------------------------------------------------------------ max_loras
def test_an_adapter_request_with_lora_off_is_a_bug():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="max_loras"):
        sched.add_request(make_request("r", [1, 2, 3], lora=A))
    assert not sched.requests
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_loras=-1)


def test_admission_skips_an_adapter_over_max_loras_and_goes_on():
    sched = make_scheduler(num_blocks=40, budget=64, max_loras=2, max_model_len=40)
    order = [("a1", A), ("b1", B), ("c1", C), ("base", None), ("a2", A), ("c2", C)]
    for rid, lora in order:
        sched.add_request(make_request(rid, [5, 6, 7], max_tokens=3, lora=lora))
    out = sched.schedule()
    # gamma would be a third adapter: c1 and c2 wait, in order; the rest is admitted.
    assert [it.request.request_id for it in out.scheduled] == ["a1", "b1", "base", "a2"]
    assert [r.request_id for r in sched.waiting] == ["c1", "c2"]
    assert all(r.status == RequestStatus.WAITING for r in sched.waiting)
    assert sched.running_lora_names() == ["alpha", "beta"]
    assert sched.waiting_lora_names() == ["gamma"]
    sched.update(out, [100] * len(out.scheduled))
    sched.check_integrity()
    # While alpha and beta run, gamma keeps waiting.
    for _ in range(2):
        step(sched)
        assert all(r.lora_name != "gamma" for r in sched.running)
    # Once they finish, gamma is admitted; everything completes within the limit.
    run_to_completion(sched)
    assert not sched.requests


def test_base_model_requests_are_never_limited_by_max_loras():
    sched = make_scheduler(num_blocks=40, budget=64, max_loras=1, max_model_len=40)
    sched.add_request(make_request("a", [5, 6, 7], lora=A))
    sched.add_request(make_request("b", [5, 6, 7], lora=B))
    for i in range(4):
        sched.add_request(make_request(f"base{i}", [5, 6, 7]))
    out = sched.schedule()
    assert [it.request.request_id for it in out.scheduled] == ["a", "base0", "base1", "base2", "base3"]
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_preempted_adapter_requests_resume_within_max_loras():
    # 6 blocks of 4: two adapters' requests grow until one is preempted.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=16, max_loras=1, max_model_len=24)
    for k, (rid, lora) in enumerate((("a1", A), ("a2", A), ("b1", B))):
        prompt = [10 * k + t for t in range(1, 8)]  # no shared prefix: each needs its own blocks
        sched.add_request(make_request(rid, prompt, max_tokens=12, lora=lora, ignore_eos=True))
    seen_preemption = False
    steps = 0
    while sched.has_unfinished_requests():
        out = step(sched)  # check_integrity: never two adapters running
        seen_preemption |= bool(out.preempted_ids)
        assert len({r.lora_int_id for r in sched.running}) <= 1
        steps += 1
        assert steps < 500
    assert seen_preemption, "the test must exercise preemption"


def test_check_integrity_catches_too_many_running_adapters():
    sched = make_scheduler(num_blocks=40, budget=64, max_loras=2, max_model_len=40)
    for rid, lora in (("a", A), ("b", B)):
        sched.add_request(make_request(rid, [5, 6, 7], lora=lora))
    step(sched)
    assert sched.running_lora_ids() == {1, 2}
    # The same running batch under a limit of one: the invariant is broken.
    sched.config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=40, max_loras=1)
    with pytest.raises(CacheIntegrityError, match=r"2 distinct LoRA adapters running .*max_loras is 1"):
        sched.check_integrity()
