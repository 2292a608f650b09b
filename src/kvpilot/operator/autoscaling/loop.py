"""The autoscaler's per-resource loop: read the fleet and its metrics, decide, apply.

One :class:`AutoscalerLoop` per InferenceDeployment with ``spec.autoscaling``, driven by
the Kopf daemon :func:`autoscaler_daemon` (Kopf starts it when ``autoscaling`` is set and
stops it when it is removed or the object goes). Every ``intervalSeconds``::

    observe_fleet (GET Deployment, LIST pods, LIST router pods)
    -> source.read(ready pods, ready routers)
       (+ with minReplicas 0: the routers' attempts that found no engine, ActivationProbe)
    -> plan_autoscale (pure; the policy's decide())  ->  run_reconcile(requested=N) if the
       policy moved the count  ->  write_status (signals, capacity, cost, autoscaler, its
       conditions)  ->  Events

State that must survive an operator restart lives on the object: ``status.autoscaler
.policyState`` (the policy's history, last scale times) and ``lastDecision.time`` (so a
restarted loop waits out the interval instead of deciding twice). The loop also keeps both
in memory, because the body Kopf hands it may lag behind its own last status write.
A restart in the middle of a scale-up cannot scale twice: the Deployment's count is read
back and the pods not ready yet count as pending supply (:mod:`kvpilot.operator.autoscaling.fleet`).

Scale to zero (``minReplicas: 0``): while the last decision left the fleet at zero, every
:data:`~kvpilot.operator.autoscaling.activation.POLL_SECONDS` between intervals the loop lists the
router pods and polls their count of attempts that found no engine; any increase runs an
interval at once, whose policy activates the fleet (:mod:`kvpilot.autoscaler.zero`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import kopf

from kvpilot.autoscaler import PolicyState
from kvpilot.autoscaler.headroom import HeadroomState, headroom
from kvpilot.operator import constants as c
from kvpilot.operator.api import ApiError
from kvpilot.operator.autoscaling.activation import POLL_SECONDS, ActivationProbe
from kvpilot.operator.autoscaling.fleet import observe_fleet, observe_routers
from kvpilot.operator.autoscaling.metrics_source import MetricsSource, SourceConfig
from kvpilot.operator.autoscaling.metrics_source.episodes import EpisodeLog
from kvpilot.operator.autoscaling.plan import AutoscalePlan, plan_autoscale
from kvpilot.operator.builders.headroom import build_headroom_deployment
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import ReconcileRefused, run_reconcile
from kvpilot.operator.logs import ObjectLog, object_logger
from kvpilot.operator.reconcile import Resource
from kvpilot.operator.spec import InferenceSpec, SpecError, parse_spec
from kvpilot.operator.status.conditions import set_conditions
from kvpilot.operator.status.writer import write_status

# How soon to look again when there is nothing to decide on (invalid spec, no Deployment)
# or the last attempt failed.
RETRY_SECONDS = 5.0
# A tick this close to the interval counts as due (timers are not exact).
DUE_SLACK_SECONDS = 0.05
_log = logging.getLogger(__name__)


def state_from_status(status: Mapping[str, Any], log: ObjectLog = _log) -> PolicyState:
    """``status.autoscaler.policyState``; a malformed or newer one starts fresh (logged to
    ``log``): acting on half-read history is worse than rebuilding it over one window."""
    raw = (status.get("autoscaler") or {}).get("policyState")
    try:
        return PolicyState.from_dict(raw)
    except ValueError as exc:
        log.warning("ignoring stored autoscaler state, starting fresh: %s", exc)
        return PolicyState()


def last_desired_replicas(status: Mapping[str, Any]) -> int | None:
    """``status.autoscaler.lastDecision.desiredReplicas``, or None."""
    value = ((status.get("autoscaler") or {}).get("lastDecision") or {}).get("desiredReplicas")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def last_decision_time(status: Mapping[str, Any]) -> float | None:
    """``status.autoscaler.lastDecision.time`` as Unix seconds, or None."""
    stamp = ((status.get("autoscaler") or {}).get("lastDecision") or {}).get("time")
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class AutoscalerLoop:
    """One resource's autoscaler between decisions.

    Holds the policy state, the time of the last decision and the metric source (the pods
    source keeps counter samples for its rates). Not thread-safe: one tick at a time.

    Args:
        ctx: API, clock, Events, metrics and the source factory.
        body: the InferenceDeployment as first seen (its status seeds the state).
    """

    def __init__(self, ctx: OperatorContext, body: Mapping[str, Any]) -> None:
        self.ctx = ctx
        status = body.get("status") or {}
        meta = body.get("metadata") or {}
        self._log = object_logger(_log, meta.get("namespace"), meta.get("name"))
        self.state = state_from_status(status, self._log)
        self.headroom = HeadroomState.from_dict((status.get("autoscaler") or {}).get("headroom"))
        self.decided_at = last_decision_time(status)
        self._source: MetricsSource | None = None
        self._source_config: SourceConfig | None = None
        # The conditions this loop last wrote: transition Events compare against them, not
        # against a body that may not show the last write yet.
        self._written_conditions: list[dict[str, Any]] | None = None
        # (generation, count) whose Deployment the API refused (a PermanentError).
        self._refused: tuple[int | None, int] | None = None
        self._episodes = EpisodeLog(self._log)
        self._key = f"{meta.get('namespace')}/{meta.get('name')} autoscaler"
        # Scale to zero: the router's held requests (made on first use), and whether the
        # last decision left the fleet at zero (then the loop polls them every second).
        self.activation: ActivationProbe | None = None
        self.at_zero = last_desired_replicas(status) == 0

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None
        if self.activation is not None:
            self.activation.close()
            self.activation = None

    def _probe(self) -> ActivationProbe:
        if self.activation is None:
            self.activation = ActivationProbe(self._key.removesuffix(" autoscaler"),
                                               log=self._log)
        return self.activation

    def _source_for(self, config: SourceConfig) -> MetricsSource:
        if self._source is None or config != self._source_config:
            if self._source is not None:
                self._source.close()
            self._source, self._source_config = self.ctx.source_factory(config), config
        return self._source

    def tick(self, body: Mapping[str, Any]) -> float:
        """Decide if an interval has passed since the last decision; returns the seconds
        to wait before the next tick. Raises ApiError and kopf errors (see
        :meth:`tick_safely`)."""
        resource = Resource.from_body(body)
        try:
            spec = parse_spec(resource.spec)
        except SpecError:
            return RETRY_SECONDS  # the reconcile reports it (Ready=False, InvalidSpec)
        if spec.autoscaling is None or spec.autoscaling.keda:
            # KEDA mode: KEDA's HPA scales; deciding here would fight it.
            return RETRY_SECONDS
        interval = float(spec.autoscaling.interval_seconds)
        now = self.ctx.clock()
        held = None
        if self.decided_at is not None:
            waited = now.timestamp() - self.decided_at
            if 0 <= waited < interval - DUE_SLACK_SECONDS:
                if not (spec.autoscaling.scale_to_zero and self.at_zero):
                    return interval - waited
                # At zero: a request the router holds is answered now, not next interval.
                routers = observe_routers(self.ctx.api, resource.namespace, resource.name)
                held = self._probe().poll(routers, now.timestamp())
                if not held:
                    return min(POLL_SECONDS, interval - waited)
        plan = self.run_interval(body, resource, spec, now, held)
        return interval if plan is not None else RETRY_SECONDS

    def tick_safely(self, body: Mapping[str, Any]) -> float:
        """:meth:`tick`, with every failure logged once per episode and retried later:
        the daemon must never exit (Kopf would not restart it)."""
        try:
            delay = self.tick(body)
        except (ApiError, kopf.TemporaryError, kopf.PermanentError) as exc:
            self._episodes.failing(self._key, f"{type(exc).__name__}: {exc}",
                                   self.ctx.clock().timestamp())
            return RETRY_SECONDS
        except Exception as exc:  # a bug must not stop autoscaling for good
            self._log.exception("%s: unexpected error", self._key)
            self._episodes.failing(self._key, repr(exc), self.ctx.clock().timestamp())
            return RETRY_SECONDS
        self._episodes.ok(self._key, self.ctx.clock().timestamp())
        return delay

    def run_interval(self, body: Mapping[str, Any], resource: Resource, spec: InferenceSpec,
                     now: datetime, held: float | None = None) -> AutoscalePlan | None:
        """Observe, plan (the policy's decision) and apply one interval: the count through
        the reconcile, then the status and Events. Updates ``state``, ``decided_at`` and
        ``at_zero``. ``held``: router attempts that found no engine, when the caller just
        polled them (scale to zero; else they are polled here). None when there is no
        Deployment yet. Raises ApiError and kopf.TemporaryError (a refused Deployment is
        recorded, not raised: see below)."""
        api, ns, name = self.ctx.api, resource.namespace, resource.name
        auto = spec.autoscaling
        if auto is None:
            raise ValueError("spec.autoscaling is not set: nothing to autoscale")
        observation = observe_fleet(api, ns, name)
        if observation.deployment_replicas is None:
            return None
        source = self._source_for(SourceConfig(auto.metrics.source, auto.metrics.url, ns, name))
        reading = source.read(observation.ready, now.timestamp(), observation.routers)
        if auto.scale_to_zero:
            if held is None:
                held = self._probe().poll(observation.routers, now.timestamp())
            reading = dataclasses.replace(reading, requests_without_engine=held or 0.0)
            if held is None:
                # No router could be read: whether requests are held is unknown, so the
                # fleet's traffic is unknown too (never idle, never to zero on it).
                reading = dataclasses.replace(reading, requests_finished=None)
        previous = self._written_conditions
        if previous is None:
            previous = resource.status.get("conditions")
        plan = plan_autoscale(observation, reading, self.state, spec, previous, now)
        status: dict[str, Any] = {}
        drop: tuple[str, ...] = ()
        owned_by_reconcile: tuple[str, ...] = c.RECONCILE_CONDITIONS
        if plan.requested is not None and self._refused != (resource.generation, plan.requested):
            try:
                result = run_reconcile(self.ctx, body, requested=plan.requested,
                                       requested_reason=plan.requested_reason)
                status, drop = dict(result.status), result.drop_conditions
            except ReconcileRefused as exc:
                # The API refused the Deployment itself (run_reconcile posted one Warning):
                # retrying the same count every few seconds cannot help and would only
                # repeat that Warning. Record it, write the failure and the decision, and
                # try again after a spec change or when the policy asks for another count.
                self._refused = (resource.generation, plan.requested)
                status = dict(exc.status)
                owned_by_reconcile = c.WORKLOAD_CONDITIONS
        # The count is applied (or needed no change, or was refused): the decision happened.
        self.state, self.decided_at = plan.decision.state, now.timestamp()
        self.at_zero = plan.decision.desired_replicas == 0
        headroom_status = self._apply_headroom(resource, spec, plan, now)
        # Ready/Progressing only when the reconcile just computed them from the Deployment
        # it applied; otherwise the snapshot's copies may be stale and are not written.
        owned = c.AUTOSCALER_CONDITIONS + (owned_by_reconcile if status else ())
        base = status.get("conditions") or resource.status.get("conditions")
        status.update(plan.status)
        if headroom_status is not None or "headroom" in (resource.status.get("autoscaler") or {}):
            status["autoscaler"] = {**(status.get("autoscaler") or {}), "headroom": headroom_status}
        status["conditions"] = set_conditions(base, plan.conditions, now, None)
        write_status(api, ns, name, status, owned, drop)
        self._written_conditions = status["conditions"]
        for event in plan.events:
            self.ctx.post_event(body, event.type, event.reason, event.message)
        return plan

    def _apply_headroom(self, resource: Resource, spec: InferenceSpec, plan: AutoscalePlan,
                        now: datetime) -> dict[str, Any] | None:
        """Node headroom (``autoscaling.nodeStartupSeconds`` > 0): size the placeholder pods
        after this decision (:func:`kvpilot.autoscaler.headroom.headroom`) and apply their
        Deployment. Returns ``status.autoscaler.headroom`` (None when off: the reconcile
        deletes the Deployment then). A failed apply is logged and tried again next
        interval: the decision's status is written anyway."""
        auto = spec.autoscaling
        if auto is None or not auto.node_startup_seconds:
            self.headroom = HeadroomState()
            return None
        self.headroom = headroom(plan.decision.state, auto, plan.decision.desired_replicas,
                                 now.timestamp(), auto.node_startup_seconds, self.headroom)
        try:
            self.ctx.api.apply(build_headroom_deployment(
                resource.owner, spec, self.headroom.replicas, self.ctx.options.engine_image,
                self.ctx.options.headroom_priority_class))
        except ApiError as exc:
            self._log.warning("node headroom: applying %d placeholder pod(s) failed: %s", self.headroom.replicas,
                              exc)
        return self.headroom.to_dict()


def has_autoscaling(spec: Mapping[str, Any], **_: Any) -> bool:
    """Kopf ``when`` filter: run the autoscaler only for resources that ask for it, and not
    in KEDA mode (``autoscaling.engine: keda``: KEDA's HPA scales the fleet; Kopf stops the
    daemon when a resource switches to it and starts one when it switches back)."""
    autoscaling = spec.get("autoscaling")
    if not autoscaling:
        return False
    return not (isinstance(autoscaling, Mapping) and autoscaling.get("engine") == "keda")


async def autoscaler_daemon(stopped: kopf.DaemonStopped, body: kopf.Body,
                            memo: OperatorContext, **_: Any) -> None:
    """Kopf daemon: one loop per autoscaled InferenceDeployment until Kopf stops it.
    The blocking work (API, scrapes, PromQL) runs in a worker thread."""
    loop = AutoscalerLoop(memo, copy.deepcopy(dict(body)))
    try:
        while not stopped:
            snapshot = copy.deepcopy(dict(body))  # the live body may change under a thread
            delay = await asyncio.to_thread(loop.tick_safely, snapshot)
            await stopped.wait(delay)
    finally:
        loop.close()
