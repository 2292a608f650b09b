"""The simulator's routing: where each request lands, and the prefix-cache hit that follows
from the replica it lands on (kvpilot.autoscaler.sim.routing)."""

import dataclasses
import random

import pytest

from kvpilot.autoscaler.sim import ROUTINGS, ReplicaModel, SimConfig, make_trace, simulate
from kvpilot.autoscaler.sim.replica import PrefixCache, Replica, Req, Stats
from kvpilot.autoscaler.sim.routing import LoadIndex, Router

from .simkit import Fixed

MODEL = ReplicaModel()


def fixed_fleet(n, routing, trace, seed=0, **kw):
    config = SimConfig(duration_seconds=trace.duration_seconds, min_replicas=n, max_replicas=n,
                       warmup_seconds=120, routing=routing, seed=seed, **kw)
    return simulate(trace, Fixed(n), config=config)


@pytest.fixture(scope="module")
def agentic():
    """Agentic sessions sized for about 1.5 replicas at the target usage."""
    return make_trace("agentic", peak_replicas=1.5, duration_seconds=900, seed=4)


def without_wall(result):
    return dataclasses.replace(result, wall_seconds=0.0)


# ---------------------------------------------------------------- the fleet, per routing
def test_one_replica_every_routing_gives_the_same_hits(agentic):
    runs = {routing: fixed_fleet(1, routing, agentic) for routing in ROUTINGS}
    rates = {routing: r.prefix_hit_rate for routing, r in runs.items()}
    assert len(set(rates.values())) == 1, rates
    assert 0.3 < rates["kv_aware"] < 1.0
    first = runs["kv_aware"]
    for r in runs.values():
        assert dataclasses.replace(without_wall(r), routing="x") == dataclasses.replace(
            without_wall(first), routing="x")
    assert list(first.requests_per_replica) == ["r0"] and first.max_replica_share == 1.0


def test_three_replicas_random_below_kv_aware_at_most_session_affine(agentic):
    runs = {routing: fixed_fleet(3, routing, agentic) for routing in
            ("random", "kv_aware", "session_affine")}
    rate = {routing: r.prefix_hit_rate for routing, r in runs.items()}
    # A random replica holds a session's context one time in three; kv_aware follows it.
    assert rate["random"] + 0.1 < rate["kv_aware"] <= rate["session_affine"], rate
    # The system prompt is on every replica: random still hits that much.
    assert rate["random"] > 0.15
    for r in runs.values():
        assert r.prompt_tokens > 0 and r.hit_tokens == pytest.approx(
            r.prefix_hit_rate * r.prompt_tokens)
    # Fewer hits, more prefill: random routing waits longer for first tokens on the same
    # fleet (prefill shares the steps, so it shows in TTFT before any queue forms).
    assert runs["random"].ttft_p90_seconds > runs["kv_aware"].ttft_p90_seconds


def test_kv_aware_spreads_sessions_over_the_replicas(agentic):
    r = fixed_fleet(3, "kv_aware", agentic)
    shares = [n / sum(r.requests_per_replica.values()) for n in r.requests_per_replica.values()]
    assert len(shares) == 3 and max(shares) == r.max_replica_share < 0.5
    assert min(shares) > 0.2


def test_routing_is_deterministic_for_a_seed(agentic):
    for routing in ROUTINGS:
        a = fixed_fleet(3, routing, agentic, seed=5)
        b = fixed_fleet(3, routing, agentic, seed=5)
        assert without_wall(a) == without_wall(b), routing
    # The seed only matters where the routing draws at random.
    assert fixed_fleet(3, "random", agentic, seed=6).requests_per_replica != \
        fixed_fleet(3, "random", agentic, seed=5).requests_per_replica


def test_a_smaller_kv_pool_evicts_idle_sessions_and_loses_hits(agentic):
    big = fixed_fleet(3, "session_affine", agentic)
    small = simulate(agentic, Fixed(3), dataclasses.replace(MODEL, kv_capacity_tokens=120_000),
                     SimConfig(duration_seconds=900, min_replicas=3, max_replicas=3,
                               warmup_seconds=120, routing="session_affine"))
    assert small.prefix_hit_rate < big.prefix_hit_rate - 0.05


