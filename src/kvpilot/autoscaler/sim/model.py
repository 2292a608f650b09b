"""Parameters of the simulated replica and of a run.

The replica defaults describe a Llama-3-8B-class model in bf16 on one H100-80GB at
``--gpu-memory-utilization 0.9``; they are placeholders until calibrated from our engine's
benchmark (``kvpilot bench serve``): pass measured values to :class:`ReplicaModel`.

Service model of one replica: engine steps (per-request events, no per-token events)::

    waiting queue (FIFO) --admit--> prefill (chunked under the step's token budget)
        --> decode (all decoding requests advance one token per step) --> done

    one step = decode_step_base_seconds
               + decode_step_per_seq_seconds x decode rows
               + prefill tokens in the step / prefill_tokens_per_second
    prefill tokens in the step = min(prefill backlog, max_num_batched_tokens - decode rows)

so prefill slows the decodes that share its steps, a full batch slows every token, and
TTFT (arrival to the end of the request's last prefill chunk, which yields its first
token) and ITL (the duration of each step a request decodes in) emerge per request. The
prefill backlog flows FCFS through the admitted prompts as a fluid of tokens: a prompt's
prefill ends when its last token has flowed (at most one step's fixed cost early when
several short prompts share a step).

A request is admitted when the step has token budget left over (the prefill backlog is
under ``max_num_batched_tokens`` - decode rows, as vLLM schedules waiting requests into
the budget the running ones leave), fewer than ``max_num_seqs`` run, and its prompt (plus
any tokens generated before a preemption) fits under ``(1 - admission_watermark)`` of the
KV; it then holds that many tokens plus one per generated token. When decode growth fills the KV, the newest running request is preempted
(by recompute: its KV is freed and it re-queues at the head, as vLLM does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.autoscaler.sim.nodes import NodeModel

# Where requests land (SimConfig.routing); the policies themselves are in
# kvpilot.autoscaler.sim.routing, which imports this module.
ROUTINGS = ("kv_aware", "session_affine", "random", "p2c_kv")
DEFAULT_ROUTING = "kv_aware"

# Benchmark SLO targets per hardware profile: (TTFT, mean ITL) in seconds.
SLO_PROFILES: dict[str, tuple[float, float]] = {"gpu": (1.0, 0.05), "cpu": (10.0, 0.5)}


@dataclass(frozen=True)
class ReplicaModel:
    """One engine replica.

    Attributes:
        kv_capacity_tokens: KV pool in tokens (``kvpilot kv-calc --model llama-3-8b
            --gpu H100-80GB`` gives 464,688).
        prefill_tokens_per_second: marginal prefill rate: each prefill token in a step adds
            ``1 / prefill_tokens_per_second`` seconds to it.
        decode_step_base_seconds: one step's fixed cost (weights read), seconds.
        decode_step_per_seq_seconds: added per decoding request in the step (its KV read
            and its row of the products), seconds.
        max_num_seqs: running requests at most (``--max-num-seqs``).
        max_num_batched_tokens: token budget of one step (``--max-num-batched-tokens``):
            decode rows plus prefill chunk tokens.
        admission_watermark: share of the KV kept free at admission (vLLM: 1%).
        startup_seconds: pod creation to serving (image pull, weight load, warm-up).
    """

    kv_capacity_tokens: int = 464_688
    prefill_tokens_per_second: float = 20_000.0
    decode_step_base_seconds: float = 0.010
    decode_step_per_seq_seconds: float = 0.00015
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    admission_watermark: float = 0.01
    startup_seconds: float = 120.0

    def __post_init__(self) -> None:
        for name in (
            "kv_capacity_tokens",
            "prefill_tokens_per_second",
            "decode_step_base_seconds",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)!r}")
        if self.decode_step_per_seq_seconds < 0 or self.startup_seconds < 0:
            raise ValueError(
                "decode_step_per_seq_seconds and startup_seconds must be >= 0; got"
                f" {self.decode_step_per_seq_seconds}, {self.startup_seconds}"
            )
        if not 0.0 <= self.admission_watermark < 1.0:
            raise ValueError(
                f"admission_watermark must be in [0, 1); got {self.admission_watermark}"
            )

    def step_seconds(self, decode_rows: int, prefill_tokens: float = 0.0) -> float:
        """One engine step with ``decode_rows`` decoding requests and ``prefill_tokens``
        prompt tokens (seconds)."""
        return (self.decode_step_base_seconds + self.decode_step_per_seq_seconds * decode_rows
                + prefill_tokens / self.prefill_tokens_per_second)

    def decode_rate(self, batch: int) -> float:
        """Tokens per second each request gets with ``batch`` requests decoding (no
        prefill in the steps)."""
        return 1.0 / self.step_seconds(batch)

    @property
    def admit_limit_tokens(self) -> float:
        """KV tokens an admission may fill up to. At least one token stays free, so a
        request just preempted for a full KV is never re-admitted in the same instant (a
        ping-pong with no progress); larger requests are rejected at arrival."""
        return min(
            self.kv_capacity_tokens * (1.0 - self.admission_watermark),
            self.kv_capacity_tokens - 1.0,
        )


@dataclass(frozen=True)
class SimConfig:
    """One run.

    Attributes:
        duration_seconds: simulated time; arrivals stop and accounting closes here.
        slo_wait_seconds: queueing delay a request tolerates; time beyond it is starvation.
        slo_ttft_seconds / slo_itl_seconds: a request meets the SLO when its TTFT (arrival
            to first token) is at most ``slo_ttft_seconds`` and its mean inter-token latency
            ((finish - first token) / (output tokens - 1)) at most ``slo_itl_seconds``
            (defaults: the GPU profile, 1 s and 50 ms; the CPU profile is 10 s and 500 ms,
            :data:`SLO_PROFILES`).
        min_replicas / max_replicas: the policy's bounds.
        initial_replicas: ready at t=0 (default min_replicas).
        sample_seconds: timeline resolution (for the plot and tables).
        seed: routing randomness (``random``, ``p2c_kv``); the trace has its own seed.
        warmup_seconds: the fleet fills from empty at t=0; until this time the policy is
            called (so it builds history) but not obeyed, and nothing is counted: requests
            arriving earlier, preemptions, replica-hours.
        routing: where requests land (:data:`ROUTINGS`; :mod:`kvpilot.autoscaler.sim.routing`):
            ``kv_aware`` (default, the deployed router), ``session_affine`` (the ideal),
            ``random`` (a plain Service), ``p2c_kv`` (the simulator's earlier routing).
        cache_block_tokens: KV block size; prefix hits count whole blocks (vLLM: 16).
        load_penalty_tokens: ``kv_aware`` only: prefix tokens one request in flight on a
            replica outweighs (0: the router's own rule, no such trade).
        balance_abs_threshold / balance_rel_threshold: ``kv_aware`` only: when the most
            and least requests in flight on a replica differ by more than ``abs`` and the
            most exceed ``rel`` x the least, requests go to the least-loaded replica
            whatever it caches (vllm-router's ``--balance-abs-threshold`` 64 and
            ``--balance-rel-threshold`` 1.5).
        nodes: GPU nodes under a cluster autoscaler (:mod:`kvpilot.autoscaler.sim.nodes`):
            a pod waits for a node slot before its own start-up. None (default): a slot is
            always free, as before.
    """

    duration_seconds: float = 3600.0
    slo_wait_seconds: float = 2.0
    slo_ttft_seconds: float = 1.0
    slo_itl_seconds: float = 0.05
    min_replicas: int = 1
    max_replicas: int = 16
    initial_replicas: int | None = None
    sample_seconds: float = 15.0
    seed: int = 0
    warmup_seconds: float = 300.0
    routing: str = DEFAULT_ROUTING
    cache_block_tokens: int = 16
    load_penalty_tokens: float = 0.0
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    nodes: NodeModel | None = None

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(
                f"routing must be one of {', '.join(ROUTINGS)}; got {self.routing!r}")
        if (isinstance(self.cache_block_tokens, bool) or not isinstance(self.cache_block_tokens, int)
                or self.cache_block_tokens < 1):
            raise ValueError(
                f"cache_block_tokens must be an int >= 1; got {self.cache_block_tokens!r}")
        if not (math.isfinite(self.load_penalty_tokens) and self.load_penalty_tokens >= 0):
            raise ValueError(
                f"load_penalty_tokens must be finite and >= 0; got {self.load_penalty_tokens!r}")
        if (isinstance(self.balance_abs_threshold, bool)
                or not isinstance(self.balance_abs_threshold, int)
                or self.balance_abs_threshold < 0):
            raise ValueError(
                f"balance_abs_threshold must be an int >= 0; got {self.balance_abs_threshold!r}")
        if not (math.isfinite(self.balance_rel_threshold) and self.balance_rel_threshold >= 1):
            raise ValueError("balance_rel_threshold must be finite and >= 1;"
                             f" got {self.balance_rel_threshold!r}")
        if not 0 <= self.warmup_seconds < self.duration_seconds:
            raise ValueError(
                f"warmup_seconds must be in [0, duration_seconds={self.duration_seconds});"
                f" got {self.warmup_seconds}"
            )
        if self.duration_seconds <= 0 or self.sample_seconds <= 0:
            raise ValueError(
                f"duration_seconds and sample_seconds must be > 0; got {self.duration_seconds},"
                f" {self.sample_seconds}"
            )
        for name in ("slo_ttft_seconds", "slo_itl_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0; got {value!r}")
        if self.slo_wait_seconds < 0:
            raise ValueError(f"slo_wait_seconds must be >= 0; got {self.slo_wait_seconds}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 1 <= min_replicas <= max_replicas; got {self.min_replicas},"
                f" {self.max_replicas}"
            )
        start = self.initial_replicas
        if start is not None and not self.min_replicas <= start <= self.max_replicas:
            raise ValueError(
                f"initial_replicas must be in [{self.min_replicas}, {self.max_replicas}];"
                f" got {start}"
            )

    @property
    def start_replicas(self) -> int:
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas
