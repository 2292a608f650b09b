"""Kopf settings and handler registration (no module-level registration, so tests and the
process each build their own registry).

=====================================  ===============================================
trigger                                handler
=====================================  ===============================================
InferenceDeployment create/update/     :func:`~kvpilot.operator.handlers.lifecycle.on_spec`
resume
every ``--resync-seconds``             :func:`~kvpilot.operator.handlers.lifecycle.on_resync`
engine or router Deployment event      :func:`~kvpilot.operator.handlers.children.on_deployment_event`
                                       (restored when someone deleted or edited it)
engine or router Service event         :func:`~kvpilot.operator.handlers.children.on_service_event`
                                       (likewise: :mod:`kvpilot.operator.repair`)
engine pod event (watch)               :func:`~kvpilot.operator.handlers.pods.on_engine_pod_event`
                                       (restarts reported on the owner)
InferenceDeployment delete             :func:`~kvpilot.operator.handlers.lifecycle.on_delete`
``spec.autoscaling`` set (and          :func:`~kvpilot.operator.autoscaling.loop.autoscaler_daemon`
``engine`` not ``keda``)               (one loop per resource, every ``intervalSeconds``)
LoRA on (``spec.adapters`` or          :func:`~kvpilot.operator.adapters.loop.adapter_daemon`
``spec.engine.lora``)                  (adapters loaded and unloaded in the running
                                       pods every 30 s and after a spec change)
=====================================  ===============================================
"""

from __future__ import annotations

import logging

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.adapters.loop import adapter_daemon, has_lora
from kvpilot.operator.autoscaling.loop import autoscaler_daemon, has_autoscaling
from kvpilot.operator.handlers.children import on_deployment_event, on_service_event
from kvpilot.operator.handlers.lifecycle import on_delete, on_resync, on_spec
from kvpilot.operator.handlers.pods import on_engine_pod_event
from kvpilot.operator.options import OperatorOptions

# How long Kopf waits for the autoscaler daemon to finish its tick when stopping it.
DAEMON_CANCELLATION_TIMEOUT_SECONDS = 30.0


def configure(settings: kopf.OperatorSettings) -> None:
    """Kopf settings: our finalizer and annotations under kvpilot.dev, no peering objects
    (which replica acts is decided before Kopf starts, by the leader Lease of
    :mod:`kvpilot.operator.leader`), bounded watch timeouts."""
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=c.ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.peering.standalone = True
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 8


def register(registry: kopf.OperatorRegistry, options: OperatorOptions) -> None:
    """Attach the handlers to ``registry`` (no module-level registration, so tests and
    the process each build their own)."""
    resource = (c.GROUP, c.VERSION, c.PLURAL)
    # A fresh registry has no login handler (only Kopf's default one does): log in through
    # the kubernetes client, i.e. the in-cluster token or the kubeconfig.
    kopf.on.login(registry=registry, id="login-via-client")(kopf.login_via_client)
    kopf.on.startup(registry=registry, id="configure")(
        lambda settings, **_: configure(settings)
    )
    for cause, decorator in (("create", kopf.on.create), ("update", kopf.on.update),
                             ("resume", kopf.on.resume)):
        decorator(*resource, registry=registry, id=f"reconcile-{cause}")(on_spec)
    kopf.timer(*resource, registry=registry, id="resync", interval=options.resync_seconds,
               initial_delay=options.resync_seconds)(on_resync)
    kopf.on.event("apps", "v1", "deployments", registry=registry, id="child-deployment",
                  labels={c.LABEL_MANAGED_BY: c.FIELD_MANAGER})(on_deployment_event)
    kopf.on.event("", "v1", "services", registry=registry, id="child-service",
                  labels={c.LABEL_MANAGED_BY: c.FIELD_MANAGER})(on_service_event)
    # Engine pods: their restarts are reported on the owner (watch only; nothing is
    # written to the pods, so no progress or diff-base annotations on them).
    kopf.on.event("", "v1", "pods", registry=registry, id="engine-restarts",
                  labels={c.LABEL_MANAGED_BY: c.FIELD_MANAGER,
                          c.LABEL_COMPONENT: c.ENGINE_COMPONENT})(on_engine_pod_event)
    kopf.on.delete(*resource, registry=registry, id="forget", optional=True)(on_delete)
    kopf.daemon(*resource, registry=registry, id="autoscaler", when=has_autoscaling,
                cancellation_timeout=DAEMON_CANCELLATION_TIMEOUT_SECONDS)(autoscaler_daemon)
    kopf.daemon(*resource, registry=registry, id="adapters", when=has_lora,
                cancellation_timeout=DAEMON_CANCELLATION_TIMEOUT_SECONDS)(adapter_daemon)
