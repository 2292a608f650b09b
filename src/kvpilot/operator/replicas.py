"""How many engine pods a reconcile applies.

Two controllers must never fight over ``Deployment.spec.replicas`` (case C16):

* static (``spec.replicas``): the spec is the truth.
* neither field: the Deployment keeps its current count (1 when it is created). So removing
  ``autoscaling`` without writing ``replicas`` leaves the fleet as the autoscaler left it,
  as removing an HPA leaves its Deployment, instead of dropping it to one pod at once.
* autoscaling: the autoscaler is the truth. A reconcile keeps the Deployment's current
  count (clamped to [minReplicas, maxReplicas], e.g. after the bounds changed) and only an
  explicit ``requested`` count from the autoscaler timer moves it. A new Deployment
  starts at minReplicas.

The decision is written to the Deployment and to ``status`` only, never to the spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.operator.spec import InferenceSpec


@dataclass(frozen=True)
class ReplicaDecision:
    """Attributes:
        replicas: the count to apply.
        current: the Deployment's count before (None = no Deployment yet).
        reason: why ``replicas`` differs from ``current`` ("" when it does not).
    """

    replicas: int
    current: int | None
    reason: str

    @property
    def is_scale(self) -> bool:
        """True when an existing Deployment changes size (an Event and lastScaleTime)."""
        return self.current is not None and self.current != self.replicas


def decide_replicas(spec: InferenceSpec, current: int | None, requested: int | None = None,
                    requested_reason: str = "") -> ReplicaDecision:
    """The replica count for this reconcile.

    Args:
        spec: the validated spec.
        current: the Deployment's ``spec.replicas`` now (None = it does not exist).
        requested: the autoscaler's recommendation (ignored for static specs, whose
            count comes from the spec alone).
        requested_reason: the autoscaler's explanation, kept in the decision's reason.
    """
    if spec.autoscaling is None and spec.replicas is None:
        return ReplicaDecision(1 if current is None else current, current, "")
    static = spec.static_replicas
    if static is not None:
        reason = f"spec.replicas is {static}" if current is not None and current != static else ""
        return ReplicaDecision(static, current, reason)
    bounds = spec.autoscaling
    assert bounds is not None
    if requested is not None:
        base, why = requested, requested_reason or f"autoscaler recommends {requested}"
    elif current is not None:
        base, why = current, ""
    else:
        return ReplicaDecision(bounds.min_replicas, None, "")
    replicas = bounds.clamp(base)
    if replicas > base:
        why = f"raised to autoscaling.minReplicas={bounds.min_replicas}" + (f" ({why})" if why else "")
    elif replicas < base:
        why = f"capped at autoscaling.maxReplicas={bounds.max_replicas}" + (f" ({why})" if why else "")
    return ReplicaDecision(replicas, current, why if replicas != current else "")
