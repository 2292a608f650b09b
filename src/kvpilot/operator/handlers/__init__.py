"""The Kopf handlers, thin over :func:`kvpilot.operator.reconcile.reconcile`, one module
per concept. Which trigger calls which handler: the table in
:mod:`kvpilot.operator.registration`.

=============  ==================================================================
module         handles
=============  ==================================================================
``context``    :class:`~.context.OperatorContext`, the ``memo`` every handler gets
``lifecycle``  the InferenceDeployment: create/update/resume, the resync timer,
               delete; refusals and retries
``children``   the engine's and the router's Deployments and Services: repairs
               and status refreshes
``pods``       the engine pods: restarts reported on their owner
=============  ==================================================================

The autoscaler's per-resource daemon is :mod:`kvpilot.operator.autoscaling.loop`.

Handlers return None and write ``status`` themselves
(:mod:`kvpilot.operator.status.writer`: each writer owns its condition types, under a
resourceVersion precondition), so Kopf stores nothing there (its progress lives in
``kvpilot.dev/`` annotations), and nothing here writes ``spec``.
"""
