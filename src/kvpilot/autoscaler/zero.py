"""Scale to zero (``autoscaling.minReplicas: 0``): the two rules that move a fleet to and
from zero replicas. Pure, like the rest of the policy; :func:`kvpilot.autoscaler.decide`
calls them.

::

    current == 0   requests_without_engine > 0  -> UP to max(1, minReplicas)  [activation]
                   otherwise                    -> hold 0                     [scaled_to_zero]
    current >= 1   the ordinary policy decides (never below one replica), then:
                   idle for scaleToZeroAfterSeconds -> DOWN to 0             [scale_to_zero]

*Idle* is judged at every decision and must hold without a break: every ready pod reported
no running and no waiting request, the router holds none, no router attempt found no
engine, no pod is starting, and the engines' finished-request count has not moved since
the previous decision (a short request that started and ended between two reads still
counts as traffic). A missing signal, a router that cannot be read (the operator then
reports the count as unknown) or a pod that is still starting breaks the idle run: the
fleet never goes to zero on missing data. The run and the count are kept in the policy
state, so an operator restart continues them.

*Activation* needs the router to hold the request: with ``minReplicas: 0`` the operator
runs vllm-router with a retry schedule that lasts ``activationTimeoutSeconds``, and every
retry that finds no engine counts in ``vllm_router_request_errors_total{error_type=
"no_available_workers"}``, which the operator reads every second while the fleet is at zero
(:mod:`kvpilot.operator.autoscaling.activation`). The same design as Knative's activator and the KEDA
HTTP add-on's interceptor, with the router that is already in front of the engines.
"""

from __future__ import annotations

from dataclasses import replace

from kvpilot.autoscaler.decision import Decision, Proposal, bound
from kvpilot.autoscaler.signals import FleetLoad, FleetSignals
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState


def at_zero(signals: FleetSignals, load: FleetLoad, state: PolicyState, spec: AutoscalingSpec,
            now: float) -> Decision:
    """The decision for a fleet at zero replicas (none ready, none pending): activate when
    the router holds a request that found no engine, else stay at zero. The idle run and
    the finished count are cleared (the next engines count from their own start)."""
    state = replace(state, idle_since=None, requests_finished=None)
    waiting = signals.requests_without_engine
    if waiting > 0:
        proposal = Proposal(spec.floor, "activation", "requests_without_engine", waiting,
                            f"the router holds requests with no engine to send them to"
                            f" ({waiting:g} attempts found none): scaling from zero to"
                            f" {spec.floor}")
    else:
        proposal = Proposal(0, "scaled_to_zero", None, None,
                            "scaled to zero: no request is waiting; the router holds the next"
                            " one while an engine starts")
    return bound(proposal, 0, (), load, state, spec, now)


def is_idle(signals: FleetSignals, load: FleetLoad, previous_finished: float | None) -> bool:
    """True when nothing at all happened in the fleet since the previous decision (see the
    module docstring); False on any traffic and on any missing signal."""
    if signals.ready_replicas == 0 or signals.pending_replicas > 0:
        return False
    if any(p.num_running is None or p.num_waiting is None for p in signals.pods):
        return False
    if load.num_running > 0 or load.num_waiting > 0 or signals.requests_without_engine > 0:
        return False
    return (signals.requests_finished is not None and previous_finished is not None
            and signals.requests_finished == previous_finished)


def after_decision(decision: Decision, signals: FleetSignals, load: FleetLoad,
                   spec: AutoscalingSpec, now: float) -> Decision:
    """Track the idle run on the ordinary policy's ``decision`` (current >= 1) and turn it
    into a scale to zero once the fleet has been idle for ``scale_to_zero_after_seconds``
    (from any count: an idle fleet serves nobody). Otherwise ``decision`` with the idle run
    and the finished count recorded in its state."""
    state = decision.state
    if is_idle(signals, load, state.requests_finished):
        idle_since = state.idle_since if state.idle_since is not None else now
    else:
        idle_since = None
    state = replace(state, idle_since=idle_since, requests_finished=signals.requests_finished)
    idle_for = 0.0 if idle_since is None else now - idle_since
    if idle_since is None or idle_for < spec.scale_to_zero_after_seconds or decision.direction == "up":
        return replace(decision, state=state)
    proposal = Proposal(0, "scale_to_zero", "idle_seconds", idle_for,
                        f"no request for {idle_for:.0f} s (scaleToZeroAfterSeconds="
                        f"{spec.scale_to_zero_after_seconds:.0f}): scaling"
                        f" {decision.current_replicas} -> 0; the router holds the next request"
                        " while an engine starts")
    return bound(proposal, decision.current_replicas, decision.candidates, load,
                 replace(state, idle_since=None), spec, now)
