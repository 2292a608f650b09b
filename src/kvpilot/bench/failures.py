"""Did a run's requests fail? One count for ``kvpilot bench serve``'s exit status and for
the scripts that read its result JSON (the e2e scenarios, ``benchmarks/``).

Counted over every request class of the result's ``by_class`` (the dataset's and the
background streams'):

- failed: sent and failed (HTTP error, error event, broken stream, request timeout, still
  running at the run's ``--timeout``);
- not sent: planned but never sent (a multi-turn session stops at its first failed turn;
  the run's ``--timeout`` stops the arrivals);
- total: every request planned or sent (completed + failed + cancelled + not sent).

Both failed and not-sent requests are work the run did not do, so both count against
``--max-failed-ratio``. The keys are read strictly: a result without them raises
``KeyError`` rather than reading as "no failures".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Failures:
    failed: int
    not_sent: int
    total: int
    first_error: str | None  # the first distinct error message, if any request failed

    @property
    def unfinished(self) -> int:
        """Requests that failed or were never sent."""
        return self.failed + self.not_sent

    @property
    def ratio(self) -> float:
        """``unfinished / total`` (0 when nothing was planned)."""
        return self.unfinished / self.total if self.total else 0.0

    def exceeds(self, max_ratio: float) -> bool:
        """True when some request is unfinished and their share is above ``max_ratio``."""
        return self.unfinished > 0 and self.ratio > max_ratio

    def describe(self) -> str:
        """``"3 of 40 requests failed and 2 were not sent (12.5%); first error: ..."``."""
        text = f"{self.failed} of {self.total} requests failed"
        if self.not_sent:
            text += f" and {self.not_sent} {'was' if self.not_sent == 1 else 'were'} not sent"
        text += f" ({100 * self.ratio:.1f}%)"
        if self.first_error:
            text += f"; first error: {self.first_error}"
        return text


def count_failures(result: Mapping[str, Any]) -> Failures:
    """The failures of a result JSON (``BenchResult.to_json()``, or a ``--result-json``
    file loaded with ``json.load``)."""
    by_class = result["by_class"]
    if not by_class:
        raise ValueError("the result has no request class (by_class is empty)")
    failed = not_sent = total = 0
    for summary in by_class.values():
        failed += int(summary["requests_failed"])
        # only the workload's classes plan requests; background streams have no such key
        unsent = int(summary.get("requests_not_sent", 0))
        not_sent += unsent
        total += (int(summary["requests_completed"]) + int(summary["requests_failed"])
                  + int(summary["requests_cancelled"]) + unsent)
    errors = result.get("errors") or []
    return Failures(failed, not_sent, total, str(errors[0]["error"]) if errors else None)
