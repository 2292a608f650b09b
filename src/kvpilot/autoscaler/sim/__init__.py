"""Discrete-event fleet simulator (standard library only).

A fleet of engine replicas (KV capacity, engine steps whose time grows with the decode
rows and the prefill chunk, a start-up delay, preemption when the KV is full, a prefix
cache each) behind a router (``kv_aware``, ``session_affine``, ``random``, ``p2c_kv``)
serves a seedable trace while a scaling policy (ours, HPA-style on KV, KPA-style on the
queue or on concurrency, llm-d WVA's saturation analyzer) resizes it; :func:`simulate`
reports SLO attainment (TTFT and mean ITL per request), starvation, queueing delay,
replica-hours, the fleet's prefix hit rate and the requests per replica.
See docs/autoscaling.md for the model and its assumptions.
"""

from kvpilot.autoscaler.sim.compare import Scenario, compare
from kvpilot.autoscaler.sim.controllers import (
    HpaStylePolicy,
    KpaStylePolicy,
    KvPilotPolicy,
    SaturationPolicy,
    make_policy,
)
from kvpilot.autoscaler.sim.fleet import simulate
from kvpilot.autoscaler.sim.model import DEFAULT_ROUTING, ROUTINGS, ReplicaModel, SimConfig
from kvpilot.autoscaler.sim.report import SimResult
from kvpilot.autoscaler.sim.traces import TRACES, Request, Trace, make_trace

__all__ = [
    "DEFAULT_ROUTING",
    "ROUTINGS",
    "TRACES",
    "HpaStylePolicy",
    "KpaStylePolicy",
    "KvPilotPolicy",
    "ReplicaModel",
    "Request",
    "SaturationPolicy",
    "Scenario",
    "SimConfig",
    "SimResult",
    "Trace",
    "compare",
    "make_policy",
    "make_trace",
    "simulate",
]
