"""Case C14: every status field the operator (and its autoscaler timer) writes is declared
in the CRD's structural schema, so the API server stores it instead of pruning it
silently; and every declared status field is written by some code path (no dead schema).

Statuses come from the real code paths: reconcile over many Deployment states, the
failure paths of the handlers, the Deployment watch, the autoscaler fragments, and the
autoscaler policy's own Decision/PolicyState output. Each is applied as the merge patch
the operator sends, then pruned and validated exactly as the API server would
(tests/operator/crdschema.py). The same fields are read back from a real API server in
the e2e suite.
"""

from __future__ import annotations

import copy
import math

import kopf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.operator.handlers.children import on_deployment_event
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import run_reconcile
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.status.autoscaler import (
    CapacityEstimate,
    CostEstimate,
    ObservedSignals,
    autoscaler_status,
)
from kvpilot.operator.status.workload import failure_status, workload_status

from .crdschema import load_crd, merge_patch, prune, root_schema, sub_schema, validate
from .fake_sources import empty, loaded, unreachable
from .fakes import T0, Clock, FakeKubeApi, inference
from .fleet_harness import AUTO, Fleet

STATUS_SCHEMA = sub_schema(root_schema(load_crd()), "status")
EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}


def stored_status(*patches: dict) -> dict:
    """The status the API server keeps after these merge patches, checked on the way."""
    status: dict = {}
    for patch in patches:
        status = merge_patch(status, patch)
        pruned, dropped = prune(STATUS_SCHEMA, status, "status")
        assert dropped == [], f"pruned by the API server: {dropped}"
        assert validate(STATUS_SCHEMA, status, "status") == []
        status = pruned
    return status


def paths(value, prefix="") -> set[str]:
    """Leaf paths of a JSON value, objects in lists as ``[]``; a list of scalars (or of
    lists) is one leaf, as the schema declares it."""
    if isinstance(value, dict) and value:
        return set().union(*(paths(v, f"{prefix}.{k}" if prefix else k) for k, v in value.items()))
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return set().union(*(paths(v, f"{prefix}[]") for v in value))
    return {prefix}


def declared_paths(schema, prefix="") -> set[str]:
    if "properties" in schema:
        return set().union(*(declared_paths(s, f"{prefix}.{k}" if prefix else k)
                             for k, s in schema["properties"].items()))
    if isinstance(schema.get("additionalProperties"), dict):
        return declared_paths(schema["additionalProperties"], f"{prefix}.*")
    if schema.get("type") == "array" and "properties" in schema["items"]:
        return declared_paths(schema["items"], f"{prefix}[]")
    return {prefix}


def _ctx():
    return OperatorContext(api=FakeKubeApi(apis=("monitoring.coreos.com/v1/PodMonitor",
                                                  "inference.networking.k8s.io/v1/InferencePool")),
                           options=OperatorOptions(engine_image="e:1"),
                           metrics=OperatorMetrics(), clock=Clock(),
                           post_event=lambda *a: None)


def reconcile_statuses() -> list[dict]:
    """Status patches of the reconcile paths: create, scale, ready, invalid, refused."""
    ctx, out = _ctx(), []
    auto = {"model": EMBEDDED, "autoscaling": {"maxReplicas": 4}}
    body = inference(spec=auto)
    ctx.api.put(body)
    for kwargs in ({}, {"requested": 3, "requested_reason": "forecast"}, {}):
        out.append(dict(run_reconcile(ctx, body, **kwargs).status))
        ctx.api.set_deployment_status("llm", "chat", replicas=3, readyReplicas=2,
                                      updatedReplicas=3)
    ctx.api.patch_status("llm", "chat", out[-1])
    on_deployment_event(body=ctx.api.stored("Deployment", "llm", "chat"), type="MODIFIED",
                        memo=ctx)
    out.append([call[4] for call in ctx.api.calls if call[0] == "patch_status"][-1])
    # The router Deployment's watch (RouterReady), then the router off, then gateway mode.
    ctx.api.set_deployment_status("llm", "chat-router", replicas=1, availableReplicas=1)
    on_deployment_event(body=ctx.api.stored("Deployment", "llm", "chat-router"),
                        type="MODIFIED", memo=ctx)
    out.append([call[4] for call in ctx.api.calls if call[0] == "patch_status"][-1])
    for router in ({"enabled": False},
                   {"mode": "gateway", "gateway": {"endpointPickerRef": {"name": "epp"}}}):
        out.append(dict(run_reconcile(ctx, inference(spec={"model": EMBEDDED,
                                                           "router": router})).status))
    for bad in ({"model": {"uri": "s3://x/y"}}, {"model": EMBEDDED, "replicas": -2}):
        with pytest.raises(kopf.PermanentError) as info:
            run_reconcile(ctx, inference(spec=bad, generation=2))
        out.append(dict(info.value.status))
    return out


