"""The policy's memory between decisions, small enough to live on the CR's status.

:class:`PolicyState` is immutable; :func:`kvpilot.autoscaler.policy.decide` returns a new
one. The operator stores ``state.to_dict()`` (plain JSON: lists of numbers) on the object
and passes ``PolicyState.from_dict(...)`` back next time, so history survives an operator
restart (the dask-kubernetes lesson: state that must survive lives on the object).

Size: one demand sample per interval over the forecast window and one recommendation per
interval over the longer stabilization window (with the defaults, 9 + 21 entries).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.autoscaler.latency import LatencyModel

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Recommendation:
    """One past decision's inputs to the stabilization windows.

    Attributes:
        time: when it was made (seconds, the caller's clock).
        replicas: the highest candidate (what the load asked for), or ``None`` when the
            observation was incomplete (missing metrics break a scale-down window).
        reactive: the highest reactive candidate (headroom, saturation, queue drain), for the
            scale-up window; ``None`` when missing.
    """

    time: float
    replicas: int | None
    reactive: int | None


@dataclass(frozen=True)
class PolicyState:
    """History the policy needs.

    Attributes:
        demand: ``(time, replica_equivalents)`` samples of KV demand (held + queued tokens
            divided by one replica's capacity), oldest first, for the forecast.
        recommendations: oldest first.
        last_scale_time: when the policy last changed the count (``None`` = never).
        last_scale_down_time: when it last scaled down; the forecast ignores the samples
            taken while that step's load was moving onto the remaining pods.
        starvation_base_replicas: the ready count when the current starvation episode
            began (``None`` = no pod starving at the last decision with usage data). The
            alarm asks for this + 1 until the episode ends, so a hot spot that one more
            replica does not relieve cannot ratchet the fleet up one pod per start-up.
        idle_since: since when the fleet has been idle without a break (scale to zero
            only; ``None`` = not idle at the last decision).
        requests_finished: the engines' finished-request count at the last decision
            (scale to zero only: a change is traffic).
        latency: the ITL model's fitted sums (:class:`~kvpilot.autoscaler.latency.
            LatencyModel`; ``spec.autoscaling.slo`` only, None without an SLO or before
            the first decision with one). Added in schema version 1 as an optional key:
            a state written by an older operator reads as None (the prior).
    """

    demand: tuple[tuple[float, float], ...] = ()
    recommendations: tuple[Recommendation, ...] = ()
    last_scale_time: float | None = None
    last_scale_down_time: float | None = None
    starvation_base_replicas: int | None = None
    idle_since: float | None = None
    requests_finished: float | None = None
    latency: LatencyModel | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable form (inverse of :meth:`from_dict`)."""
        return {
            "version": SCHEMA_VERSION,
            "demand": [[t, d] for t, d in self.demand],
            "recommendations": [[r.time, r.replicas, r.reactive] for r in self.recommendations],
            "lastScaleTime": self.last_scale_time,
            "lastScaleDownTime": self.last_scale_down_time,
            "starvationBaseReplicas": self.starvation_base_replicas,
            "idleSince": self.idle_since,
            "requestsFinished": self.requests_finished,
            "latency": None if self.latency is None else self.latency.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PolicyState:
        """Read what :meth:`to_dict` wrote. ``None`` or ``{}`` is a fresh state; a newer or
        malformed payload raises ValueError naming the problem (the caller should then
        start fresh rather than act on half-read history)."""
        if not data:
            return cls()
        version = data.get("version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"policy state version must be {SCHEMA_VERSION}; got {version!r}")
        try:
            demand = tuple((float(t), float(d)) for t, d in data.get("demand", ()))
            recs = tuple(
                Recommendation(float(t), _opt_int(r), _opt_int(x))
                for t, r, x in data.get("recommendations", ())
            )
            last_time = _opt_float(data.get("lastScaleTime"))
            last_down = _opt_float(data.get("lastScaleDownTime"))
            starvation_base = _opt_int(data.get("starvationBaseReplicas"))
            idle_since = _opt_float(data.get("idleSince"))
            finished = _opt_float(data.get("requestsFinished"))
            raw_latency = data.get("latency")
            latency = None if raw_latency is None else LatencyModel.from_dict(raw_latency)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed policy state {dict(data)!r}: {exc}") from exc
        for t, d in demand:
            if not (math.isfinite(t) and math.isfinite(d)):
                raise ValueError(f"malformed policy state: non-finite demand sample {(t, d)}")
        return cls(demand, recs, last_time, last_down, starvation_base, idle_since, finished,
                   latency)

    def pruned(self, now: float, demand_window: float, rec_window: float) -> PolicyState:
        """Drop what no window can use any more. Entries from the future (a clock that
        went backwards) are dropped too. For recommendations one entry at or before the
        window's start is kept, to prove the window is covered."""
        demand = tuple((t, d) for t, d in self.demand if now - demand_window <= t <= now)
        start = now - rec_window
        recs = [r for r in self.recommendations if r.time <= now]
        older = [r for r in recs if r.time <= start]
        kept = ([older[-1]] if older else []) + [r for r in recs if r.time > start]
        return replace(self, demand=demand, recommendations=tuple(kept))


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
