"""Writing an InferenceDeployment's ``status`` when more than one writer owns it.

Three writers touch ``status.conditions``: the reconcile handlers (``Ready``,
``Progressing``), the Deployment watch (the same two, refreshed) and the autoscaler loop
(``MetricsAvailable``, ``ScalingActive``, ``ScalingLimited``, plus the reconcile's two when
it resizes). A JSON merge patch replaces a list whole, so a writer that built its list from
a body read before another writer's patch would erase that writer's conditions (seen in
tests: ``MetricsAvailable`` vanished right after the autoscaler wrote it).

:func:`write_status` closes the race the way a controller does without strategic merge:
read the object, put only the condition types this writer owns into the *fresh* list
(every other type is kept as stored, whatever the writer's own copy of it said), and patch
with the read ``resourceVersion`` as a precondition; a 409 means someone wrote in between,
so read and merge again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.api import ConflictError, KubeApi
from kvpilot.operator.status.conditions import merge_conditions

# Read-merge-patch rounds before a conflict is reported to the caller (who retries later).
STATUS_CONFLICT_ATTEMPTS = 5


def write_status(api: KubeApi, namespace: str, name: str, status: Mapping[str, Any],
                 owned: Collection[str], drop: Collection[str] = ()) -> bool:
    """Merge-patch ``status`` onto the stored object without erasing others' conditions.

    ``status`` is a status merge patch; of its ``conditions`` only the types in ``owned``
    (those this writer decides) are written, and the types in ``drop`` are removed (a
    patch with ``drop`` and no ``conditions`` key still removes them). Returns False when
    the object is gone.

    Raises:
        ConflictError: still conflicting after STATUS_CONFLICT_ATTEMPTS rounds.
        ApiError: any other failure of the GET or the PATCH.
    """
    for attempt in range(1, STATUS_CONFLICT_ATTEMPTS + 1):
        current = api.get(c.API_VERSION, c.KIND, namespace, name)
        if current is None:
            return False
        patch = dict(status)
        stored = (current.get("status") or {}).get("conditions")
        if "conditions" in patch:
            patch["conditions"] = merge_conditions(stored, patch["conditions"], owned, drop)
        elif any(cond.get("type") in drop for cond in stored or ()):
            patch["conditions"] = merge_conditions(stored, (), (), drop)
        version = (current.get("metadata") or {}).get("resourceVersion")
        try:
            api.patch_status(namespace, name, patch, resource_version=version)
            return True
        except ConflictError:
            if attempt == STATUS_CONFLICT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")