def autoscaler_fragments() -> list[dict]:
    signals = ObservedSignals("prometheus", 3, 0.81, 0.97, 24.0, 9.0, 5120.0, 0.2, 0.042, 0.8,
                              0.91, 1234.5)
    missing = ObservedSignals("pods", 0)
    decision = {
        "desiredReplicas": 4, "currentReplicas": 3, "direction": "up", "rule": "forecast",
        "signal": "kv_demand", "value": 0.93, "reason": "KV exhaustion in 80 s < 150 s",
        "limited": None, "metricsAvailable": True, "missingPods": ["chat-1"],
        "candidates": [{"rule": "headroom", "replicas": None, "signal": "kv_usage",
                        "value": None, "detail": "no data"}],
        "latency": {"percentile": "p90", "histograms": True, "trusted": False,
                    "informedReads": 2, "itlA": 0.03, "itlC": 0.006, "itlObserved": 0.12,
                    "ttftObserved": 1.5, "ttftBase": 0.5, "prefillRate": 2048.0,
                    "prefillComputed": 900.0, "prefixHandover": 21000.0,
                    "requests": 40.0, "growth": 1.0},
    }
    state = {"version": 1, "demand": [[1.0, 2.5]], "recommendations": [[1.0, 3, None]],
             "lastScaleTime": 1.0, "lastScaleDownTime": 1.0,
             "latency": {"percentile": 0.9, "s0": 2.0, "sb": 16.0, "sy": 0.3, "sbb": 160.0,
                         "sby": 2.6, "sp": 40.0, "spp": 1600.0, "sbp": 320.0, "spy": 6.0,
                         "informedReads": 2}}
    return [
        signals.to_status(T0), missing.to_status(T0),
        CapacityEstimate(16384.0, 1800.5, 9.0).to_status(),
        CapacityEstimate(None, None, None).to_status(),
        CostEstimate(13.5, 0.42).to_status(), CostEstimate(None, None).to_status(),
        autoscaler_status(decision, state, T0),
    ]


def autoscale_loop_statuses() -> list[dict]:
    """Every status patch the real autoscaler loop sends, in order, over: scale up, an
    unreachable source, an empty answer, data back, a long quiet spell (scale down)."""
    spec = copy.deepcopy(AUTO)
    spec["autoscaling"]["nodeStartupSeconds"] = 300  # node headroom: status.autoscaler.headroom
    fleet = Fleet(spec=spec, load=loaded(0.97, waiting=30), replicas=2)
    fleet.pods(ready=2)
    fleet.tick(0)
    fleet.pods(ready=fleet.replicas)
    for load, ticks in ((unreachable, 2), (empty, 2), (loaded(0.5), 1), (loaded(0.02), 12)):
        fleet.source.load = load
        for _ in range(ticks):
            fleet.tick()
            fleet.pods(ready=fleet.replicas)
    assert "ScaledDown" in fleet.events.reasons()
    return [call[4] for call in fleet.api.calls if call[0] == "patch_status"]


def test_c14_autoscale_loop_statuses_survive_pruning():
    stored = stored_status(*autoscale_loop_statuses())
    assert stored["autoscaler"]["policyState"]["lastScaleDownTime"] > 0
    assert {c["type"] for c in stored["conditions"]} == {
        "Ready", "Progressing", "RouterReady", "MetricsAvailable", "ScalingActive",
        "ScalingLimited"}
    assert stored["capacity"]["kvCapacityTokensPerReplica"] == 16384


def test_c14_reconcile_statuses_survive_pruning():
    statuses = reconcile_statuses()
    stored = stored_status(*statuses)
    assert stored["conditions"][0]["reason"] == "InvalidSpec"
    assert stored["desiredReplicas"] == 3 and stored["readyReplicas"] == 2
    # Gateway mode last: the pool is named, the endpoint removed (clients use the Gateway).
    assert stored["inferencePool"] == "chat" and "endpoint" not in stored
    assert any(p.get("endpoint") == "http://chat-router.llm.svc:8000" for p in statuses)
    assert any(c["type"] == "RouterReady" and c["status"] == "True"
               for p in statuses for c in p.get("conditions", ()))


