"""The event loop: a trace, a fleet of replicas, one scaling policy.

Events live in one heap of ``(time, seq, kind, replica, epoch)``; arrivals are merged in
from the trace's generator instead of being pushed, so the heap holds one entry per replica
plus the recurring ticks. A replica's entry is re-pushed only when its next event time
changes (``epoch`` invalidates the old one), so cost is O(log replicas) per request event
and O(replicas) per policy tick, with no per-token work.

Routing: ``SimConfig.routing`` (:mod:`kvpilot.autoscaler.sim.routing`; default
``kv_aware``, the deployed router), over ready replicas; each request's prefix-cache hit
comes from the replica it lands on. Scale-down cancels starting replicas first (newest
first), then drains the ready replica with the least KV held: it takes no new requests,
hands its queue back to the router and leaves when its running requests finish (graceful
drain). With no ready replica, arrivals are held at the gateway until one is ready.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from kvpilot.autoscaler.sim.model import ReplicaModel, SimConfig
from kvpilot.autoscaler.sim.nodes import NodePool
from kvpilot.autoscaler.sim.replica import Replica, Req, Stats
from kvpilot.autoscaler.sim.report import SimResult, Timeline
from kvpilot.autoscaler.sim.routing import Router
from kvpilot.autoscaler.sim.traces import Trace
from kvpilot.stats import percentile

_REPLICA, _READY, _TICK, _SAMPLE, _NODE = 0, 1, 2, 3, 4


class _Fleet:
    """Mutable run state (one per :func:`simulate` call)."""

    def __init__(self, model: ReplicaModel, config: SimConfig, stats: Stats) -> None:
        self.model = model
        self.config = config
        self.stats = stats
        self.rng = random.Random(config.seed)
        self.heap: list[tuple[float, int, int, Replica | None, int]] = []
        self.seq = 0
        self.next_rid = 0
        self.ready: list[Replica] = []
        self.starting: list[Replica] = []
        self.draining: list[Replica] = []
        self.held: deque[Req] = deque()
        self.paid = 0  # starting + ready + draining
        self.replica_seconds = 0.0
        self.last_change = 0.0
        self.peak = 0
        self.events = 0
        self.router = Router(config.routing, self.ready, self.rng, config.cache_block_tokens,
                             config.load_penalty_tokens, config.balance_abs_threshold,
                             config.balance_rel_threshold)
        # GPU nodes (SimConfig.nodes): a pod binds to a node slot before its start-up.
        self.by_rid: dict[int, Replica] = {}
        self.pool: NodePool | None = None
        if config.nodes is not None:
            self.pool = NodePool(config.nodes, self._bound,
                                 lambda node: self.push(node.ready_at, _NODE, None, node.nid),
                                 config.warmup_seconds)
        self.placeholder_seconds = 0.0
        self.placeholders_since = 0.0

    # -- bookkeeping -------------------------------------------------------------------------
    def push(self, t: float, kind: int, replica: Replica | None = None, epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, replica, epoch))

    def _pay(self, now: float, delta: int) -> None:
        start = max(self.last_change, self.config.warmup_seconds)
        if now > start:
            self.replica_seconds += self.paid * (now - start)
        self.last_change = now
        self.paid += delta
        if now >= self.config.warmup_seconds:
            self.peak = max(self.peak, self.paid)

    def reschedule(self, r: Replica, now: float) -> None:
        self.router.changed(r)
        t = r.next_event(now)
        if t != r.scheduled:
            r.scheduled = t
            r.epoch += 1
            if t < math.inf:
                self.push(t, _REPLICA, r, r.epoch)

    # -- requests ----------------------------------------------------------------------------
    def route(self, req: Req, now: float) -> None:
        if not self.ready:
            self.held.append(req)
            return
        r = self.router.pick(req, now)
        r.enqueue(req)
        r.step(now, self.stats)
        self.reschedule(r, now)

    def replica_event(self, r: Replica, now: float) -> None:
        r.scheduled = math.inf
        r.step(now, self.stats)
        if r.state == "draining" and r.idle:
            self.draining.remove(r)
            self._gone(r, now)
            return
        self.reschedule(r, now)

    # -- scaling -----------------------------------------------------------------------------
    def start_replica(self, now: float, ready_at: float) -> Replica:
        if self.pool is not None:
            return self._start_on_node(now, ready_at <= now)
        r = Replica(self.next_rid, self.model, ready_at)
        r.cache = self.router.new_cache(r)
        self.next_rid += 1
        self._pay(now, +1)
        if ready_at <= now:
            self.make_ready(r, now)
        else:
            self.starting.append(r)
            self.push(ready_at, _READY, r)
        return r

    def _start_on_node(self, now: float, at_once: bool) -> Replica:
        """A pod that needs a node slot: its start-up begins when it binds (at once when a
        slot or a placeholder is free, else when a node arrives)."""
        assert self.pool is not None
        # The initial fleet (at_once): its nodes are there and its pods already started.
        r = Replica(self.next_rid, self.model, now if at_once else math.inf)
        r.cache = self.router.new_cache(r)
        self.by_rid[r.rid] = r
        self.next_rid += 1
        self._pay(now, +1)
        self.starting.append(r)
        self.pool.schedule_engine(r.rid, now)
        return r

    def _bound(self, rid: int, now: float) -> None:
        r = self.by_rid.get(rid)
        if r is None or r.state != "starting":
            return
        if r.ready_at <= now:  # the initial fleet
            self.make_ready(r, now)
            return
        r.ready_at = now + self.model.startup_seconds
        self.push(r.ready_at, _READY, r)

    def _gone(self, r: Replica, now: float) -> None:
        r.state = "gone"
        self._pay(now, -1)
        if self.pool is not None:
            self.pool.release_engine(r.rid, now)
            self.by_rid.pop(r.rid, None)

    def set_placeholders(self, wanted: int, now: float) -> None:
        """Placeholder pods to keep (with a node pool only)."""
        if self.pool is None:
            return
        self._count_placeholders(now)
        self.pool.set_placeholders(wanted, now)

    def _count_placeholders(self, now: float) -> None:
        assert self.pool is not None
        start = max(self.placeholders_since, self.config.warmup_seconds)
        if now > start:
            self.placeholder_seconds += self.pool.placeholders * (now - start)
        self.placeholders_since = max(self.placeholders_since, now)

    def make_ready(self, r: Replica, now: float) -> None:
        if r.state != "starting":
            return  # cancelled while starting
        if r in self.starting:
            self.starting.remove(r)
        r.state = "ready"
        r.v_time = now
        self.ready.append(r)
        self.router.add(r)
        while self.held:
            self.route(self.held.popleft(), now)

    def resize(self, desired: int, now: float) -> int:
        """Move toward ``desired`` (ready + starting); returns +1/-1/0 for the direction."""
        current = len(self.ready) + len(self.starting)
        if desired > current:
            for _ in range(desired - current):
                self.start_replica(now, now + self.model.startup_seconds)
            return 1
        if desired == current:
            return 0
        for _ in range(current - desired):
            if self.starting:
                self._gone(self.starting.pop(), now)
                continue
            if len(self.ready) <= 1:
                break
            r = min(self.ready, key=lambda x: x.kv_tokens(now) + x.waiting_tokens)
            self.ready.remove(r)
            self.router.remove(r)
            r.state = "draining"
            for req in r.take_waiting():
                self.route(req, now)
            if r.idle:
                self._gone(r, now)
            else:
                self.draining.append(r)
        return -1


class ScalingPolicy(Protocol):
    """What :func:`simulate` drives (see :mod:`kvpilot.autoscaler.sim.controllers`)."""

    name: str
    interval_seconds: float

    def decide(self, now: float, ready: Sequence[Replica], pending: int) -> int:
        """The desired total (ready + pending) at ``now``; ``ready`` is read-only."""
        ...


def simulate(
    trace: Trace, policy: ScalingPolicy, model: ReplicaModel | None = None, config: SimConfig | None = None
) -> SimResult:
    """Run ``policy`` on ``trace``; deterministic for a given trace seed and config seed.

    ``policy`` is any object with ``name``, ``interval_seconds`` and
    ``decide(now, ready_replicas, pending_count) -> desired_total``
    (see :mod:`kvpilot.autoscaler.sim.controllers`).
    """
    model = model or ReplicaModel()
    config = config or SimConfig(duration_seconds=trace.duration_seconds)
    stats = Stats(config.slo_wait_seconds, config.warmup_seconds, config.slo_ttft_seconds,
                  config.slo_itl_seconds)
    fleet = _Fleet(model, config, stats)
    end = config.duration_seconds
    wall = time.perf_counter()
    if fleet.pool is not None:
        nodes = fleet.pool.model
        fleet.pool.add_ready_nodes(math.ceil(config.start_replicas / nodes.pods_per_node), 0.0)
    for _ in range(config.start_replicas):
        fleet.start_replica(0.0, 0.0)
    fleet.push(policy.interval_seconds, _TICK)
    fleet.push(0.0, _SAMPLE)
    timeline = Timeline()
    arrivals = trace.requests()
    nxt = next(arrivals, None)
    requests = rejected = ups = downs = 0
    limit = model.admit_limit_tokens
    heap = fleet.heap
    while True:
        t_heap = heap[0][0] if heap else math.inf
        if nxt is not None and nxt[0] <= t_heap:
            t, prompt, output, session, shared = nxt
            if t >= end:
                nxt = None
                continue
            fleet.events += 1
            counted = t >= config.warmup_seconds
            requests += counted
            if prompt + output > limit:
                rejected += counted
            else:
                fleet.route(Req(t, prompt, output, 0, session, shared), t)
            nxt = next(arrivals, None)
            continue
        if t_heap >= end:
            break
        t, _, kind, replica, epoch = heapq.heappop(heap)
        if kind == _REPLICA:
            if replica is not None and epoch == replica.epoch and replica.state != "gone":
                fleet.events += 1
                fleet.replica_event(replica, t)
        elif kind == _READY:
            fleet.events += 1
            if replica is not None:
                fleet.make_ready(replica, t)
        elif kind == _TICK:
            fleet.events += 1
            desired = policy.decide(t, fleet.ready, len(fleet.starting))
            # Placeholders first: the operator scales its placeholder Deployment down in the
            # same pass that scales the engines up, so the placeholders the new engines
            # displace are not recreated (and do not ask for nodes) if no longer wanted.
            if fleet.pool is not None and t >= config.warmup_seconds:
                fleet.set_placeholders(int(getattr(policy, "placeholders", 0)), t)
            moved = fleet.resize(desired, t) if t >= config.warmup_seconds else 0
            ups += moved > 0
            downs += moved < 0
            if fleet.pool is not None:
                fleet.pool.scale_down(t)
            fleet.push(t + policy.interval_seconds, _TICK)
        elif kind == _NODE:
            fleet.events += 1
            if fleet.pool is not None:
                node = fleet.pool.nodes.get(epoch)
                if node is not None:
                    fleet.pool.node_ready(node, t)
        else:
            _sample(fleet, timeline, t)
            fleet.push(t + config.sample_seconds, _SAMPLE)
    fleet.peak = max(fleet.peak, fleet.paid) if fleet.peak == 0 else fleet.peak
    fleet._pay(end, 0)
    if fleet.pool is not None:
        fleet._count_placeholders(end)
        fleet.pool.close(end)
    return _result(
        trace,
        policy,
        config,
        fleet,
        timeline,
        requests,
        rejected,
        ups,
        downs,
        time.perf_counter() - wall,
    )


def _sample(fleet: _Fleet, timeline: Timeline, now: float) -> None:
    ready = fleet.ready
    waiting = len(fleet.held) + sum(len(r.waiting) for r in ready)
    waiting += sum(len(r.waiting) for r in fleet.draining)
    timeline.time.append(now)
    timeline.usage.append(sum(r.kv_usage(now) for r in ready) / len(ready) if ready else 0.0)
    timeline.waiting.append(waiting)
    timeline.ready.append(len(ready))
    timeline.replicas.append(fleet.paid)


def _result(
    trace: Trace,
    policy: ScalingPolicy,
    config: SimConfig,
    fleet: _Fleet,
    timeline: Timeline,
    requests: int,
    rejected: int,
    ups: int,
    downs: int,
    wall: float,
) -> SimResult:
    """Close the books at the end: queued requests are charged their wait so far."""
    stats, end = fleet.stats, config.duration_seconds
    waits = stats.waits
    open_reqs: list[Req] = list(fleet.held)
    warm = config.warmup_seconds
    # Requests still open at the end are judged on what is known: one already past a
    # target has missed (counted), one still within both is left out of the attainment.
    missed_open = 0
    for r in fleet.ready + fleet.draining:
        r.observe(end)
        open_reqs.extend(r.waiting)
        running = list(r.running) + list(r.prefills)
        waits.extend(req.waited for req in running if req.arrival >= warm)
        for req in r.running:
            if req.arrival < warm:
                continue
            tokens = req.generated + r.v - req.v_start
            if (req.first_token - req.arrival > stats.slo_ttft or (tokens > 1 and
                    (end - req.first_token) / (tokens - 1) > stats.slo_itl)):
                missed_open += 1
        missed_open += sum(1 for req in r.prefills if req.arrival >= warm and (
            (req.first_token < 0 and end - req.arrival > stats.slo_ttft)
            or (req.first_token >= 0 and req.first_token - req.arrival > stats.slo_ttft)))
    for req in open_reqs:
        if req.arrival < warm:
            continue
        stint = end - req.enqueued
        stats.starvation += max(0.0, stint - stats.slo) if req.first else stint
        waits.append(req.waited + stint)
        ttft = (req.first_token if req.first_token >= 0 else end) - req.arrival
        missed_open += ttft > stats.slo_ttft or (req.first_token >= 0 and req.generated > 1 and (
            end - req.first_token) / (req.generated - 1) > stats.slo_itl)
    judged = stats.finished + rejected + missed_open
    waits.sort()
    ttfts, itls = sorted(stats.ttft), sorted(stats.itl)
    admitted = sum(stats.admitted.values())
    return SimResult(
        policy=policy.name,
        trace=trace.name,
        seed=config.seed,
        duration_seconds=end,
        warmup_seconds=config.warmup_seconds,
        requests=requests,
        finished=stats.finished,
        rejected=rejected,
        starvation_seconds=stats.starvation,
        preemptions=stats.preemptions,
        p99_queue_seconds=percentile(waits, 99) if waits else 0.0,
        p50_queue_seconds=percentile(waits, 50) if waits else 0.0,
        mean_queue_seconds=sum(waits) / len(waits) if waits else 0.0,
        replica_hours=fleet.replica_seconds / 3600.0,
        peak_replicas=fleet.peak,
        scale_ups=ups,
        scale_downs=downs,
        generated_tokens=stats.generated_tokens,
        events=fleet.events,
        wall_seconds=wall,
        rules=dict(getattr(policy, "rules", {})),
        timeline=timeline,
        routing=config.routing,
        prompt_tokens=stats.prompt_tokens,
        hit_tokens=stats.hit_tokens,
        prefix_hit_rate=stats.hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        requests_per_replica={f"r{rid}": n for rid, n in sorted(stats.admitted.items())},
        max_replica_share=max(stats.admitted.values()) / admitted if admitted else 0.0,
        node_hours=fleet.pool.node_seconds / 3600.0 if fleet.pool is not None else 0.0,
        peak_nodes=fleet.pool.peak_nodes if fleet.pool is not None else 0,
        nodes_requested=fleet.pool.nodes_requested if fleet.pool is not None else 0,
        placeholder_hours=fleet.placeholder_seconds / 3600.0,
        slo_attainment=stats.slo_met / judged if judged else 1.0,
        slo_judged=judged,
        slo_ttft_seconds=config.slo_ttft_seconds,
        slo_itl_seconds=config.slo_itl_seconds,
        ttft_p50_seconds=percentile(ttfts, 50) if ttfts else 0.0,
        ttft_p90_seconds=percentile(ttfts, 90) if ttfts else 0.0,
        itl_p50_seconds=percentile(itls, 50) if itls else 0.0,
        itl_p90_seconds=percentile(itls, 90) if itls else 0.0,
    )
