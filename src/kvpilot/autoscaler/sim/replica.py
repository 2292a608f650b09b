"""One simulated engine replica, kept as aggregate state so no event is per token.

The replica runs engine steps (:class:`~kvpilot.autoscaler.sim.model.ReplicaModel`: one
step = base + per_seq x decode rows + prefill tokens / prefill rate). Between two events
the composition of a step is constant, so the replica keeps a *virtual clock* ``v``: the
number of steps since an arbitrary origin, which is also the number of tokens each
decoding request has generated since then. It runs at ``1 / step seconds`` and changes
rate only when the batch or the prefill backlog's share of a step changes. With it::

    request done    when v reaches v_start + remaining output  (a heap keyed by that value)
    KV tokens held  = prefilling needs + dec_const + n_dec * v (dec_const = sum(ctx - v_start))
    KV full         when that reaches capacity                 (solved in closed form)
    prefill done    when the cumulative prefill tokens p_done reach the prompt's p_target
                    (p_done grows by the step's chunk c per step, FCFS over the prompts)

so each state change costs O(log n) and the next event time is a closed-form minimum.

Latency histograms (what the engine exports and the policy reads) are filled from these
timings: every decoding request observes one inter-token latency of the current step's
duration per step (``n_dec x dv`` observations of ``step seconds`` per interval ``dv``,
fractional counts), and every request one TTFT when its first prefill ends. The bucket
bounds are the engine's (:data:`ITL_BUCKETS`, :data:`REQUEST_BUCKETS`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict, deque

from kvpilot.autoscaler.sim.model import ReplicaModel

_TIEBREAK = itertools.count()  # heap ties never compare requests
_EPS = 1e-6  # tokens; far above float error at the magnitudes reached, far below one token
SYSTEM = "system"  # the prefix cache's key of the shared system prompt's entry
Key = int | str  # a prefix cache entry: a session id, or SYSTEM

# The engine's histogram bounds (kvpilot.engine.server.metrics, copied: this package is
# standard-library only), seconds; the +Inf bucket is implicit (one more count slot).
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 3600.0)


class Histogram:
    """A cumulative Prometheus-style histogram: per-bucket (not cumulative) counts, the
    last slot +Inf, and the sum of observations (seconds). Counts are floats (an interval
    of steps observes fractional tokens)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * (len(bounds) + 1)
        self.total = 0.0

    def index(self, value: float) -> int:
        """The bucket a value falls in (``le`` semantics: a value equal to a bound is in it)."""
        return bisect.bisect_left(self.bounds, value)

    def observe(self, value: float, count: float = 1.0, index: int | None = None) -> None:
        self.counts[self.index(value) if index is None else index] += count
        self.total += value * count

    def snapshot(self) -> tuple[list[float], float]:
        return list(self.counts), self.total