def test_c14_autoscaler_fragments_survive_pruning():
    stored = stored_status(*autoscaler_fragments())
    # None (missing data) removed the earlier values instead of leaving stale numbers.
    assert stored["signals"]["readyPods"] == 0 and "cacheUsage" not in stored["signals"]
    assert stored["capacity"] == {}
    assert stored["autoscaler"]["lastDecision"]["time"] == "2026-11-29T12:00:00Z"


def test_c14_autoscaler_policy_output_survives_pruning():
    """Decision.to_dict() and PolicyState.to_dict() of the real policy (kvpilot.autoscaler),
    stored as status.autoscaler: a change of their shape fails here, not in a cluster."""
    from kvpilot.autoscaler import policy
    from kvpilot.autoscaler.signals import FleetSignals, PodSignals
    from kvpilot.autoscaler.spec import AutoscalingSpec
    from kvpilot.autoscaler.state import PolicyState

    spec = AutoscalingSpec.from_crd({"minReplicas": 1, "maxReplicas": 5})
    state, patches = PolicyState(), []
    loads = [0.5, 0.7, 0.9, 0.97, None, 0.3]
    for i, usage in enumerate(loads):
        pod = PodSignals("chat-0", kv_usage=usage, num_waiting=None if usage is None else 3,
                         waiting_tokens=100, num_running=4, preemption_rate=0.0,
                         kv_capacity_tokens=16384)
        decision = policy.decide(FleetSignals((pod,)), state, spec, 15.0 * i)
        state = decision.state
        patches.append(autoscaler_status(decision.to_dict(), state.to_dict(), T0))
    stored = stored_status(*patches)
    # A merge patch drops keys whose value is None; everything else is kept as written.
    assert stored["autoscaler"]["policyState"] == {
        k: v for k, v in state.to_dict().items() if v is not None}
    restored = PolicyState.from_dict(stored["autoscaler"]["policyState"])
    assert restored.recommendations == state.recommendations


def test_c14_policy_output_with_an_slo_survives_pruning():
    """With spec.autoscaling.slo the decision carries the latency view and the state the
    model's sums: both stored whole, and the model restored from what was stored."""
    from kvpilot.autoscaler import FleetSignals, LatencyWindow, PodSignals, PolicyState, decide
    from kvpilot.autoscaler.spec import AutoscalingSpec, SloSpec

    spec = AutoscalingSpec(max_replicas=5, slo=SloSpec(itl_seconds=0.1, ttft_seconds=2.0))
    itl = LatencyWindow(((0.05, 90), (0.2, 100), (math.inf, 100)), 6.0)
    ttft = LatencyWindow(((1.0, 18), (4.0, 20), (math.inf, 20)), 20.0)
    state, patches = PolicyState(), []
    for i in range(3):
        pod = PodSignals("chat-0", kv_usage=0.4, num_waiting=1, waiting_tokens=300,
                         num_running=8, preemption_rate=0.0, kv_capacity_tokens=16384,
                         itl=itl, ttft=ttft, step_tokens=40.0, prompt_token_rate=500.0,
                         cached_token_rate=300.0)
        decision = decide(FleetSignals((pod,), max_num_seqs=64, max_num_batched_tokens=2048),
                          state, spec, 15.0 * i)
        state = decision.state
        patches.append(autoscaler_status(decision.to_dict(), state.to_dict(), T0))
    stored = stored_status(*patches)
    latency = stored["autoscaler"]["lastDecision"]["latency"]
    assert latency["histograms"] is True and latency["itlObserved"] > 0
    # The prefill never varied (40 tokens per step, 8 decoding): the CPU prior's plane.
    assert latency["prefillRate"] == pytest.approx(2048 / (0.027 + 2048 * 0.0015), abs=1e-3)
    assert (latency["prefillComputed"], latency["prefixHandover"]) == (200.0, 300.0)
    assert PolicyState.from_dict(stored["autoscaler"]["policyState"]).latency == state.latency


