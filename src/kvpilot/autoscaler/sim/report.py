"""What a simulation run reports, and a side-by-side table of several runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class Timeline:
    """Fleet state every ``sample_seconds`` (parallel lists, one entry per sample).

    ``usage`` is the mean KV usage over ready replicas; ``waiting`` all queued requests
    (including those held while no replica was ready); ``replicas`` ready + starting +
    draining (what is paid for); ``ready`` serving ones.
    """

    time: list[float] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)


@dataclass
class SimResult:
    """One policy on one trace.

    Attributes:
        starvation_seconds: sum over requests of queueing beyond the SLO, plus for every
            preemption the time until the request was re-admitted and its recompute.
        preemptions: recompute-preemptions (KV full).
        p99_queue_seconds / p50_queue_seconds / mean_queue_seconds: total queueing delay per
            request (arrival to admission, plus re-queues after preemptions); requests
            still queued at the end count with their wait so far.
        replica_hours: replicas paid for (starting, ready and draining) integrated over time.
        scale_ups / scale_downs: decisions that changed the count.
        events: discrete events processed; wall_seconds: simulator run time.
        routing: where requests landed (``SimConfig.routing``).
        prompt_tokens / hit_tokens: summed over counted requests at their first admission:
            prompt tokens, and those the chosen replica's prefix cache held.
        prefix_hit_rate: the fleet's prefix hit rate, ``hit_tokens / prompt_tokens``.
        requests_per_replica: counted requests first admitted by each replica (``r<id>``).
        max_replica_share: the largest replica's share of those requests.
        node_hours / peak_nodes / nodes_requested / placeholder_hours: with a
            ``SimConfig.nodes`` model: GPU nodes paid (asked for until removed) integrated
            over time, the most at once, how many were asked for, and placeholder pods kept
            (bound or pending) integrated over time; 0 without one.
    """

    policy: str
    trace: str
    seed: int
    duration_seconds: float
    warmup_seconds: float
    requests: int
    finished: int
    rejected: int
    starvation_seconds: float
    preemptions: int
    p99_queue_seconds: float
    p50_queue_seconds: float
    mean_queue_seconds: float
    replica_hours: float
    peak_replicas: int
    scale_ups: int
    scale_downs: int
    generated_tokens: float
    events: int
    wall_seconds: float
    rules: dict[str, int] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=Timeline)
    routing: str = "kv_aware"
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefix_hit_rate: float = 0.0
    requests_per_replica: dict[str, int] = field(default_factory=dict)
    max_replica_share: float = 0.0
    node_hours: float = 0.0
    peak_nodes: int = 0
    nodes_requested: int = 0
    placeholder_hours: float = 0.0
    slo_attainment: float = 1.0
    slo_judged: int = 0
    slo_ttft_seconds: float = 0.0
    slo_itl_seconds: float = 0.0
    ttft_p50_seconds: float = 0.0
    ttft_p90_seconds: float = 0.0
    itl_p50_seconds: float = 0.0
    itl_p90_seconds: float = 0.0

    def to_dict(self, timeline: bool = False) -> dict[str, object]:
        d = asdict(self)
        if not timeline:
            d.pop("timeline")
        return d


def comparison_table(results: Sequence[SimResult], baseline: str = "hpa") -> str:
    """Plain-text table: one row per (trace, routing, policy), ratios against ``baseline``
    on the same trace and routing; ``hit %`` is the fleet's prefix hit rate and ``max
    share`` the busiest replica's share of the requests."""
    header = (
        "trace",
        "routing",
        "policy",
        "hit %",
        "max share",
        "SLO %",
        "TTFT p90",
        "ITL p90 ms",
        "starv s",
        "x base",
        "preempt",
        "p99 wait s",
        "replica-h",
        "x base",
        "peak",
        "ups",
        "downs",
        "requests",
    )
    rows = [header]
    base = {(r.trace, r.routing): r for r in results if r.policy == baseline}
    for r in results:
        b = base.get((r.trace, r.routing))
        starv_ratio = _ratio(r.starvation_seconds, b.starvation_seconds) if b else "-"
        rh_ratio = _ratio(r.replica_hours, b.replica_hours) if b else "-"
        rows.append(
            (
                r.trace,
                r.routing,
                r.policy,
                f"{100 * r.prefix_hit_rate:.1f}",
                f"{r.max_replica_share:.2f}",
                f"{100 * r.slo_attainment:.2f}",
                f"{r.ttft_p90_seconds:.2f}",
                f"{1e3 * r.itl_p90_seconds:.1f}",
                f"{r.starvation_seconds:,.0f}",
                starv_ratio,
                f"{r.preemptions:,}",
                f"{r.p99_queue_seconds:.2f}",
                f"{r.replica_hours:.2f}",
                rh_ratio,
                str(r.peak_replicas),
                str(r.scale_ups),
                str(r.scale_downs),
                f"{r.requests:,}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    if b == 0:
        return "-" if a == 0 else "inf"
    return f"{a / b:.2f}"
