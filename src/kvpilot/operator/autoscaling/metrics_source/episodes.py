"""Log a failing metric source once per episode, not once per pod per tick.

An episode starts when a key (e.g. ``llm/chat prometheus``) first fails and ends when it
next succeeds. The start is a WARNING with the first message, the end an INFO line saying
how long it lasted; repeats in between go to DEBUG. A source polled every 15 s for an
hour of Prometheus downtime therefore logs two lines, not 240 (or 240 x pods).
"""

from __future__ import annotations

import threading

from kvpilot.operator.logs import ObjectLog


class EpisodeLog:
    """Thread-safe; one per source instance (keys are free-form strings)."""

    def __init__(self, logger: ObjectLog) -> None:
        self._logger = logger
        self._open: dict[str, float] = {}
        self._lock = threading.Lock()

    def failing(self, key: str, message: str, now: float) -> bool:
        """Record a failure of ``key`` at ``now`` (seconds); True when it starts an episode
        (and was logged as a warning)."""
        with self._lock:
            started = key not in self._open
            if started:
                self._open[key] = now
        if started:
            self._logger.warning("%s: %s (logged once until it recovers)", key, message)
        else:
            self._logger.debug("%s: still failing: %s", key, message)
        return started

    def ok(self, key: str, now: float) -> bool:
        """Record a success of ``key``; True when it ends an episode (logged at INFO)."""
        with self._lock:
            since = self._open.pop(key, None)
        if since is not None:
            self._logger.info("%s: recovered after %.0f s", key, max(0.0, now - since))
        return since is not None

    def is_failing(self, key: str) -> bool:
        with self._lock:
            return key in self._open
