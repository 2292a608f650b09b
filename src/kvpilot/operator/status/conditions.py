"""Status conditions (the metav1.Condition shape) as plain, immutable updates.

A condition's ``lastTransitionTime`` changes only when its ``status`` changes; reason and
message may change without a transition. Conditions of types an update does not touch
are kept (:func:`set_conditions`), and a writer replaces only the types it owns in the
stored list (:func:`merge_conditions`), so the reconcile loop and the autoscaler loop each
own their types without erasing the other's.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvpilot.operator.constants import CONDITION_TYPES

STATUSES = ("True", "False", "Unknown")


@dataclass(frozen=True)
class Condition:
    """One condition to set. ``type`` in CONDITION_TYPES, ``status`` in STATUSES."""

    type: str
    status: str
    reason: str
    message: str

    def __post_init__(self) -> None:
        if self.type not in CONDITION_TYPES:
            raise ValueError(f"condition type must be one of {CONDITION_TYPES}; got {self.type!r}")
        if self.status not in STATUSES:
            raise ValueError(f"condition status must be one of {STATUSES}; got {self.status!r}")
        if not self.reason or not self.reason[0].isupper() or not self.reason.isalnum():
            raise ValueError(f"condition reason must be CamelCase letters/digits; got {self.reason!r}")


def set_conditions(existing: Iterable[Mapping[str, Any]] | None, updates: Iterable[Condition],
                   now: datetime, generation: int | None) -> list[dict[str, Any]]:
    """The full new ``status.conditions`` list (a merge patch replaces lists whole).

    ``generation`` None (an update not caused by a spec change) keeps each condition's
    previous ``observedGeneration``. Returns a new list sorted in CONDITION_TYPES order;
    ``existing`` is not mutated.
    """
    by_type = {c["type"]: dict(c) for c in existing or () if c.get("type") in CONDITION_TYPES}
    stamp = to_rfc3339(now)
    for update in updates:
        old = by_type.get(update.type)
        new: dict[str, Any] = {"type": update.type, "status": update.status, "reason": update.reason,
               "message": update.message}
        new["lastTransitionTime"] = (
            old["lastTransitionTime"]
            if old and old.get("status") == update.status and old.get("lastTransitionTime")
            else stamp
        )
        if generation is not None:
            new["observedGeneration"] = generation
        elif old and "observedGeneration" in old:
            new["observedGeneration"] = old["observedGeneration"]
        by_type[update.type] = new
    return [by_type[t] for t in CONDITION_TYPES if t in by_type]


def merge_conditions(stored: Iterable[Mapping[str, Any]] | None,
                     written: Iterable[Mapping[str, Any]],
                     owned: Collection[str], drop: Collection[str] = ()) -> list[dict[str, Any]]:
    """``stored`` with each condition of ``written`` whose type is in ``owned`` replacing
    the stored one of its type, and the types in ``drop`` (owned ones the writer says no
    longer apply, e.g. RouterReady once the router is disabled) removed.

    Other types keep their stored entry (``written``'s copies of them are ignored); the
    result is in CONDITION_TYPES order, like
    :func:`set_conditions`. No input is mutated.
    """
    by_type = {cond["type"]: dict(cond) for cond in stored or () if cond.get("type")}
    by_type.update({cond["type"]: dict(cond) for cond in written if cond.get("type") in owned})
    for type_ in drop:
        by_type.pop(type_, None)
    known = [by_type.pop(t) for t in CONDITION_TYPES if t in by_type]
    return known + [by_type[t] for t in sorted(by_type)]


def to_rfc3339(now: datetime) -> str:
    """``now`` (timezone-aware) as an RFC 3339 UTC timestamp with seconds precision."""
    if now.tzinfo is None:
        raise ValueError(f"timestamps must be timezone-aware; got naive {now!r}")
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
