"""Scaling policy and fleet simulator. Standard library only: the policy is a pure
function of its inputs (the clock is passed in), so anyone can test it.

The operator's timer calls :func:`decide` once per ``intervalSeconds``::

    decision = decide(FleetSignals(pods, pending_replicas), state, spec, now)
    # write decision.desired_replicas to the Deployment, decision.reason to an Event,
    # decision.state.to_dict() to status, decision.limited to ScalingLimited.
"""

from kvpilot.autoscaler.policy import Decision, decide
from kvpilot.autoscaler.rules import Candidate
from kvpilot.autoscaler.signals import (
    FleetLoad,
    FleetSignals,
    LatencyWindow,
    PodSignals,
    aggregate,
    counter_rate,
)
from kvpilot.autoscaler.spec import AutoscalingSpec, MetricsSourceSpec, SloSpec
from kvpilot.autoscaler.state import PolicyState, Recommendation

__all__ = [
    "AutoscalingSpec",
    "Candidate",
    "Decision",
    "FleetLoad",
    "FleetSignals",
    "LatencyWindow",
    "MetricsSourceSpec",
    "PodSignals",
    "PolicyState",
    "Recommendation",
    "SloSpec",
    "aggregate",
    "counter_rate",
    "decide",
]
