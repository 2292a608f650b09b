"""One simulated engine replica, kept as aggregate state so no event is per token.

Decoding requests all advance together, so the replica keeps a *virtual clock* ``v``: the
number of tokens each decoding request has generated since an arbitrary origin. It runs at
``decode_rate(n_dec)`` tokens/s and changes rate only when the batch changes. With it::

    request done   when v reaches v_start + remaining output  (a heap keyed by that value)
    KV tokens held  = prefill_tokens + dec_const + n_dec * v   (dec_const = sum(ctx - v_start))
    KV full        when that reaches capacity                 (solved in closed form)

so each state change costs O(log n) and the next event time is a closed-form minimum.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque

from kvpilot.autoscaler.sim.model import ReplicaModel

_TIEBREAK = itertools.count()  # heap ties never compare requests
_EPS = 1e-6  # tokens; far above float error at the magnitudes reached, far below one token
SYSTEM = "system"  # the prefix cache's key of the shared system prompt's entry
Key = int | str  # a prefix cache entry: a session id, or SYSTEM


class Req:
    """A request's lifetime bookkeeping (mutable, slotted for speed).

    ``generated`` counts tokens produced before the current decode stint; ``ctx`` is the
    context held when the stint began (prompt + generated); ``waited`` is the total time
    spent queued; ``starved`` the starvation seconds charged so far. ``session`` (-1: none)
    and ``shared`` (system-prompt tokens) let the replica's prefix cache find its cached
    prefix; ``cached`` is that hit, taken when its first prefill starts.
    """

    __slots__ = (
        "arrival",
        "cached",
        "ctx",
        "enqueued",
        "first",
        "generated",
        "output",
        "preempts",
        "prompt",
        "session",
        "shared",
        "starved",
        "stint",
        "v_start",
        "waited",
    )

    def __init__(self, arrival: float, prompt: int, output: int, cached: int = 0,
                 session: int = -1, shared: int = 0) -> None:
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.cached = cached  # prefix-cache hit at first admission; 0 after a preemption
        self.session = session
        self.shared = shared
        self.generated = 0.0
        self.enqueued = arrival
        self.waited = 0.0
        self.starved = 0.0
        self.first = True
        self.ctx = 0.0
        self.v_start = 0.0
        self.stint = 0
        self.preempts = 0

    @property
    def need(self) -> float:
        """KV tokens to admit it (prompt plus any output generated before a preemption)."""
        return self.prompt + self.generated


class Stats:
    """Run-wide counters the replicas add to."""

    __slots__ = (
        "admitted",
        "finished",
        "generated_tokens",
        "hit_tokens",
        "preemptions",
        "prompt_tokens",
        "slo",
        "starvation",
        "waits",
        "warmup",
    )

    def __init__(self, slo: float, warmup: float = 0.0) -> None:
        self.slo = slo
        self.warmup = warmup  # requests arriving earlier and events before it are not counted
        self.starvation = 0.0
        self.preemptions = 0
        self.finished = 0
        self.generated_tokens = 0.0
        self.waits: list[float] = []
        # At each counted request's first admission: its prompt, its prefix-cache hit,
        # and which replica (rid) took it.
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.admitted: dict[int, int] = {}

    def charge_wait(self, req: Req, now: float, recompute_seconds: float) -> None:
        """Close a waiting stint: the first stint is starvation beyond the SLO; a stint
        after a preemption is lost time in full, plus the recompute it forces."""
        stint = now - req.enqueued
        req.waited += stint
        if req.first:
            lost = max(0.0, stint - self.slo)
            req.first = False
        else:
            lost = stint + recompute_seconds
        req.starved += lost
        if req.arrival >= self.warmup:
            self.starvation += lost


class Replica:
    """State machine: starting -> ready -> (draining) -> gone."""

    __slots__ = (
        "cache",
        "cap",
        "dec_const",
        "dec_heap",
        "epoch",
        "limit",
        "max_seqs",
        "model",
        "n_dec",
        "preemptions",
        "prefill_end",
        "prefilling",
        "rate",
        "ready_at",
        "rid",
        "running",
        "scheduled",
        "state",
        "v",
        "v_time",
        "waiting",
        "waiting_tokens",
    )

    def __init__(self, rid: int, model: ReplicaModel, ready_at: float) -> None:
        self.rid = rid
        self.model = model
        self.cap = float(model.kv_capacity_tokens)
        self.limit = model.admit_limit_tokens
        self.max_seqs = model.max_num_seqs
        self.state = "starting"
        self.ready_at = ready_at
        self.waiting: deque[Req] = deque()
        self.waiting_tokens = 0.0
        self.prefilling: Req | None = None
        self.prefill_end = math.inf
        self.dec_const = 0.0
        self.n_dec = 0
        self.v = 0.0
        self.v_time = 0.0
        self.rate = model.decode_rate(0)
        self.dec_heap: list[tuple[float, int, int, Req]] = []  # (v_finish, tie, stint, req)
        self.running: dict[Req, None] = {}  # decoding, in admission order (newest last)
        self.preemptions = 0
        self.epoch = 0
        self.scheduled = math.inf
        self.cache: PrefixCache | None = None  # the router gives it one

    # -- observation ---------------------------------------------------------------------
    def kv_tokens(self, now: float) -> float:
        v = self.v + (now - self.v_time) * self.rate if self.n_dec else self.v
        held = self.dec_const + self.n_dec * v
        if self.prefilling is not None:
            held += self.prefilling.need
        return held

    def kv_usage(self, now: float) -> float:
        # Clamped at both ends: the aggregate (dec_const + n x v) can round to -1e-16
        # when the last decoding request leaves.
        return min(1.0, max(0.0, self.kv_tokens(now) / self.cap))

    @property
    def num_running(self) -> int:
        return self.n_dec + (self.prefilling is not None)

    @property
    def idle(self) -> bool:
        return not self.waiting and self.prefilling is None and not self.n_dec

    # -- transitions -----------------------------------------------------------------------
    def enqueue(self, req: Req, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)
        self.waiting_tokens += req.need

    def take_waiting(self) -> list[Req]:
        """Remove and return every waiting request (for re-routing when draining)."""
        out = list(self.waiting)
        self.waiting.clear()
        self.waiting_tokens = 0.0
        return out

    def _advance(self, now: float) -> None:
        if self.n_dec:
            self.v += (now - self.v_time) * self.rate
        self.v_time = now

    def _set_batch(self, n_dec: int) -> None:
        self.n_dec = n_dec
        self.rate = self.model.decode_rate(n_dec)

    def step(self, now: float, stats: Stats) -> None:
        """Apply everything due at ``now``: finished decodes, a finished prefill, preemption
        while the KV is full, then admission."""
        self._advance(now)
        heap = self.dec_heap
        while heap and heap[0][0] <= self.v + _EPS:
            _, _, stint, req = heapq.heappop(heap)
            if stint != req.stint or req not in self.running:
                continue  # stale: preempted since
            del self.running[req]
            self.dec_const -= req.ctx - req.v_start
            self._set_batch(self.n_dec - 1)
            if self.cache is not None and (req.session >= 0 or req.shared):
                self.cache.finished(req)
            if req.arrival >= stats.warmup:
                stats.finished += 1
                stats.generated_tokens += req.output
                stats.waits.append(req.waited)
        prefilled = self.prefilling
        if prefilled is not None and self.prefill_end <= now + 1e-9:
            self.prefilling = None
            self.prefill_end = math.inf
            prefilled.ctx = prefilled.need
            prefilled.v_start = self.v
            prefilled.stint += 1
            self.dec_const += prefilled.ctx - self.v
            self.running[prefilled] = None
            self._set_batch(self.n_dec + 1)
            heapq.heappush(heap, (self.v + prefilled.output - prefilled.generated,
                                  next(_TIEBREAK), prefilled.stint, prefilled))
        while self.kv_tokens(now) >= self.cap - _EPS and (self.n_dec or self.prefilling):
            self._preempt_newest(now, stats)
        self._admit(now, stats)

    def _preempt_newest(self, now: float, stats: Stats) -> None:
        """Recompute-preemption of the newest running request (vLLM's policy)."""
        req = self.prefilling
        if req is not None:  # admitted last, so it is the newest
            self.prefilling = None
            self.prefill_end = math.inf
        else:
            req = next(reversed(self.running))
            del self.running[req]
            req.generated += self.v - req.v_start
            self.dec_const -= req.ctx - req.v_start
            self._set_batch(self.n_dec - 1)
        if self.cache is not None and (req.session >= 0 or req.shared):
            self.cache.preempted(req)
        req.preempts += 1
        req.cached = 0  # recompute-preemption: assume its blocks were reused meanwhile
        req.enqueued = now
        self.preemptions += 1
        if now >= stats.warmup:
            stats.preemptions += 1
        self.enqueue(req, front=True)

    def _admit(self, now: float, stats: Stats) -> None:
        """Start the next prefill if the slot is free and the head request fits (FCFS)."""
        if self.prefilling is not None or not self.waiting or self.n_dec + 1 > self.max_seqs:
            return
        req = self.waiting[0]
        need = req.need
        if self.kv_tokens(now) + need > self.limit:
            return
        self.waiting.popleft()
        # Reset when empty: a running float sum drifts below zero (-4e-12 was seen), which
        # the policy refuses as input.
        self.waiting_tokens = self.waiting_tokens - need if self.waiting else 0.0
        if self.cache is not None and (req.session >= 0 or req.shared):
            # Every admission uses its prefix entries (released when it finishes or is
            # preempted); only the first takes a hit: a preempted request recomputes.
            hit = self.cache.start(req, self.cap - self.kv_tokens(now))
            if req.first:
                req.cached = hit
        prefill_seconds = (need - req.cached) / self.model.prefill_tokens_per_second
        if req.first and req.arrival >= stats.warmup:
            stats.prompt_tokens += req.prompt
            stats.hit_tokens += req.cached
            stats.admitted[self.rid] = stats.admitted.get(self.rid, 0) + 1
        stats.charge_wait(req, now, prefill_seconds)
        self.prefilling = req
        self.prefill_end = now + prefill_seconds

    def next_event(self, now: float) -> float:
        """When :meth:`step` next has work (``inf`` if never without outside input)."""
        t = self.prefill_end
        heap = self.dec_heap
        while heap and (heap[0][2] != heap[0][3].stint or heap[0][3] not in self.running):
            heapq.heappop(heap)
        if self.n_dec:
            v_now = self.v + (now - self.v_time) * self.rate
            if heap:
                t = min(t, now + max(0.0, heap[0][0] - v_now) / self.rate)
            free = self.cap - self.kv_tokens(now)
            t = min(t, now + max(0.0, free) / (self.n_dec * self.rate))
        return t


class PrefixCache:
    """One replica's prefix cache: LRU entries ``key -> [tokens, requests running]``.

    ``holders`` (shared by the fleet) maps a session to the replicas holding an entry for
    it, so a router finds them without asking every replica (a dict used as an ordered
    set: iteration follows insertion, never object addresses, so runs are reproducible).
    """

    __slots__ = ("block", "entries", "holders", "idle", "replica")

    def __init__(self, replica: Replica, holders: dict[int, dict[Replica, None]],
                 block_tokens: int) -> None:
        self.replica = replica
        self.holders = holders
        self.block = block_tokens
        self.entries: OrderedDict[Key, list[float]] = OrderedDict()
        self.idle = 0.0  # tokens of entries no running request uses

    def evict(self, free_tokens: float) -> None:
        """Drop idle entries, least recently used first, until they fit in
        ``free_tokens`` (the KV pool's free part)."""
        if self.idle <= free_tokens:
            return
        victims: list[Key] = []
        dropped = 0.0
        for key, (size, active) in self.entries.items():
            if active:
                continue
            victims.append(key)
            dropped += size
            if self.idle - dropped <= free_tokens:
                break
        for key in victims:
            del self.entries[key]
            if isinstance(key, int):
                held = self.holders.get(key)
                if held is not None:
                    held.pop(self.replica, None)
                    if not held:
                        del self.holders[key]
        self.idle = max(0.0, self.idle - dropped)

    def hit(self, req: Req) -> int:
        """Prompt tokens of ``req`` this cache holds (whole blocks, never the last
        token: vLLM recomputes at least one)."""
        tokens = 0.0
        if req.session >= 0:
            entry = self.entries.get(req.session)
            if entry is not None:
                tokens = entry[0]
        if req.shared > tokens and SYSTEM in self.entries:
            tokens = req.shared
        tokens = min(tokens, req.prompt - 1)
        return max(0, int(tokens) // self.block * self.block)

    def _use(self, key: Key, size: float) -> None:
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = [size, 1]
            if isinstance(key, int):
                self.holders.setdefault(key, {})[self.replica] = None
            return
        if entry[1] == 0:
            self.idle -= entry[0]
        entry[0] = max(entry[0], size)
        entry[1] += 1
        self.entries.move_to_end(key)

    def start(self, req: Req, free_tokens: float) -> int:
        """``req``'s prefill starts here with ``free_tokens`` of the pool free: its hit;
        then its prefix entries are in use (the prompt's blocks are computed now) and the
        idle ones make room for the blocks it adds."""
        self.evict(free_tokens)
        tokens = self.hit(req)
        if req.shared:
            self._use(SYSTEM, req.shared)
        if req.session >= 0:
            self._use(req.session, req.prompt)
        self.evict(free_tokens - (req.need - tokens))
        return tokens

    def _release(self, key: Key, size: float) -> None:
        entry = self.entries.get(key)
        if entry is None or entry[1] == 0:
            return
        entry[0] = max(entry[0], size)
        entry[1] -= 1
        if entry[1] == 0:
            self.idle += entry[0]

    def finished(self, req: Req) -> None:
        """``req`` finished here: its whole context (prompt + output) stays cached."""
        if req.shared:
            self._release(SYSTEM, req.shared)
        if req.session >= 0:
            self._release(req.session, req.prompt + req.output)

    def preempted(self, req: Req) -> None:
        """``req`` was preempted here: its blocks are freed (its prompt stays cached until
        evicted)."""
        if req.shared:
            self._release(SYSTEM, req.shared)
        if req.session >= 0:
            self._release(req.session, req.prompt)