class Req:
    """A request's lifetime bookkeeping (mutable, slotted for speed).

    ``generated`` counts tokens produced before the current decode stint; ``ctx`` is the
    context held when the stint began (prompt + generated); ``waited`` is the total time
    spent queued; ``starved`` the starvation seconds charged so far. ``session`` (-1: none)
    and ``shared`` (system-prompt tokens) let the replica's prefix cache find its cached
    prefix; ``cached`` is that hit, taken when its first prefill starts. ``p_target``: the
    replica's cumulative prefill count at which its prefill ends; ``first_token``: when its
    first token came (-1: not yet).
    """

    __slots__ = (
        "arrival",
        "cached",
        "ctx",
        "enqueued",
        "first",
        "first_token",
        "generated",
        "output",
        "p_target",
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
        self.p_target = 0.0
        self.first_token = -1.0

    @property
    def need(self) -> float:
        """KV tokens to admit it (prompt plus any output generated before a preemption)."""
        return self.prompt + self.generated


class Stats:
    """Run-wide counters the replicas add to.

    ``ttft`` and ``itl``: per counted finished request, its TTFT and its mean inter-token
    latency (seconds; ``itl`` is 0 for a one-token output); ``slo_met`` counts finished
    requests within both targets (``slo_ttft`` / ``slo_itl``).
    """

    __slots__ = (
        "admitted",
        "finished",
        "generated_tokens",
        "hit_tokens",
        "itl",
        "preemptions",
        "prompt_tokens",
        "slo",
        "slo_itl",
        "slo_met",
        "slo_ttft",
        "starvation",
        "ttft",
        "waits",
        "warmup",
    )

    def __init__(self, slo: float, warmup: float = 0.0, slo_ttft: float = math.inf,
                 slo_itl: float = math.inf) -> None:
        self.slo = slo
        self.warmup = warmup  # requests arriving earlier and events before it are not counted
        self.slo_ttft = slo_ttft
        self.slo_itl = slo_itl
        self.starvation = 0.0
        self.preemptions = 0
        self.finished = 0
        self.generated_tokens = 0.0
        self.waits: list[float] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.slo_met = 0
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

    def finish(self, req: Req, now: float) -> None:
        """A counted request finished at ``now``: its latencies and whether it met the SLO."""
        self.finished += 1
        self.generated_tokens += req.output
        self.waits.append(req.waited)
        ttft = req.first_token - req.arrival
        itl = (now - req.first_token) / (req.output - 1) if req.output > 1 else 0.0
        self.ttft.append(ttft)
        self.itl.append(itl)
        self.slo_met += ttft <= self.slo_ttft and itl <= self.slo_itl


class Replica:
    """State machine: starting -> ready -> (draining) -> gone."""

    __slots__ = (
        "budget",
        "c",
        "cache",
        "cap",
        "dec_const",
        "dec_heap",
        "epoch",
        "hit_tokens",
        "itl",
        "itl_index",
        "limit",
        "max_seqs",
        "model",
        "n_dec",
        "p_done",
        "p_tail",
        "preemptions",
        "prefill_kv",
        "prefills",
        "queried_tokens",
        "rate",
        "ready_at",
        "rid",
        "running",
        "scheduled",
        "state",
        "step_s",
        "step_tokens",
        "steps",
        "ttft",
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
        self.budget = model.max_num_batched_tokens
        self.state = "starting"
        self.ready_at = ready_at
        self.waiting: deque[Req] = deque()
        self.waiting_tokens = 0.0
        self.prefills: deque[Req] = deque()  # admitted, prefilling, FCFS (newest last)
        self.prefill_kv = 0.0  # KV the prefilling requests hold (their whole need)
        self.p_done = 0.0  # cumulative prefill tokens computed
        self.p_tail = 0.0  # cumulative prefill tokens admitted
        self.c = 0.0  # prefill tokens per step now
        self.dec_const = 0.0
        self.n_dec = 0
        self.v = 0.0
        self.v_time = 0.0
        self.step_s = model.step_seconds(0)
        self.rate = 1.0 / self.step_s
        self.dec_heap: list[tuple[float, int, int, Req]] = []  # (v_finish, tie, stint, req)
        self.running: dict[Req, None] = {}  # decoding, in admission order (newest last)
        self.preemptions = 0
        self.epoch = 0
        self.scheduled = math.inf
        self.cache: PrefixCache | None = None  # the router gives it one
        self.itl = Histogram(ITL_BUCKETS)
        self.itl_index = self.itl.index(self.step_s)
        self.ttft = Histogram(REQUEST_BUCKETS)
        self.steps = 0.0  # cumulative engine steps (only while busy)
        self.step_tokens = 0.0  # cumulative tokens scheduled in them
        # The engine's prefix_cache_queries_total / prefix_cache_hits_total: prompt tokens
        # looked up at first admissions, and those the prefix cache held.
        self.queried_tokens = 0.0
        self.hit_tokens = 0.0

    # -- observation ---------------------------------------------------------------------
    def kv_tokens(self, now: float) -> float:
        v = self.v + (now - self.v_time) * self.rate if self.n_dec else self.v
        return self.dec_const + self.n_dec * v + self.prefill_kv

    def kv_usage(self, now: float) -> float:
        # Clamped at both ends: the aggregate (dec_const + n x v) can round to -1e-16
        # when the last decoding request leaves.
        return min(1.0, max(0.0, self.kv_tokens(now) / self.cap))

    @property
    def prefilling(self) -> Req | None:
        """The oldest request still prefilling (None if none)."""
        return self.prefills[0] if self.prefills else None

    @property
    def num_running(self) -> int:
        return self.n_dec + len(self.prefills)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.prefills and not self.n_dec

    def observe(self, now: float) -> None:
        """Bring the histograms and step counters up to ``now`` (no state change)."""
        self._advance(now)

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
        dt = now - self.v_time
        if dt > 0 and (self.n_dec or self.prefills):
            dv = dt * self.rate
            self.v += dv
            self.p_done += self.c * dv
            self.steps += dv
            self.step_tokens += (self.n_dec + self.c) * dv
            if self.n_dec:
                self.itl.observe(self.step_s, self.n_dec * dv, self.itl_index)
        self.v_time = now

    def _set_rate(self) -> None:
        """The step's composition after a change: decode rows, then the prefill backlog's
        chunk in the budget they leave."""
        backlog = self.p_tail - self.p_done if self.prefills else 0.0
        self.c = max(0.0, min(backlog, float(self.budget - self.n_dec)))
        self.step_s = self.model.step_seconds(self.n_dec, self.c)
        self.rate = 1.0 / self.step_s
        self.itl_index = self.itl.index(self.step_s)

    def _set_batch(self, n_dec: int) -> None:
        self.n_dec = n_dec

    def step(self, now: float, stats: Stats) -> None:
        """Apply everything due at ``now``: finished decodes, finished prefills, preemption
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
            self._finished(req, now, stats)
        prefills = self.prefills
        while prefills and prefills[0].p_target <= self.p_done + _EPS:
            req = prefills.popleft()
            self.prefill_kv -= req.need
            if req.first_token < 0:
                req.first_token = now
                if req.arrival >= stats.warmup:
                    self.ttft.observe(now - req.arrival)
            req.generated += 1  # the last chunk's step yields a token
            if req.generated >= req.output:
                self._finished(req, now, stats)
                continue
            req.ctx = req.need
            req.v_start = self.v
            req.stint += 1
            self.dec_const += req.ctx - self.v
            self.running[req] = None
            self._set_batch(self.n_dec + 1)
            heapq.heappush(heap, (self.v + req.output - req.generated,
                                  next(_TIEBREAK), req.stint, req))
        if not prefills:
            self.p_done = self.p_tail = 0.0
            self.prefill_kv = 0.0  # no float drift across bursts
        while self.kv_tokens(now) >= self.cap - _EPS and (self.n_dec or self.prefills):
            self._preempt_newest(now, stats)
        self._admit(now, stats)
        self._set_rate()

    def _finished(self, req: Req, now: float, stats: Stats) -> None:
        if self.cache is not None and (req.session >= 0 or req.shared):
            self.cache.finished(req)
        if req.arrival >= stats.warmup:
            stats.finish(req, now)

    def _preempt_newest(self, now: float, stats: Stats) -> None:
        """Recompute-preemption of the newest running request (vLLM's policy)."""
        if self.prefills:  # admitted last, so the newest
            req = self.prefills.pop()
            self.prefill_kv -= req.need
            self.p_tail = max(self.p_done, self.prefills[-1].p_target) if self.prefills else 0.0
            if not self.prefills:
                self.p_done = 0.0
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
        """Admit waiting requests (FCFS) into prefill while the step has budget left over
        (the prefill backlog is under the budget the decode rows leave), fewer than
        ``max_num_seqs`` run, and the head request fits the KV."""
        while self.waiting and self.n_dec + len(self.prefills) < self.max_seqs:
            backlog = self.p_tail - self.p_done if self.prefills else 0.0
            if backlog >= self.budget - self.n_dec:
                return
            req = self.waiting[0]
            need = req.need
            if self.kv_tokens(now) + need > self.limit:
                return
            self.waiting.popleft()
            # Reset when empty: a running float sum drifts below zero (-4e-12 was seen),
            # which the policy refuses as input.
            self.waiting_tokens = self.waiting_tokens - need if self.waiting else 0.0
            if self.cache is not None and (req.session >= 0 or req.shared):
                # Every admission uses its prefix entries (released when it finishes or is
                # preempted); only the first takes a hit: a preempted request recomputes.
                hit = self.cache.start(req, self.cap - self.kv_tokens(now))
                if req.first:
                    req.cached = hit
            tokens = max(1.0, need - req.cached)
            if req.first:
                self.queried_tokens += req.prompt
                self.hit_tokens += req.cached
            if req.first and req.arrival >= stats.warmup:
                stats.prompt_tokens += req.prompt
                stats.hit_tokens += req.cached
                stats.admitted[self.rid] = stats.admitted.get(self.rid, 0) + 1
            stats.charge_wait(req, now, tokens / self.model.prefill_tokens_per_second)
            if not self.prefills:
                self.p_done = self.p_tail = 0.0
            self.p_tail += tokens
            req.p_target = self.p_tail
            self.prefills.append(req)
            self.prefill_kv += need

    def next_event(self, now: float) -> float:
        """When :meth:`step` next has work (``inf`` if never without outside input)."""
        t = math.inf
        heap = self.dec_heap
        while heap and (heap[0][2] != heap[0][3].stint or heap[0][3] not in self.running):
            heapq.heappop(heap)
        if not (self.n_dec or self.prefills):
            return t
        ahead = (now - self.v_time) * self.rate  # steps since the last advance
        if self.prefills and self.c > 0:
            p_now = self.p_done + self.c * ahead
            t = now + max(0.0, self.prefills[0].p_target - p_now) / self.c / self.rate
        if self.n_dec:
            v_now = self.v + ahead
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
