"""Node headroom: how many placeholder pods to keep so that the cluster autoscaler adds
GPU nodes *before* the engine pods need them.

A new engine pod waits for a node when none has room, and a GPU node takes minutes more
than a pod to arrive (``node_startup_seconds``: VM boot, driver, device plugin, image
pull). The pod forecast (:func:`kvpilot.autoscaler.rules.forecast`) looks one pod
start-up ahead; this looks one node start-up plus one pod start-up ahead, and keeps
``need - desired`` low-priority placeholder pods, each asking for what one engine pod asks,
and at most ``desired`` of them (:data:`MAX_HEADROOM_RATIO`).
The cluster autoscaler sees them pending and adds nodes; when the engine pods come, the
scheduler preempts the placeholders (their PriorityClass is below the engines') and the
engines start on a node that is already there. This is the cluster autoscaler's own
"overprovisioning" recipe (its FAQ: "How can I configure overprovisioning with Cluster
Autoscaler?"), sized by our forecast instead of a fixed count.

``need`` is the KV demand trend (:func:`kvpilot.autoscaler.forecast.fit_trend` over the
same settled samples the pod forecast uses) extrapolated over that horizon at the lower
95% bound of its slope, at the target usage, when that bound is above zero and the rise
still goes on; else the current demand. Placeholders go up at once and come down only after
``scale_down_stabilization_seconds`` of lower answers (a node taken back costs another
``node_startup_seconds`` to get again).

Pure: :func:`headroom` reads its arguments and returns the next :class:`HeadroomState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.autoscaler.forecast import fit_trend, still_rising
from kvpilot.autoscaler.latency import ceil_replicas
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState
from kvpilot.autoscaler.windows import settled_demand

# Placeholders at most this many times the engine replicas just decided (at least one): at
# the onset of a rise, a two-minute trend extrapolated over a node plus a pod start-up
# overshoots, and every node asked for in vain is paid for its start-up plus the cluster
# autoscaler's ten idle minutes. With a 300 s node start-up (benchmarks/node_headroom.py,
# peak 20, seeds 1-3): no cap 0.06x starvation at 1.18x node-hours on the ramp; 1.0 gives
# 0.08x at 1.12x (burst 0.44x at 0.99x); 1.5 gives 1.16x; 0.5 costs the burst 0.51x.
MAX_HEADROOM_RATIO = 1.0


@dataclass(frozen=True)
class HeadroomState:
    """Placeholders kept, and since when the answer has been lower (None = not lower).

    Attributes:
        replicas: placeholder pods to keep (>= 0).
        lower_since: the first time, in the policy's clock, of the current run of answers
            below ``replicas`` (None while the answer is not lower).
        reason: one sentence with the numbers.
    """

    replicas: int = 0
    lower_since: float | None = None
    reason: str = "no forecast yet"

    def to_dict(self) -> dict[str, object]:
        return {"replicas": self.replicas, "lowerSince": self.lower_since, "reason": self.reason}

    @classmethod
    def from_dict(cls, raw: object) -> HeadroomState:
        """Inverse of :meth:`to_dict`; anything unreadable is the initial state."""
        if not isinstance(raw, dict):
            return cls()
        replicas, since = raw.get("replicas"), raw.get("lowerSince")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            return cls()
        since = float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else None
        return cls(replicas, since, str(raw.get("reason", "")))


def headroom(policy_state: PolicyState, spec: AutoscalingSpec, desired: int, now: float,
             node_startup_seconds: float, previous: HeadroomState) -> HeadroomState:
    """Placeholder pods to keep after the policy chose ``desired`` engine replicas.

    Args:
        policy_state: the autoscaler's state after this interval's decision (its KV demand
            samples, in replica-equivalents).
        spec: the autoscaling spec (target usage, bounds, windows, pod start-up).
        desired: the engine replicas just decided.
        now: the policy's clock, seconds.
        node_startup_seconds: how long a new node takes to be ready for pods (> 0).
        previous: what the last call returned (``HeadroomState()`` the first time).
    Returns:
        The next state; ``replicas`` never exceeds ``spec.max_replicas - desired`` nor
        ``max(1, desired)``.
    Raises:
        ValueError: ``node_startup_seconds`` not positive.
    """
    if not node_startup_seconds > 0:
        raise ValueError(f"node_startup_seconds must be > 0; got {node_startup_seconds}")
    horizon = node_startup_seconds + spec.forecast_horizon_seconds
    settled = settled_demand(policy_state.demand, policy_state, spec)
    trend = fit_trend(settled, now)
    if trend is None:
        need, why = desired, "not enough demand history for a trend"
    else:
        rising = trend.cautious_slope > 0 and still_rising(settled, now, spec.forecast_window_seconds)
        # The slope's lower 95% bound, not the fitted slope: a node held for nothing costs
        # a node-hour, and over a node's start-up the fitted slope of a burst overshoots
        # (benchmarks/README-autoscaler.md, "Node headroom": 1.25x the node-hours for
        # 0.15x the starvation, against 1.21x for 0.36x with the bound).
        ahead = trend.level + trend.cautious_slope * horizon if rising else trend.level
        need = ceil_replicas(ahead / spec.target_cache_usage)
        why = (f"KV demand {trend.level:.2f} replica-eq rising at least {trend.cautious_slope * 60:+.3f}/min "
               f"reaches {ahead:.2f} in {horizon:.0f} s (a node, then a pod)" if rising else
               f"KV demand {trend.level:.2f} replica-eq, no significant rise")
    spare = max(0, min(need, spec.max_replicas) - desired)
    cap = max(1, math.ceil(MAX_HEADROOM_RATIO * desired))
    capped = spare > cap
    spare = min(spare, cap)
    reason = (f"{why}: {need} replicas needed, {desired} decided, {spare} placeholder(s)"
              + (f" (at most {MAX_HEADROOM_RATIO:g} x the replicas decided)" if capped else ""))
    if spare >= previous.replicas:
        return HeadroomState(spare, None, reason)
    since = previous.lower_since if previous.lower_since is not None else now
    if now - since >= spec.scale_down_stabilization_seconds:
        return HeadroomState(spare, None, reason)
    return HeadroomState(previous.replicas, since,
                         f"{reason}; keeping {previous.replicas} until the answer has been lower for "
                         f"{spec.scale_down_stabilization_seconds:.0f} s")
