"""Seedable request traces: :class:`Request` ``(arrival_seconds, prompt_tokens,
output_tokens, session, shared_tokens)`` in time order. A trace says which conversation a
request continues (``session``) and how many leading tokens every session shares (the
system prompt), not what is cached: the prefix-cache hit is decided where the request is
routed (:mod:`kvpilot.autoscaler.sim.routing`).

Traces are sized in replicas: ``peak_replicas`` is how many default replicas the trace's
peak needs at the target KV usage (estimated with Little's law from the replica model), so
one knob scales a trace from a laptop test to a thousand-replica fleet. Each trace is a
generator, so a million requests cost no memory until they arrive.

- ``ramp``: a compressed diurnal day: trough (25% of peak), a smooth (cosine) rise to the
  peak, a plateau and a fall.
- ``burst``: a steady base at 25% of peak that jumps x4 at once, holds, and drops back.
- ``agentic``: multi-turn agent sessions: every session starts with the same system
  prompt, and each turn's prompt is the whole conversation so far plus new tool/user
  tokens, so contexts grow turn by turn (all but the new tokens can be prefix-cache hits,
  if the turn lands where its session's earlier turns ran); sessions start faster and
  faster over the first half (a ramp in session starts), then hold.
- ``steady_high_concurrency``: a constant rate of short-prompt requests (prompts of about
  128 tokens, outputs of about 512): compute binds, not KV. At the size it is made for
  the KV stays under 10% of the pool; a fleet short of it fills every batch to
  ``max_num_seqs`` and queues while the KV is still under 20% (256 x ~400 tokens on the
  GPU presets), so a KV-usage policy sees nothing to do. The fleet starts at the peak's
  size; minReplicas is a quarter of it.
- ``prefill_heavy``: the ramp's shape with long prompts (mean 4,000 tokens, at most
  10,240) and short outputs (mean 64): compute goes to prefill, so TTFT and the ITL of the decodes that
  share prefill steps bind before the KV does.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from kvpilot.autoscaler.sim.model import ReplicaModel


class Request(NamedTuple):
    """One request of a trace.

    Attributes:
        arrival: seconds from the start.
        prompt / output: tokens.
        session: the conversation it continues (-1: a one-off request).
        shared: leading prompt tokens every session shares (the system prompt), 0 if none.
    """

    arrival: float
    prompt: int
    output: int
    session: int = -1
    shared: int = 0


@dataclass(frozen=True)
class Lengths:
    """Lognormal token lengths with the given means, clipped to [lo, hi]."""

    prompt_mean: float = 2000.0
    prompt_sigma: float = 0.6
    output_mean: float = 600.0
    output_sigma: float = 0.5
    prompt_max: int = 16_384
    output_max: int = 4_096

    def sample(self, rng: random.Random) -> tuple[int, int]:
        p = rng.lognormvariate(
            math.log(self.prompt_mean) - self.prompt_sigma**2 / 2, self.prompt_sigma
        )
        o = rng.lognormvariate(
            math.log(self.output_mean) - self.output_sigma**2 / 2, self.output_sigma
        )
        return min(self.prompt_max, max(16, int(p))), min(self.output_max, max(1, int(o)))


@dataclass(frozen=True)
class Session:
    """Agentic session shape: the system prompt every session shares (tokens), the first
    prompt (system prompt included; the rest exponential), added tokens per turn, output per
    turn, turns (1 + geometric), think time (exponential, plus the expected generation
    time)."""

    system_prompt_tokens: int = 1024
    first_prompt_mean: float = 1500.0
    turn_tokens_mean: float = 400.0
    output_mean: float = 250.0
    turns_mean: float = 8.0
    think_seconds_mean: float = 8.0
    max_context: int = 32_768
    assumed_tokens_per_second: float = 25.0


@dataclass(frozen=True)
class Trace:
    """A named, sized, seedable trace.

    Attributes:
        name: ``ramp``, ``burst`` or ``agentic``.
        duration_seconds: arrivals end here.
        peak_rate: requests per second at the peak (estimate for agentic).
        base_replicas / peak_replicas: replicas the trough and the peak need at target.
        requests: a factory for a fresh iterator (same seed -> same requests).
        initial_replicas: replicas ready at the start (None: ``base_replicas``).
    """

    name: str
    description: str
    duration_seconds: float
    peak_rate: float
    base_replicas: float
    peak_replicas: float
    requests: Callable[[], Iterator[Request]]
    initial_replicas: float | None = None


def requests_per_replica_second(
    model: ReplicaModel,
    prompt_mean: float,
    output_mean: float,
    usage: float,
    prefill_mean: float | None = None,
) -> float:
    """The request rate one replica sustains at ``usage``, the lesser of:

    * KV (Little's law): concurrency = usage x capacity / mean tokens held (prompt + half
      the output), at most ``max_num_seqs``; residence = prefill + output x the step time
      at that batch;
    * compute: the engine busy ``usage`` of the time, a request costing its prefill
      tokens (``prefill_mean`` tokens actually prefilled, default all) at the marginal
      prefill rate plus ``output`` decode rows, each ``decode_step_per_seq_seconds`` plus
      its share of the step's fixed cost at that concurrency.
    """
    prefill_mean = prompt_mean if prefill_mean is None else prefill_mean
    held = prompt_mean + output_mean / 2.0
    conc = max(1.0, min(usage * model.kv_capacity_tokens / held, float(model.max_num_seqs)))
    prefill_s = prefill_mean / model.prefill_tokens_per_second
    residence = prefill_s + output_mean / model.decode_rate(round(conc))
    compute = prefill_s + output_mean * (model.decode_step_per_seq_seconds
                                         + model.decode_step_base_seconds / conc)
    return min(conc / residence, usage / compute)


def _thinned(
    rng: random.Random, rate: Callable[[float], float], peak: float, duration: float
) -> Iterator[float]:
    """Arrival times of a Poisson process with time-varying ``rate`` (Lewis-Shedler
    thinning against ``peak``)."""
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return
        if rng.random() * peak <= rate(t):
            yield t


def _smoothstep(x: float) -> float:
    x = min(1.0, max(0.0, x))
    return (1.0 - math.cos(math.pi * x)) / 2.0


def ramp_shape(duration: float, low: float = 0.25) -> Callable[[float], float]:
    """Share of peak over a compressed day: 15% trough, 30% rise, 25% peak, 25% fall."""

    def shape(t: float) -> float:
        x = t / duration
        if x < 0.15:
            return low
        if x < 0.45:
            return low + (1 - low) * _smoothstep((x - 0.15) / 0.30)
        if x < 0.70:
            return 1.0
        return low + (1 - low) * (1 - _smoothstep((x - 0.70) / 0.25))

    return shape


# The burst trace's step, as shares of the run (the benchmark's onset bound reads them).
BURST_START, BURST_END = 0.30, 0.60


def burst_shape(duration: float, factor: float = 4.0) -> Callable[[float], float]:
    """Share of peak: 1/factor, x factor at once from 30% to 60% of the run, then back."""

    def shape(t: float) -> float:
        return 1.0 if BURST_START * duration <= t < BURST_END * duration else 1.0 / factor

    return shape


def _simple(
    name: str,
    description: str,
    shape: Callable[[float], float],
    peak_replicas: float,
    duration: float,
    seed: int,
    model: ReplicaModel,
    usage: float,
    lengths: Lengths,
    base_share: float | None = None,
    initial_share: float | None = None,
) -> Trace:
    per_replica = requests_per_replica_second(
        model, lengths.prompt_mean, lengths.output_mean, usage
    )
    peak = peak_replicas * per_replica

    def requests() -> Iterator[Request]:
        rng = random.Random(seed)
        lengths_rng = random.Random(seed + 1_000_003)
        for t in _thinned(rng, lambda t: peak * shape(t), peak, duration):
            p, o = lengths.sample(lengths_rng)
            yield Request(t, p, o)

    base = min(shape(t * duration / 100) for t in range(100)) if base_share is None else base_share
    initial = None if initial_share is None else peak_replicas * initial_share
    return Trace(name, description, duration, peak, peak_replicas * base, peak_replicas, requests,
                 initial)


def _session_turns(rng: random.Random, s: Session) -> list[tuple[float, int, int, int]]:
    """(offset seconds, prompt, output, reusable prefix) of each turn of one session: the
    first prompt is the system prompt plus the user's; a later turn's prompt is the
    previous prompt and output (its reusable prefix) plus new tokens."""
    turns = 1 + int(rng.expovariate(1.0 / max(s.turns_mean - 1, 1e-9)))
    out: list[tuple[float, int, int, int]] = []
    user_mean = max(1.0, s.first_prompt_mean - s.system_prompt_tokens)
    context = s.system_prompt_tokens + max(16, int(rng.expovariate(1.0 / user_mean)))
    cached = s.system_prompt_tokens
    offset = 0.0
    for _ in range(turns):
        output = max(1, int(rng.expovariate(1.0 / s.output_mean)))
        if context + output > s.max_context:
            break
        out.append((offset, context, output, cached))
        offset += output / s.assumed_tokens_per_second + rng.expovariate(1.0 / s.think_seconds_mean)
        cached = context + output
        context = cached + max(1, int(rng.expovariate(1.0 / s.turn_tokens_mean)))
    return out


def agentic(
    peak_replicas: float,
    duration: float,
    seed: int,
    model: ReplicaModel,
    usage: float,
    session: Session = Session(),
) -> Trace:
    """Multi-turn sessions; session starts ramp from 30% to 100% over the first half.

    Sizing (requests per replica, Little's law) assumes only the shared system prompt is
    reused, the worst any routing does once every replica has cached it: the same trace
    is replayed under every routing, ``peak_replicas`` replicas serve its peak whatever the
    routing, and a routing that keeps sessions' prefixes needs fewer. (Sizing on every
    turn's whole earlier context, the ideal, would ask about 3.6x more of each replica than
    the fleet delivers with realistic hit rates; see docs/autoscaling.md.)
    """
    probe = random.Random(12345)
    samples = [t for _ in range(4000) for t in _session_turns(probe, session)]
    turns_per_session = len(samples) / 4000
    shared = session.system_prompt_tokens
    prompt_mean = sum(p for _, p, _, _ in samples) / len(samples)
    output_mean = sum(o for _, _, o, _ in samples) / len(samples)
    prefill_mean = sum(p - min(shared, p - 1) for _, p, _, _ in samples) / len(samples)
    per_replica = requests_per_replica_second(model, prompt_mean, output_mean, usage, prefill_mean)
    peak_sessions = peak_replicas * per_replica / turns_per_session

    def shape(t: float) -> float:
        return 0.3 + 0.7 * min(1.0, t / (0.5 * duration))

    def requests() -> Iterator[Request]:
        rng = random.Random(seed)
        starts = _thinned(rng, lambda t: peak_sessions * shape(t), peak_sessions, duration)
        pending: list[tuple[float, int, int, int, int]] = []  # (time, seq, prompt, out, session)
        seq = sessions = 0
        next_start = next(starts, None)
        while next_start is not None or pending:
            # next_start None: the loop's condition leaves pending non-empty.
            if next_start is None or (pending and pending[0][0] <= next_start):
                t, _, p, o, sid = heapq.heappop(pending)
                if t < duration:
                    yield Request(t, p, o, sid, shared)
                continue
            for offset, p, o, _ in _session_turns(rng, session):
                seq += 1
                heapq.heappush(pending, (next_start + offset, seq, p, o, sessions))
            sessions += 1
            next_start = next(starts, None)

    return Trace(
        "agentic",
        "multi-turn agent sessions with growing contexts",
        duration,
        peak_sessions * turns_per_session,
        peak_replicas * 0.3,
        peak_replicas,
        requests,
    )


TRACES = ("ramp", "burst", "agentic", "steady_high_concurrency", "prefill_heavy")
# Short requests: a full batch holds little KV.
SHORT = Lengths(prompt_mean=128, prompt_sigma=0.3, output_mean=512, output_sigma=0.3,
                prompt_max=1024, output_max=2048)
# Long prompts, short answers (retrieval, summarising).
# The cap keeps the longest prompt's prefill alone (5 steps of 2,048 tokens, ~0.73 s on the
# H200 preset) under the GPU profile's 1 s TTFT target, so 99% attainment is reachable.
PREFILL_HEAVY = Lengths(prompt_mean=4000, prompt_sigma=0.4, output_mean=64, output_sigma=0.5,
                        prompt_max=10_240, output_max=512)


def make_trace(
    name: str,
    peak_replicas: float = 8.0,
    duration_seconds: float = 3600.0,
    seed: int = 0,
    model: ReplicaModel | None = None,
    usage: float = 0.75,
) -> Trace:
    """Build a named trace whose peak needs ``peak_replicas`` replicas at ``usage`` KV use."""
    if not peak_replicas > 0:
        raise ValueError(f"peak_replicas must be > 0; got {peak_replicas}")
    if not duration_seconds > 0:
        raise ValueError(f"duration_seconds must be > 0; got {duration_seconds}")
    model = model or ReplicaModel()
    lengths = Lengths()
    if name == "ramp":
        return _simple(
            "ramp",
            "compressed diurnal day: 25% -> 100% -> 25% of peak",
            ramp_shape(duration_seconds),
            peak_replicas,
            duration_seconds,
            seed,
            model,
            usage,
            lengths,
        )
    if name == "burst":
        return _simple(
            "burst",
            "steady 25% of peak, a sudden x4 burst, then back",
            burst_shape(duration_seconds),
            peak_replicas,
            duration_seconds,
            seed,
            model,
            usage,
            lengths,
        )
    if name == "agentic":
        return agentic(peak_replicas, duration_seconds, seed, model, usage)
    if name == "steady_high_concurrency":
        return _simple(
            "steady_high_concurrency",
            "constant rate of short requests: full batches, low KV",
            lambda t: 1.0,
            peak_replicas,
            duration_seconds,
            seed,
            model,
            usage,
            SHORT,
            base_share=0.25,
            initial_share=1.0,
        )
    if name == "prefill_heavy":
        return _simple(
            "prefill_heavy",
            "compressed diurnal day of long prompts and short outputs",
            ramp_shape(duration_seconds),
            peak_replicas,
            duration_seconds,
            seed,
            model,
            usage,
            PREFILL_HEAVY,
        )
    raise ValueError(f"trace must be one of {', '.join(TRACES)}; got {name!r}")
