"""The operator's side of autoscaling: one loop per InferenceDeployment with
``spec.autoscaling`` that observes the fleet, reads its signals, asks the policy
(:mod:`kvpilot.autoscaler`) and applies the count through the reconcile.

=====================  ===========================================================
module                 job
=====================  ===========================================================
``plan``               pure: observation + reading + state -> the policy's decision
                       -> :class:`~.plan.AutoscalePlan` (count, status, events)
``loop``               the per-resource loop (a Kopf daemon): the I/O around ``plan``
``fleet``              Deployment + pods -> ready pods and pending supply
``activation``         scale to zero's signal: requests held at the router
``metrics_source/``    where signals come from: the pods' ``/metrics`` or Prometheus
=====================  ===========================================================
"""