def test_one_off_requests_get_no_hits_whatever_the_routing():
    trace = make_trace("burst", peak_replicas=2, duration_seconds=600, seed=1)
    for routing in ROUTINGS:
        r = fixed_fleet(3, routing, trace)
        assert r.prefix_hit_rate == 0.0 and r.hit_tokens == 0 and r.prompt_tokens > 0


def test_bad_routing_settings_are_refused():
    with pytest.raises(ValueError, match="routing must be one of kv_aware, session_affine,"
                                         " random, p2c_kv; got 'sticky'"):
        SimConfig(routing="sticky")
    with pytest.raises(ValueError, match="cache_block_tokens must be an int >= 1; got 0"):
        SimConfig(cache_block_tokens=0)
    with pytest.raises(ValueError, match="load_penalty_tokens must be finite and >= 0"):
        SimConfig(load_penalty_tokens=float("nan"))
    with pytest.raises(ValueError, match="balance_abs_threshold must be an int >= 0"):
        SimConfig(balance_abs_threshold=-1)
    with pytest.raises(ValueError, match="balance_rel_threshold must be finite and >= 1"):
        SimConfig(balance_rel_threshold=0.5)


# ---------------------------------------------------------------- the pieces
def replica(rid, cap=10_000):
    return Replica(rid, dataclasses.replace(MODEL, kv_capacity_tokens=cap), 0.0)


def test_prefix_cache_hits_whole_blocks_of_the_session_or_the_system_prompt():
    holders = {}
    r = replica(0)
    cache = PrefixCache(r, holders, block_tokens=16)
    first = Req(0.0, prompt=1100, output=100, session=7, shared=1000)
    assert cache.start(first, free_tokens=10_000) == 0  # nothing cached yet
    assert holders == {7: {r: None}}
    # Another session shares only the system prompt: 1000 tokens -> 992 in whole blocks.
    assert cache.hit(Req(0.0, 1500, 10, session=8, shared=1000)) == 992
    # The next turn of session 7 before the first finished: its prompt is cached.
    cache.finished(first)  # now its output too: 1200 tokens
    second = Req(5.0, prompt=1300, output=50, session=7, shared=1000)
    assert cache.hit(second) == 1200
    # Never the whole prompt: vLLM recomputes at least the last token.
    assert cache.hit(Req(6.0, prompt=1200, output=5, session=7, shared=1000)) == 1184


def test_prefix_cache_evicts_idle_entries_lru_never_those_in_use():
    holders = {}
    cache = PrefixCache(replica(0), holders, block_tokens=1)
    reqs = [Req(0.0, 1000, 100, session=s) for s in range(3)]
    for req in reqs:
        cache.start(req, free_tokens=100_000)
    cache.finished(reqs[0])  # sessions 0 and 1 idle (1100 tokens each); 2 in use
    cache.finished(reqs[1])
    assert cache.idle == 2200
    cache.evict(free_tokens=1500)  # the least recently used idle entry goes: session 0
    assert list(cache.entries) == [1, 2] and 0 not in holders and cache.idle == 1100
    cache.evict(free_tokens=0)  # every idle one goes; the one in use stays
    assert list(cache.entries) == [2] and cache.idle == 0
    assert cache.hit(Req(1.0, 3000, 10, session=2)) == 1000
    # Preempted: its blocks are freed, its prompt stays cached until evicted.
    cache.preempted(reqs[2])
    assert cache.idle == 1000
    # A prefill that needs room evicts idle entries for its new blocks, not its own.
    cache.start(Req(2.0, 400, 10, session=5), free_tokens=1300)
    assert list(cache.entries) == [5] and cache.idle == 0


def test_load_index_finds_the_replica_with_the_fewest_requests_in_flight():
    a, b = replica(0), replica(1)
    index = LoadIndex()
    index.add(a)
    index.add(b)
    assert index.least() is a  # a tie: the first to enter the bucket
    a.enqueue(Req(0.0, 100, 10))
    index.update(a)
    assert index.least() is b
    for _ in range(2):
        b.enqueue(Req(0.0, 100, 10))
    index.update(b)
    assert index.least() is a and index.count == {a: 1, b: 2}
    index.remove(a)
    assert index.least() is b
    index.remove(b)
    assert index.least() is None


def routed(routing, penalty=0.0):
    ready = [replica(0, cap=100_000), replica(1, cap=100_000)]
    router = Router(routing, ready, random.Random(0), 16, penalty)
    for r in ready:
        r.cache = router.new_cache(r)
        r.state = "ready"
        router.add(r)
    return router, ready


