"""The adapter sync's per-resource loop, a Kopf daemon like the autoscaler's (so it runs
only in the operator that holds the leader Lease, and stops with the resource).

Kopf starts it for an InferenceDeployment with LoRA on (``spec.adapters`` not empty, or
``spec.engine.lora`` set) and stops it when LoRA is turned off (the reconcile then drops
``status.adapters`` and AdaptersReady). A round (:mod:`.sync`) runs at once, then every
:data:`SYNC_SECONDS`, and within :data:`POLL_SECONDS` of a spec change (a new
``metadata.generation``), so an edited adapter list reaches the running pods in seconds,
not at the next round. A new pod loads the list itself before it is ready; the rounds
only correct running ones.

After each round the loop writes ``status.adapters``, ``status.adaptersReady`` and the
AdaptersReady condition when they changed, and posts a Warning Event
``AdapterLoadFailed`` (pod, adapter, the engine's message) once per distinct failure: a
load that keeps failing the same way is not reported every round.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.adapters.engine_api import EngineAdapterApi
from kvpilot.operator.adapters.sync import AdaptersReport, adapters_status, api_key, sync_fleet
from kvpilot.operator.api import ApiError
from kvpilot.operator.autoscaling.fleet import fleet_from
from kvpilot.operator.builders.labels import selector_labels
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.logs import object_logger
from kvpilot.operator.reconcile import Resource
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.status.conditions import set_conditions
from kvpilot.operator.status.writer import write_status

SYNC_SECONDS = 30.0
POLL_SECONDS = 1.0
DAEMON_CANCELLATION_TIMEOUT_SECONDS = 30.0
_log = logging.getLogger(__name__)


class AdapterSync:
    """One resource's sync between rounds: the engine API client (rebuilt when the API
    key changes), the status last written and the failures already reported.

    Args:
        ctx: API, clock and Events.
        body: the InferenceDeployment as first seen.
        api_factory: makes the engine client for an API key (tests pass a mock transport).
    """

    def __init__(self, ctx: OperatorContext, body: Mapping[str, Any],
                 api_factory: Callable[..., EngineAdapterApi] = EngineAdapterApi) -> None:
        meta = body.get("metadata") or {}
        self.ctx = ctx
        self._log = object_logger(_log, meta.get("namespace"), meta.get("name"))
        self._factory = api_factory
        self._api: EngineAdapterApi | None = None
        self._key: str | None = None
        self._written: dict[str, Any] | None = None
        self._reported: set[tuple[str, str, str]] = set()

    def close(self) -> None:
        if self._api is not None:
            self._api.close()
            self._api = None

    def _engine_api(self, key: str | None) -> EngineAdapterApi:
        if self._api is None or key != self._key:
            self.close()
            self._api, self._key = self._factory(api_key=key), key
        return self._api

    def run(self, body: Mapping[str, Any]) -> AdaptersReport | None:
        """One round: list the ready pods, sync them, write status, post Events. None when
        the spec is invalid (the reconcile reports it) or has LoRA off. Raises ApiError."""
        resource = Resource.from_body(body)
        try:
            spec = parse_spec(resource.spec)
        except SpecError:
            return None
        if not spec.lora_enabled:
            return None
        pods = self.ctx.api.list_pods(resource.namespace, selector_labels(resource.name))
        ready = fleet_from(None, pods).ready
        results = sync_fleet(self._engine_api(api_key(spec)), ready, spec.adapters)
        for result in results:
            for change in result.changes:
                self._log.info("adapters: %s on %s", change, result.pod)
        report = adapters_status(spec.adapters, results)
        self._write(resource, report)
        self._post(body, report)
        return report

    def _write(self, resource: Resource, report: AdaptersReport) -> None:
        base = resource.status.get("conditions")
        if self._written is not None:
            base = self._written.get("conditions") or base
        status = dict(report.status)
        status["conditions"] = set_conditions(base, [report.condition], self.ctx.clock(), None)
        if status == self._written:
            return
        write_status(self.ctx.api, resource.namespace, resource.name, status,
                     (c.ADAPTERS_CONDITION,))
        self._written = status

    def _post(self, body: Mapping[str, Any], report: AdaptersReport) -> None:
        current = set(report.failures)
        for pod, name, message in report.failures:
            if (pod, name, message) not in self._reported:
                self.ctx.post_event(body, "Warning", "AdapterLoadFailed",
                                    f"adapter {name} on pod {pod}: {message}")
        self._reported = current

    def run_safely(self, body: Mapping[str, Any]) -> None:
        """:meth:`run`, logging failures: the daemon must never exit (Kopf would not
        restart it); the next round tries again."""
        try:
            self.run(body)
        except (ApiError, kopf.TemporaryError) as exc:
            self._log.warning("adapter sync: %s: %s", type(exc).__name__, exc)
        except Exception:  # a bug must not stop the sync for good
            self._log.exception("adapter sync: unexpected error")


def has_lora(spec: Mapping[str, Any], **_: Any) -> bool:
    """Kopf ``when`` filter: LoRA on (``spec.adapters`` not empty or ``engine.lora`` set)."""
    engine = spec.get("engine")
    return bool(spec.get("adapters")) or (isinstance(engine, Mapping) and engine.get("lora") is not None)


def _revision(body: Mapping[str, Any]) -> Any:
    return (body.get("metadata") or {}).get("generation")


async def adapter_daemon(stopped: kopf.DaemonStopped, body: kopf.Body, memo: OperatorContext,
                         **_: Any) -> None:
    """Kopf daemon: a round now, every SYNC_SECONDS, and soon after each spec change.
    The blocking work (the API, the engines) runs in a worker thread."""
    sync = AdapterSync(memo, copy.deepcopy(dict(body)))
    last: Any = object()
    due = 0.0
    try:
        while not stopped:
            if _revision(body) != last or time.monotonic() >= due:
                snapshot = copy.deepcopy(dict(body))  # the live body may change under a thread
                last = _revision(snapshot)
                await asyncio.to_thread(sync.run_safely, snapshot)
                due = time.monotonic() + SYNC_SECONDS
            await stopped.wait(POLL_SECONDS)
    finally:
        sync.close()
