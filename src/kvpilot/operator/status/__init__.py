"""``status`` of an InferenceDeployment: what each writer owns, and how it is written.

===================  ============================================  ==========================
module               owns                                          written by
===================  ============================================  ==========================
``workload``         replicas, readyReplicas, desiredReplicas,     the reconcile handlers and
                     selector, observedGeneration; Ready,          the Deployment watch
                     Progressing (``failure_status`` on a spec
                     or object the operator cannot apply)
``autoscaler``       signals, capacity, cost, autoscaler           the autoscaler loop
                     (lastDecision, policyState); MetricsAvailable,
                     ScalingActive, ScalingLimited, and the Events
                     on their transitions
``conditions``       the metav1.Condition shape: set (transition
                     times kept), merge by owned type, timestamps
``writer``           :func:`~kvpilot.operator.status.writer.write_status`: read,
                     merge the writer's own condition types into the fresh list, patch
                     under a resourceVersion precondition, retry on 409
===================  ============================================  ==========================

``lastScaleTime``/``lastScaleReason`` come with a resize, from
:func:`kvpilot.operator.reconcile.scale_status`. Every builder here is pure; only
``writer`` talks to the API. Nothing ever writes ``spec``.
"""
