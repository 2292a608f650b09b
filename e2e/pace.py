"""How fast this machine runs the suite, measured when the session starts, and a record of
every wait.

The scenarios' bounds (``cluster.wait_for(..., 240, ...)``) were set where an engine pod
took :data:`REFERENCE_ENGINE_START_S` from scheduled to Ready. At the start of a session
the suite starts one small engine fleet and times its pod the same way
(``measure_pace`` in ``e2e/tests/conftest.py``); every bound is then multiplied by
``max(1, measured / reference)`` (:attr:`Pace.factor`), and so is each test's
pytest-timeout. A slower machine gets longer bounds, a faster one keeps them.

Every wait through ``Cluster.wait_for`` (the scenarios' waits, the node and operator at
start-up) is scaled and recorded (what, how long it took, its bound, whether it was met);
the control plane's and Prometheus's own start-up waits and the request timeouts of
clients are fixed. The session ends by writing ``waits.json`` to the work directory and
printing the waits that came closest to their bounds: the margin docs/e2e.md reports.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("e2e.pace")

# An engine pod of the small test fleet (SmolLM2, 0.05 GiB KV, 100m requested), from
# PodScheduled to Ready, where the scenarios' bounds hold with every wait under a quarter
# of its bound: 17 s and 21 s measured on the 2-core Xeon of docs/e2e.md "Timings".
REFERENCE_ENGINE_START_S = 20.0
# A factor the user forces (a known-slow machine, a debugger): KVPILOT_E2E_PACE=3.
PACE_ENV = "KVPILOT_E2E_PACE"


@dataclass
class Wait:
    what: str
    seconds: float
    bound: float
    met: bool
    test: str = ""


@dataclass
class Pace:
    """The measured start-up and the factor every bound is multiplied by."""

    engine_start_s: float | None = None
    forced: float | None = None
    waits: list[Wait] = field(default_factory=list)
    # Engine pods timed from PodScheduled to Ready: (what, seconds), e.g. a scale-up pod
    # that started on a node busy serving the load.
    pod_starts: list[tuple[str, float]] = field(default_factory=list)
    current_test: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def factor(self) -> float:
        if self.forced is not None:
            return self.forced
        if self.engine_start_s is None:
            return 1.0
        return max(1.0, self.engine_start_s / REFERENCE_ENGINE_START_S)

    def bound(self, seconds: float) -> float:
        """``seconds`` as tuned on the reference machine, on this one."""
        return seconds * self.factor

    def record(self, what: str, seconds: float, bound: float, met: bool) -> None:
        wait = Wait(what, round(seconds, 1), round(bound, 1), met, self.current_test)
        with self._lock:
            self.waits.append(wait)
        log.info("e2e: waited %.1f s of %.0f s for %s%s", seconds, bound, what,
                 "" if met else " (NOT MET)")

    def closest(self, n: int = 12) -> list[Wait]:
        """The ``n`` waits that used the largest share of their bounds."""
        return sorted(self.waits, key=lambda w: w.seconds / max(w.bound, 1e-9), reverse=True)[:n]

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({
            "engine_start_s": self.engine_start_s, "reference_engine_start_s":
            REFERENCE_ENGINE_START_S, "factor": self.factor, "pod_starts": self.pod_starts,
            "waits": [asdict(w) for w in self.waits]}, indent=2) + "\n")

    def summary(self) -> str:
        lines = [f"e2e pace: engine pod start {self.engine_start_s} s (reference "
                 f"{REFERENCE_ENGINE_START_S:.0f} s), bounds x{self.factor:.2f}; "
                 f"{len(self.waits)} waits, the closest to their bounds:"]
        for what, seconds in self.pod_starts:
            lines.insert(1, f"  engine pod scheduled -> Ready in {seconds:.0f} s: {what}")
        for w in self.closest():
            lines.append(f"  {w.seconds:7.1f} s of {w.bound:6.0f} s ({100 * w.seconds / max(w.bound, 1e-9):3.0f}%)"
                         f"{'' if w.met else ' NOT MET'}  {w.what}  [{w.test}]")
        return "\n".join(lines)


def from_env() -> Pace:
    """A Pace, forced by ``$KVPILOT_E2E_PACE`` when set.

    Raises:
        ValueError: the value is not a number from 0.1 to 100 (it names the variable)."""
    raw = os.environ.get(PACE_ENV)
    if not raw:
        return Pace()
    try:
        forced = float(raw)
    except ValueError:
        forced = -1.0
    if not 0.1 <= forced <= 100:  # also refuses nan and inf
        raise ValueError(f"{PACE_ENV}={raw!r}: must be a number from 0.1 to 100 (the factor "
                         "every e2e bound is multiplied by)")
    return Pace(forced=forced)


# The session's pace: set by the cluster fixture, read by pytest hooks and the helpers.
PACE = Pace()
