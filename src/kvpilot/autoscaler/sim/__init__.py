"""Discrete-event fleet simulator (standard library only).

A fleet of engine replicas (KV capacity, prefill and decode rates, start-up delay,
preemption when the KV is full) serves a seedable trace while a scaling policy (ours, an
HPA-style one, a KPA-style one) resizes it; :func:`simulate` reports starvation, queueing
delay and replica-hours for each. See docs/autoscaling.md for the model and its assumptions.
"""

from kvpilot.autoscaler.sim.compare import Scenario, compare
from kvpilot.autoscaler.sim.controllers import (
    HpaStylePolicy,
    KpaStylePolicy,
    KvPilotPolicy,
    make_policy,
)
from kvpilot.autoscaler.sim.fleet import simulate
from kvpilot.autoscaler.sim.model import ReplicaModel, SimConfig
from kvpilot.autoscaler.sim.report import SimResult
from kvpilot.autoscaler.sim.traces import TRACES, Trace, make_trace

__all__ = [
    "TRACES",
    "HpaStylePolicy",
    "KpaStylePolicy",
    "KvPilotPolicy",
    "ReplicaModel",
    "Scenario",
    "SimConfig",
    "SimResult",
    "Trace",
    "compare",
    "make_policy",
    "make_trace",
    "simulate",
]
