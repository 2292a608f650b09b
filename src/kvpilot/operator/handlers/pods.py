"""The watch of the engine pods: container restarts reported on their
InferenceDeployment (:mod:`kvpilot.operator.restarts`). Nothing is written to the pods."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.api import ApiError
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.logs import object_ref


def on_engine_pod_event(body: kopf.Body, type: str | None, memo: OperatorContext,
                        **_: Any) -> None:
    """An engine pod changed: report each container restart seen since the last event as
    a Warning Event ``EngineRestarted`` on its InferenceDeployment, counted by reason in
    ``kvpilot_operator_engine_restarts_total`` (:mod:`kvpilot.operator.restarts`). A
    failed read of the owner is logged, not retried: the restart is still counted."""
    if type == "DELETED":
        memo.restarts.forget(body)
        return
    restarts = memo.restarts.observe(body)
    if not restarts:
        return
    meta = body.get("metadata", {})
    name, namespace = (meta.get("labels") or {}).get(c.LABEL_OWNER), meta.get("namespace")
    if not name or not namespace:
        return
    for restart in restarts:
        memo.metrics.count_restarts(namespace, name, restart.reason, restart.added)
    try:
        owner = memo.api.get(c.API_VERSION, c.KIND, namespace, name)
    except ApiError as exc:
        logging.getLogger(__name__).warning("engine restart on %s/%s not posted: %s",
                                            namespace, name, exc, extra=object_ref(namespace, name))
        return
    if owner is not None:
        for restart in restarts:
            memo.post_event(owner, "Warning", "EngineRestarted", restart.message())