def test_c14_policy_state_after_a_scale_down_survives_pruning():
    """The bug this pins: ``lastScaleDownTime`` was missing from the status schema, so the
    API server pruned it and the wait after a step down was lost across operator restarts.
    A real sequence that scales down 3 -> 2 -> 1 is stored, read back and restored."""
    from kvpilot.autoscaler import FleetSignals, PodSignals, PolicyState, decide
    from kvpilot.autoscaler.spec import AutoscalingSpec

    spec = AutoscalingSpec.from_crd({"minReplicas": 1, "maxReplicas": 5,
                                     "scaleDownStabilizationSeconds": 30})
    state, replicas, patches, downs = PolicyState(), 3, [], 0
    for i in range(6):
        pods = tuple(PodSignals(f"chat-{k}", kv_usage=0.1, num_waiting=0, waiting_tokens=0,
                                num_running=1, preemption_rate=0.0, kv_capacity_tokens=16384)
                     for k in range(replicas))
        decision = decide(FleetSignals(pods), state, spec, 1000.0 + 15.0 * i)
        state, replicas = decision.state, decision.desired_replicas
        downs += decision.direction == "down"
        patches.append(autoscaler_status(decision.to_dict(), state.to_dict(), T0))
    assert downs == 2 and state.last_scale_down_time is not None
    stored = stored_status(*patches)
    assert stored["autoscaler"]["policyState"]["lastScaleDownTime"] == state.last_scale_down_time
    assert PolicyState.from_dict(stored["autoscaler"]["policyState"]) == state


def test_c14_adapter_sync_statuses_survive_pruning():
    from .test_adapter_sync import adapter_sync_statuses

    stored = stored_status(*adapter_sync_statuses())
    assert stored["adaptersReady"] == "2/2"
    assert stored["adapters"][1] == {"name": "chat", "uri": "hf://acme/chat-lora", "readyPods": 2,
                                     "pods": ["chat-a", "chat-b"]}
    assert [c["type"] for c in stored["conditions"]] == ["AdaptersReady"]


def test_c14_every_declared_status_field_is_written():
    from .test_adapter_sync import adapter_sync_statuses

    written = set().union(*(paths(p) for p in reconcile_statuses() + autoscaler_fragments()
                            + adapter_sync_statuses()))
    loop_written = set().union(*(paths(p) for p in autoscale_loop_statuses()))
    # An empty list of objects (no candidates on missing data) is one leaf, "candidates".
    declared = declared_paths(STATUS_SCHEMA)
    lists = {d.split("[]")[0] for d in declared if "[]" in d}
    # A declared object written as null (policyState.latency without an SLO: the merge
    # patch removes a model an earlier SLO left) is one leaf too.
    objects = {d.rsplit(".", 1)[0] for d in declared if "." in d}
    assert loop_written - declared - lists - objects == set(), "the loop writes undeclared fields"
    written |= loop_written - lists - objects
    assert declared - written == set(), "declared but never written"
    assert written - declared == set(), "written but not declared"


finite = st.floats(min_value=0, max_value=1e7, allow_nan=False)
value = st.one_of(st.none(), finite, st.just(math.nan), st.just(math.inf))


@settings(max_examples=200, deadline=None)
@given(usage=value, top=value, running=value, waiting=value, tokens=value, rate=value,
       ready=st.integers(0, 1000), cap=value, ctx_len=value, conc=value, cost=value, mtok=value,
       latency=st.tuples(value, value, value, value))
def test_c14_any_observation_is_storable(usage, top, running, waiting, tokens, rate, ready,
                                         cap, ctx_len, conc, cost, mtok, latency):
    """Whatever a metric source reads (missing, NaN, inf, huge), the status stays valid:
    non-finite values become None (removed), counts become integers."""
    stored_status(
        ObservedSignals("pods", ready, usage, top, running, waiting, tokens, rate,
                        *latency).to_status(T0),
        CapacityEstimate(cap, ctx_len, conc).to_status(),
        CostEstimate(cost, mtok).to_status(),
    )


def test_c14_failure_and_workload_helpers_directly():
    deployment = {"metadata": {"generation": 1},
                  "spec": {"replicas": 2}, "status": {"replicas": 2, "readyReplicas": 2,
                                                      "updatedReplicas": 2,
                                                      "observedGeneration": 1}}
    stored_status(workload_status("chat", deployment, 5, None, T0),
                  failure_status("ApplyFailed", "HTTP 422", None, 6, T0))


def test_c14_an_undeclared_field_is_caught():
    """The check itself works: a field the CRD lacks is reported, not silently kept."""
    with pytest.raises(AssertionError, match=r"status\.signals\.kvUsage"):
        stored_status({"signals": {"kvUsage": 0.5}})