def send(router, req, now=0.0):
    """Route ``req`` and start its prefill at once (the replica is idle)."""
    r = router.pick(req, now)
    r.enqueue(req)
    r.step(now, Stats(slo=2.0))
    router.changed(r)
    return r


def test_kv_aware_follows_the_prefix_until_the_load_outweighs_it():
    router, (a, b) = routed("kv_aware", penalty=1000.0)
    first = Req(0.0, 4000, 10, session=1)
    home = send(router, first)
    assert home is a  # no hit anywhere: the least loaded (a tie, the first)
    for t in (500.0, 1000.0):  # prefill, then decode: finished, its context stays cached
        home.step(t, Stats(slo=2.0))
    assert home.idle and list(home.cache.entries) == [1]
    router.changed(home)
    # The next turn: 4010 cached tokens (4000 in whole blocks) at home beat an idle peer
    # while home has fewer than 4 more requests in flight than it.
    for _ in range(3):
        home.enqueue(Req(0.0, 100, 10))
    router.changed(home)
    nxt = Req(1.0, 4500, 10, session=1)
    assert router.pick(nxt, 1.0) is a
    home.enqueue(Req(0.0, 100, 10))
    home.enqueue(Req(0.0, 100, 10))
    router.changed(home)
    assert router.pick(nxt, 1.0) is b  # 5 x 1000 tokens of load > 4000 cached


def test_kv_aware_follows_the_longest_prefix_until_the_fleet_is_imbalanced():
    """The router's own rule (no penalty): the longest cached prefix wins whatever the
    load, until the most loaded replica runs more than 64 requests and 1.5x the least."""
    router, (a, b) = routed("kv_aware")
    first = Req(0.0, 4000, 10, session=1)
    assert send(router, first) is a
    for t in (500.0, 1000.0):
        a.step(t, Stats(slo=2.0))
    nxt = Req(1000.0, 4500, 10, session=1)
    for _ in range(64):  # 64 more in flight on a than on b: not imbalanced yet
        a.enqueue(Req(1000.0, 100, 10))
    router.changed(a)
    assert router.pick(nxt, 1000.0) is a
    def load(r, n):
        while len(r.waiting) < n:
            r.enqueue(Req(1000.0, 100, 10))
        router.changed(r)

    load(a, 65)  # 65 - 0 > 64 and 65 > 1.5 x 0: imbalanced, the least loaded
    assert router.pick(nxt, 1000.0) is b
    load(a, 200)
    load(b, 100)  # 100 apart, 200 > 150: still imbalanced
    assert router.pick(nxt, 1000.0) is b
    load(b, 134)  # 66 apart, but 200 <= 1.5 x 134: balanced, the prefix wins again
    assert router.pick(nxt, 1000.0) is a


def test_session_affine_sticks_whatever_the_load_and_random_ignores_sessions():
    router, _ = routed("session_affine")
    home = send(router, Req(0.0, 2000, 10, session=3))
    for _ in range(20):
        home.enqueue(Req(0.0, 100, 10))
    router.changed(home)
    assert router.pick(Req(1.0, 2500, 10, session=3), 1.0) is home
    assert router.pick(Req(1.0, 2500, 10, session=4), 1.0) is not home  # new: least loaded
    home.state = "draining"
    router.remove(home)
    router.ready = [r for r in router.ready if r is not home]
    assert router.pick(Req(2.0, 3000, 10, session=3), 2.0) is not home  # re-homed
    rnd, _ = routed("random")
    picks = {rnd.pick(Req(0.0, 100, 10, session=9), 0.0).rid for _ in range(50)}
    assert picks == {0, 1}


def test_the_hit_is_taken_when_the_prefill_starts_and_counted_once():
    _, (a, _) = routed("session_affine")
    stats = Stats(slo=2.0)
    first = Req(0.0, 2000, 10, session=1, shared=1000)
    a.enqueue(first)
    for t in (0.0, 500.0, 1000.0):  # admitted, prefilled, finished: 2010 tokens cached
        a.step(t, stats)
    assert a.idle
    nxt = Req(1000.0, 2500, 10, session=1, shared=1000)
    a.enqueue(nxt)
    a.step(1000.0, stats)
    assert nxt.cached == 2000  # 2010 in whole 16-token blocks
    assert (stats.prompt_tokens, stats.hit_tokens, stats.admitted) == (4500, 2000, {0: 2})
