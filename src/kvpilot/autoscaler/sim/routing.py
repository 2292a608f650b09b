"""Where each request lands, and what its replica's prefix cache already holds for it.

A request's ``cached`` tokens (its prefix-cache hit, skipped by prefill) come from the
:class:`PrefixCache` of the replica it was routed to, never from the trace: the same
agentic session gets hits only where its earlier turns ran and were not evicted. The
router scores replicas on their caches when the request arrives; the hit itself is taken
when its prefill starts (as vLLM looks the prefix up when it schedules the request), so an
entry evicted while the request queued is recomputed.

Routing policies (``SimConfig.routing``):

- ``kv_aware`` (the default; what the operator deploys: vllm-router 0.1.17,
  ``--policy kv_aware``). Per request, with each replica's load = its requests in flight
  (waiting or running, what the router counts per worker):

  1. if the fleet is imbalanced, ``most - least > balance_abs_threshold`` and
     ``most > balance_rel_threshold x least`` (64 and 1.5), the least-loaded replica;
  2. otherwise the replica with the most ``cached prefix tokens - load_penalty_tokens x
     load`` (penalty 0 by default: the longest cached prefix), the least loaded on a tie;
     with no prefix cached anywhere, that is the least-loaded replica.

  Sources, vllm-project/router: ``src/policies/kv_aware.rs`` scores each worker by the
  longest contiguous run of the prompt's blocks its KV cache holds
  (``src/kv_index/scorer.rs``), takes the best, and falls back to the least-loaded worker
  when no worker holds any; ``src/policies/cache_aware.rs`` switches to the least-loaded
  worker when the load is imbalanced by exactly that test (``--balance-abs-threshold``
  64, ``--balance-rel-threshold`` 1.5: the 0.1.17 defaults). The 0.1.17 wheel ships no
  source; its binary names ``prefix_hit``, ``prefix_miss`` and ``load_imbalance`` among
  its prefix-routing decision outcomes (next to ``vllm_router_prefix_routing_decisions``,
  which we saw count ``kv_aware`` decisions), so the same load test is assumed. 0.1.17
  also weighs a per-worker cost under a softmax temperature (``--router-temperature``,
  0 = the minimum-cost worker, the default) whose terms are not published;
  ``load_penalty_tokens`` is a simple linear stand-in for such a trade, off by default.
  Hits count whole blocks (``block_tokens``, vLLM's and the router's 16).
- ``session_affine``: the ideal ceiling. A session's first request goes to the
  least-loaded replica, every later one to the same replica (re-homed only when it
  leaves), whatever its load.
- ``random``: uniform over the ready replicas, what a plain ClusterIP Service does
  (kube-proxy picks an endpoint at random per connection).
- ``p2c_kv``: power of two choices on KV held plus queued prompt tokens (Envoy's
  least-request, an inference gateway); the simulator's routing before this module, kept
  so earlier figures can be reproduced.

The prefix cache (per replica, :class:`~kvpilot.autoscaler.sim.replica.PrefixCache`)
holds one entry per session (the longest prefix of that conversation computed there: the
prompt once its prefill starts, prompt + output once it finishes) and one for the system
prompt every session shares. Entries of running requests are in use (their blocks are
the requests' own KV); idle ones live in the free part of the KV pool (capacity - KV
held now) and are evicted least recently used first when it shrinks, as vLLM's
free-block queue does. Eviction is applied lazily, whenever a replica's cache is looked
up (by the router, or when a prefill starts and needs blocks). Not modelled: the
router's speculative entries (vllm-router inserts a routed prompt's blocks for 2 s,
which matters only for requests of one session arriving together).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from kvpilot.autoscaler.sim.model import ROUTINGS
from kvpilot.autoscaler.sim.replica import PrefixCache, Replica, Req


class LoadIndex:
    """Ready replicas bucketed by requests in flight (waiting + running): the load a
    router counts per worker (vllm-router's ``Worker::load()``). :meth:`least` and
    :meth:`most` are O(1) amortized, so routing stays cheap at 1,000 replicas. Within a
    bucket, the replica that entered it first comes first."""

    __slots__ = ("buckets", "count", "high", "low")

    def __init__(self) -> None:
        self.count: dict[Replica, int] = {}
        self.buckets: dict[int, dict[Replica, None]] = {}
        self.low = 0
        self.high = 0

    @staticmethod
    def load(r: Replica) -> int:
        return len(r.waiting) + r.num_running

    def _put(self, r: Replica, n: int) -> None:
        self.count[r] = n
        self.buckets.setdefault(n, {})[r] = None
        self.low = min(self.low, n)
        self.high = max(self.high, n)

    def _take(self, r: Replica) -> None:
        n = self.count.pop(r)
        bucket = self.buckets[n]
        del bucket[r]
        if not bucket:
            del self.buckets[n]

    def add(self, r: Replica) -> None:
        self._put(r, self.load(r))

    def remove(self, r: Replica) -> None:
        if r in self.count:
            self._take(r)

    def update(self, r: Replica) -> None:
        n = self.load(r)
        old = self.count.get(r)
        if old is None or old == n:
            return
        self._take(r)
        self._put(r, n)

    def least(self) -> Replica | None:
        if not self.count:
            return None
        while self.low not in self.buckets:
            self.low += 1
        return next(iter(self.buckets[self.low]))

    def most(self) -> int:
        """The highest load (0 with no replica)."""
        if not self.count:
            return 0
        while self.high not in self.buckets:
            self.high -= 1
        return self.high


class Router:
    """Picks a ready replica for each request and fills in its prefix-cache hit.

    Args:
        routing: one of :data:`ROUTINGS`.
        ready: the fleet's list of ready replicas (read, never changed here).
        rng: the run's seeded generator (``random`` and ``p2c_kv`` draw from it).
        block_tokens: KV block size; hits count whole blocks.
        load_penalty_tokens: ``kv_aware``: cached tokens one request in flight
            outweighs (0: none, the router's own rule).
        balance_abs_threshold / balance_rel_threshold: ``kv_aware``: the fleet is
            imbalanced, and requests go to the least-loaded replica whatever it caches,
            when the most and least requests in flight differ by more than ``abs`` and the
            most exceed ``rel`` x the least (vllm-router's defaults: 64, 1.5).
    """

    def __init__(self, routing: str, ready: Sequence[Replica], rng: random.Random,
                 block_tokens: int = 16, load_penalty_tokens: float = 0.0,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}; got {routing!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) \
                or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1; got {block_tokens!r}")
        if not (math.isfinite(load_penalty_tokens) and load_penalty_tokens >= 0):
            raise ValueError(
                f"load_penalty_tokens must be finite and >= 0; got {load_penalty_tokens!r}")
        if isinstance(balance_abs_threshold, bool) or not isinstance(balance_abs_threshold, int) \
                or balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be an int >= 0; got {balance_abs_threshold!r}")
        if not (math.isfinite(balance_rel_threshold) and balance_rel_threshold >= 1):
            raise ValueError(
                f"balance_rel_threshold must be finite and >= 1; got {balance_rel_threshold!r}")
        self.routing = routing
        self.ready = ready
        self.rng = rng
        self.block = block_tokens
        self.penalty = float(load_penalty_tokens)
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.loads = LoadIndex()
        self.holders: dict[int, dict[Replica, None]] = {}
        self.home: dict[int, Replica] = {}

    # -- the fleet tells the router what changed ------------------------------------------
    def new_cache(self, r: Replica) -> PrefixCache:
        return PrefixCache(r, self.holders, self.block)

    def add(self, r: Replica) -> None:
        """``r`` became ready."""
        self.loads.add(r)

    def remove(self, r: Replica) -> None:
        """``r`` left the ready set (draining or gone)."""
        self.loads.remove(r)

    def changed(self, r: Replica) -> None:
        """``r``'s queue or running set may have changed."""
        self.loads.update(r)

    # -- routing ----------------------------------------------------------------------------
    def _lookup(self, r: Replica, req: Req, now: float) -> int:
        cache = r.cache
        if cache is None:
            return 0
        cache.evict(r.cap - r.kv_tokens(now))
        return cache.hit(req)

    def pick(self, req: Req, now: float) -> Replica:
        """The replica for ``req`` (at least one must be ready)."""
        ready = self.ready
        if len(ready) == 1:
            return ready[0]
        routing = self.routing
        if routing == "random":
            return ready[self.rng.randrange(len(ready))]
        if routing == "p2c_kv":
            a = ready[self.rng.randrange(len(ready))]
            b = ready[self.rng.randrange(len(ready))]
            return (a if a.kv_tokens(now) + a.waiting_tokens <= b.kv_tokens(now) + b.waiting_tokens
                    else b)
        least = self.loads.least()
        if least is None:  # not reached: every ready replica is indexed
            return ready[0]
        if routing == "session_affine":
            if req.session < 0:
                return least
            home = self.home.get(req.session)
            if home is None or home.state != "ready":
                self.home[req.session] = home = least
            return home
        # kv_aware. Imbalanced (max - min > abs and max > rel x min requests in flight):
        # the least-loaded replica. Otherwise the replica with the best
        # cached tokens - penalty x requests in flight, the least loaded on a tie; a
        # replica without this session's prefix holds at most the system prompt, as the
        # least-loaded one does (every replica caches it), so only the session's holders
        # and the least-loaded replica need scoring.
        count = self.loads.count
        best_load = count[least]
        most = self.loads.most()
        if most - best_load > self.abs_threshold and most > self.rel_threshold * best_load:
            return least
        best = least
        best_score = self._lookup(least, req, now) - self.penalty * best_load
        held = self.holders.get(req.session) if req.session >= 0 else None
        if held:
            for r in tuple(held):
                load = count.get(r)
                if load is None or r is least:
                    continue  # not ready (draining or gone), or already scored
                score = self._lookup(r, req, now) - self.penalty * load
                if score > best_score or (score == best_score and load < best_load):
                    best, best_load, best_score = r, load, score
        return best
