"""KEDA mode (``spec.autoscaling.engine: keda``, docs/autoscaling.md "KEDA mode"): the spec,
the ScaledObject (checked against KEDA's own CRD, vendored under fixtures/), the reconcile
that leaves the replica count to KEDA's HPA, repairs that do not undo KEDA's resizes, the
autoscaler loop that stands aside, and the switch back to the operator's own autoscaler."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.api import InvalidObjectError
from kvpilot.operator.autoscaling.loop import RETRY_SECONDS, AutoscalerLoop, has_autoscaling
from kvpilot.operator.builders import Owner, build_children
from kvpilot.operator.builders.keda import build_scaled_object, scaled_object_queries
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile import HANDOVER_FIELD_MANAGER, Resource, reconcile
from kvpilot.operator.repair import ChildFingerprints, fingerprint
from kvpilot.operator.spec import SpecError, parse_spec

from .fakes import T0, FakeKubeApi, inference

KEDA_CRD = Path(__file__).parent / "fixtures" / "keda.sh_scaledobjects.yaml"
SCALED_OBJECT = "keda.sh/v1alpha1/ScaledObject"
OPTIONS = OperatorOptions(engine_image="kvpilot/engine:test")
EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
PROM = "http://prometheus.monitoring:9090"
S = '{namespace="llm",inference_deployment="chat"}'


def keda_spec(**autoscaling: Any) -> dict[str, Any]:
    return {"model": EMBEDDED, "engine": {"maxNumSeqs": 64},
            "autoscaling": {"engine": "keda", "minReplicas": 2, "maxReplicas": 8,
                            "metrics": {"source": "prometheus", "url": PROM}, **autoscaling}}


# ------------------------------------------------------------------ the spec
def test_engine_defaults_to_kvpilot_and_keda_is_accepted():
    plain = parse_spec({"model": EMBEDDED, "autoscaling": {"maxReplicas": 3}}).autoscaling
    assert plain is not None and plain.engine == "kvpilot" and not plain.keda
    keda = parse_spec(keda_spec()).autoscaling
    assert keda is not None and keda.engine == "keda" and keda.keda
    assert keda.metrics.url == PROM


@pytest.mark.parametrize("autoscaling,field,words", [
    ({"engine": "hpa"}, "autoscaling.engine", "one of kvpilot, keda"),
    ({"engine": True}, "autoscaling.engine", "one of kvpilot, keda"),
    ({"metrics": {"source": "pods"}}, "autoscaling.metrics.source",
     "prometheus is required when autoscaling.engine is keda"),
    ({"minReplicas": 0}, "autoscaling.minReplicas", "autoscaling.engine is keda"),
    ({"nodeStartupSeconds": 300}, "autoscaling.nodeStartupSeconds", "autoscaling.engine is keda"),
    ({"slo": {"itlSeconds": 0.05}}, "autoscaling.slo", "KEDA's HPA cannot run the latency model"),
])
def test_refused_with_the_field_named(autoscaling, field, words):
    with pytest.raises(SpecError) as info:
        parse_spec(keda_spec(**autoscaling))
    assert info.value.field == field
    assert str(info.value).startswith(f"spec.{field}: got ")
    assert words in str(info.value)


# ------------------------------------------------------------------ the ScaledObject
def built(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    parsed = parse_spec(spec or keda_spec())
    return build_scaled_object(Owner("chat", "llm", "uid-chat").reference(), "llm", "chat", parsed)


def test_the_scaled_object_mirrors_the_policy():
    obj = built(keda_spec(targetCacheUsage=0.8, targetQueueDepth=3, targetSaturation=0.5,
                          intervalSeconds=10, scaleDownStabilizationSeconds=600,
                          scaleUpStabilizationSeconds=30))
    assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject"
    meta = obj["metadata"]
    assert (meta["name"], meta["namespace"]) == ("chat", "llm")
    assert meta["labels"][c.LABEL_OWNER] == "chat"
    assert meta["labels"][c.LABEL_MANAGED_BY] == c.FIELD_MANAGER
    assert meta["ownerReferences"] == [{"apiVersion": c.API_VERSION, "kind": c.KIND,
                                        "name": "chat", "uid": "uid-chat", "controller": True,
                                        "blockOwnerDeletion": True}]
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 8)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (10, 600)
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"] == {"stabilizationWindowSeconds": 600, "policies": [
        {"type": "Pods", "value": 1, "periodSeconds": 10}]}
    assert behavior["scaleUp"] == {"stabilizationWindowSeconds": 30}
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert list(triggers) == ["kv-cache-usage", "queue-depth", "saturation"]
    for trigger in triggers.values():
        assert trigger["type"] == "prometheus"
        assert trigger["metadata"]["serverAddress"] == PROM
        assert trigger["metadata"]["ignoreNullValues"] == "false"  # empty is not zero
    kv, queue, sat = triggers["kv-cache-usage"], triggers["queue-depth"], triggers["saturation"]
    assert kv["metricType"] == "Value"
    assert kv["metadata"]["query"] == f"avg(max by (pod) (kvpilot:gpu_cache_usage_factor{S}))"
    assert kv["metadata"]["threshold"] == "0.8"
    assert queue["metricType"] == "AverageValue"
    assert queue["metadata"]["query"] == f"sum(max by (pod) (kvpilot:num_requests_waiting{S}))"
    assert queue["metadata"]["threshold"] == "3"
    assert sat["metricType"] == "AverageValue"
    assert sat["metadata"]["query"] == f"sum(max by (pod) (kvpilot:num_requests_running{S}))"
    assert sat["metadata"]["threshold"] == "32"  # maxNumSeqs 64 x targetSaturation 0.5


def test_the_hpa_sizes_like_the_policy_rules():
    """What the HPA computes from each trigger is the policy's answer for the same load:
    Value: ceil(replicas x value / threshold); AverageValue: ceil(sum / threshold)."""
    obj = built()
    t = {x["name"]: float(x["metadata"]["threshold"]) for x in obj["spec"]["triggers"]}
    replicas, mean_usage, waiting, running = 4, 0.9, 10, 200
    assert math.ceil(replicas * mean_usage / t["kv-cache-usage"]) == 5  # ceil(3.6 / 0.75)
    assert math.ceil(waiting / t["queue-depth"]) == 3  # ceil(10 / 4)
    assert math.ceil(running / t["saturation"]) == 5  # ceil(200 / (64 x 0.75))


def test_the_stabilization_window_is_capped_at_the_hpa_limit():
    obj = built(keda_spec(scaleDownStabilizationSeconds=7200))
    behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 3600
    assert obj["spec"]["cooldownPeriod"] == 7200


def test_queries_quote_the_selector():
    queries = scaled_object_queries('we"ird', "chat")
    assert all('namespace="we\\"ird"' in q for q in queries.values())


def test_only_keda_mode_builds_one():
    with pytest.raises(ValueError, match="engine keda"):
        build_scaled_object({}, "llm", "chat",
                            parse_spec({"model": EMBEDDED, "autoscaling": {"maxReplicas": 3}}))


def _keda_schema() -> dict[str, Any]:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    assert crd["metadata"]["name"] == "scaledobjects.keda.sh"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def _undeclared(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields of ``value`` the schema does not declare (the API server would prune them)."""
    out: list[str] = []
    if isinstance(value, dict) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata":
            return out
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                out += _undeclared(props[key], sub, f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _undeclared(extra, sub, f"{path}.{key}")
            else:
                out.append(f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += _undeclared(schema["items"], item, f"{path}[{i}]")
    return out


@pytest.mark.parametrize("spec", [keda_spec(), keda_spec(minReplicas=1, maxReplicas=1000,
                                                         scaleDownStabilizationSeconds=0)])
def test_the_scaled_object_is_valid_against_kedas_crd(spec):
    schema = _keda_schema()
    obj = built(spec)
    jsonschema.Draft7Validator(schema).validate(obj)
    assert _undeclared(schema, obj) == []
    # The HPA's own limits (the CRD leaves them to KEDA's webhook and the HPA).
    behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    for direction in behavior.values():
        assert 0 <= direction["stabilizationWindowSeconds"] <= 3600
        for policy in direction.get("policies", ()):
            assert 0 < policy["periodSeconds"] <= 1800 and policy["value"] > 0
    assert 0 < obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]


def test_an_invalid_scaled_object_is_caught_by_the_schema():
    obj = built()
    obj["spec"]["triggers"][0]["metadata"]["threshold"] = 0.75  # metadata values are strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_keda_schema()).validate(obj)
    del obj["spec"]["scaleTargetRef"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_keda_schema()).validate(obj)


def test_children_in_keda_mode():
    owner = Owner("chat", "llm", "uid-chat")
    children = build_children(owner, parse_spec(keda_spec()), 3, "e:1", False, scaled_objects=True)
    assert "replicas" not in children.deployment["spec"]
    assert children.deployment["metadata"]["annotations"] == {
        c.ANNOTATION_REPLICAS_OWNER: c.REPLICAS_OWNER_KEDA}
    assert children.all()[-1] is children.scaled_object
    assert not [r for r in children.unwanted if r.kind == "ScaledObject"]
    plain = build_children(owner, parse_spec({"model": EMBEDDED, "autoscaling": {"maxReplicas": 3}}),
                           3, "e:1", False, scaled_objects=True)
    assert plain.deployment["spec"]["replicas"] == 3 and plain.scaled_object is None
    assert "annotations" not in plain.deployment["metadata"]
    assert [r.name for r in plain.unwanted if r.kind == "ScaledObject"] == ["chat"]
    # Where KEDA is not installed there is nothing to look for.
    unserved = build_children(owner, parse_spec({"model": EMBEDDED}), 1, "e:1", False)
    assert not [r for r in unserved.unwanted if r.kind == "ScaledObject"]


# ------------------------------------------------------------------ the reconcile
def run(api: FakeKubeApi, spec: dict[str, Any], **kwargs: Any):
    body = inference(spec=spec)
    stored = api.stored(c.KIND, "llm", "chat")
    if stored is None:
        api.put(body)
    else:
        stored["spec"] = spec
        api.objects[(c.KIND, "llm", "chat")] = stored
    return reconcile(api, Resource.from_body(body), OPTIONS, T0, **kwargs)


def replicas(api: FakeKubeApi) -> int:
    return api.stored("Deployment", "llm", "chat")["spec"]["replicas"]


def deployment_applies(api: FakeKubeApi) -> list[tuple[Any, ...]]:
    return [call for call in api.calls if call[:2] == ("apply", "Deployment") and call[3] == "chat"]


def test_keda_mode_writes_the_scaled_object_and_never_the_count():
    api = FakeKubeApi(apis=(SCALED_OBJECT,))
    result = run(api, keda_spec())
    assert "ScaledObject/chat" in result.applied
    stored = api.stored("ScaledObject", "llm", "chat")
    assert stored["spec"]["scaleTargetRef"]["name"] == "chat"
    assert stored["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
    (first,) = deployment_applies(api)
    assert "replicas" not in first[4]["spec"]  # the API's default, then KEDA's minimum
    assert replicas(api) == 1
    # KEDA's HPA scales (an update through the scale subresource): no reconcile undoes it.
    api.scale("llm", "chat", 5)
    result = run(api, keda_spec())
    assert replicas(api) == 5
    assert not result.target.is_scale and result.status["desiredReplicas"] == 5
    assert [e.reason for e in result.events] == []
    assert all("replicas" not in call[4]["spec"] for call in deployment_applies(api)
               if call[5] == c.FIELD_MANAGER)
    # ... nor does an autoscaler count sneak in (the loop stands aside, but even so).
    run(api, keda_spec(), requested=2)
    assert replicas(api) == 5


def test_switching_a_live_fleet_to_keda_keeps_its_size():
    api = FakeKubeApi(apis=(SCALED_OBJECT,))
    kvpilot = {"model": EMBEDDED, "autoscaling": {"minReplicas": 1, "maxReplicas": 8}}
    run(api, kvpilot, requested=4)
    assert replicas(api) == 4
    run(api, keda_spec())
    # Handed over first (the count, by another field manager), then applied without it.
    managers = [call[5] for call in deployment_applies(api)]
    assert managers[-2:] == [HANDOVER_FIELD_MANAGER, c.FIELD_MANAGER]
    assert replicas(api) == 4
    api.scale("llm", "chat", 6)
    run(api, keda_spec())
    assert replicas(api) == 6


def test_without_the_hand_over_the_count_would_reset():
    """The fake models the server-side-apply rule the hand-over exists for."""
    api = FakeKubeApi()
    run(api, {"model": EMBEDDED, "replicas": 4})
    deployment = api.stored("Deployment", "llm", "chat")
    del deployment["spec"]["replicas"]
    del deployment["metadata"]["resourceVersion"]
    api.apply(deployment)
    assert replicas(api) == 1


def test_managed_fields_say_when_to_hand_over():
    api = FakeKubeApi(apis=(SCALED_OBJECT,))
    run(api, keda_spec())
    stored = api.objects[("Deployment", "llm", "chat")]
    stored["metadata"]["managedFields"] = [
        {"manager": c.FIELD_MANAGER, "operation": "Apply", "fieldsV1": {"f:spec": {"f:template": {}}}},
        {"manager": "keda-operator", "operation": "Update", "fieldsV1": {"f:spec": {"f:replicas": {}}}},
    ]
    before = len(deployment_applies(api))
    run(api, keda_spec())
    assert [call[5] for call in deployment_applies(api)[before:]] == [c.FIELD_MANAGER]


def test_switching_back_deletes_the_scaled_object_and_takes_the_count_back():
    api = FakeKubeApi(apis=(SCALED_OBJECT,))
    run(api, keda_spec())
    api.scale("llm", "chat", 5)
    result = run(api, {"model": EMBEDDED, "autoscaling": {"minReplicas": 1, "maxReplicas": 8}})
    assert "ScaledObject/chat" in result.deleted
    assert api.stored("ScaledObject", "llm", "chat") is None
    assert replicas(api) == 5  # kept, now applied by the operator again
    assert deployment_applies(api)[-1][4]["spec"]["replicas"] == 5
    assert "annotations" not in api.stored("Deployment", "llm", "chat")["metadata"]


def test_a_scaled_object_not_ours_is_left_alone():
    api = FakeKubeApi(apis=(SCALED_OBJECT,))
    api.put({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
             "metadata": {"name": "chat", "namespace": "llm"}, "spec": {}})
    with pytest.raises(InvalidObjectError, match="not managed by kvpilot"):
        run(api, keda_spec())
    api = FakeKubeApi(apis=(SCALED_OBJECT,))
    api.put({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
             "metadata": {"name": "chat", "namespace": "llm"}, "spec": {}})
    result = run(api, {"model": EMBEDDED})
    assert result.deleted == () and api.stored("ScaledObject", "llm", "chat") is not None


def test_keda_mode_without_keda_installed_is_refused_before_any_write():
    api = FakeKubeApi()
    with pytest.raises(InvalidObjectError, match="install KEDA"):
        run(api, keda_spec())
    assert api.writes() == []


def test_keda_mode_drops_the_autoscaler_conditions():
    api = FakeKubeApi(apis=(SCALED_OBJECT,))
    body = inference(spec=keda_spec(), status={"conditions": [
        {"type": "ScalingActive", "status": "True", "reason": "Holding", "message": "",
         "lastTransitionTime": "2026-11-29T11:00:00Z"}]})
    api.put(body)
    result = reconcile(api, Resource.from_body(body), OPTIONS, T0)
    assert set(c.AUTOSCALER_CONDITIONS) <= set(result.drop_conditions)
    assert not [x for x in result.status["conditions"] if x["type"] in c.AUTOSCALER_CONDITIONS]


# ------------------------------------------------------------------ repair and the loop
def test_kedas_resizes_are_not_edits_to_repair():
    api = FakeKubeApi(apis=(SCALED_OBJECT,))
    run(api, keda_spec())
    seen = ChildFingerprints()
    ours = api.stored("Deployment", "llm", "chat")
    assert fingerprint(ours)[0] == "spec"
    seen.record(ours)
    api.scale("llm", "chat", 7)
    assert not seen.changed(api.stored("Deployment", "llm", "chat"))
    edited = api.stored("Deployment", "llm", "chat")
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"
    assert seen.changed(edited)  # any other edit is still put back


def test_the_loop_stands_aside_in_keda_mode():
    assert has_autoscaling({"autoscaling": {"maxReplicas": 3}})
    assert not has_autoscaling({"autoscaling": {"maxReplicas": 3, "engine": "keda"}})
    assert not has_autoscaling({})

    class Ctx:
        api = FakeKubeApi()

        @staticmethod
        def clock():
            return T0

    body = inference(spec=keda_spec())
    loop = AutoscalerLoop(Ctx(), copy.deepcopy(body))  # type: ignore[arg-type]
    assert loop.tick(body) == RETRY_SECONDS
    assert Ctx.api.calls == []  # nothing observed, nothing written


def test_the_deployment_watch_leaves_kedas_resize_alone():
    """End to end through the handler: KEDA resizes, the watch event comes, nothing is
    applied and no ChildRestored Warning is posted; a template edit is still put back."""
    from kvpilot.operator.handlers.children import on_deployment_event
    from kvpilot.operator.handlers.context import OperatorContext
    from kvpilot.operator.handlers.lifecycle import on_spec
    from kvpilot.operator.metrics import OperatorMetrics
    from kvpilot.operator.repair import RepairBackoff

    from .fakes import Clock

    events: list[tuple[Any, ...]] = []
    ctx = OperatorContext(api=FakeKubeApi(apis=(SCALED_OBJECT,)),
                          options=OperatorOptions(engine_image="e:1"), metrics=OperatorMetrics(),
                          clock=Clock(), post_event=lambda body, *e: events.append(e),
                          monotonic=lambda: 1000.0,
                          repairs=RepairBackoff(schedule=lambda s, fn: None))
    body = inference(spec=keda_spec())
    ctx.api.put(body)
    on_spec(body=body, memo=ctx)
    api = ctx.api
    on_deployment_event(body=api.stored("Deployment", "llm", "chat"), type="ADDED", memo=ctx)
    api.scale("llm", "chat", 6)
    applies = len([w for w in api.writes() if w[0] == "apply"])
    on_deployment_event(body=api.stored("Deployment", "llm", "chat"), type="MODIFIED", memo=ctx)
    assert len([w for w in api.writes() if w[0] == "apply"]) == applies
    assert not [e for e in events if e[1] == "ChildRestored"]
    assert replicas(api) == 6
    edited = api.stored("Deployment", "llm", "chat")
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"
    edited["metadata"]["generation"] += 1
    api.objects[("Deployment", "llm", "chat")] = copy.deepcopy(edited)
    on_deployment_event(body=edited, type="MODIFIED", memo=ctx)
    restored = api.stored("Deployment", "llm", "chat")
    assert restored["spec"]["template"]["spec"]["containers"][0]["image"] != "someone/else:1"
    assert restored["spec"]["replicas"] == 6  # the repair put the image back, not the count
    assert [e[1] for e in events if e[1] == "ChildRestored"] == ["ChildRestored"]



@pytest.mark.parametrize("field", ["targetCacheUsage", "targetQueueDepth", "targetSaturation"])
def test_a_keda_target_under_a_thousandth_is_refused_by_name(field):
    # KEDA turns a threshold into a milli-quantity: 0.0001 would reach the HPA as 0.
    with pytest.raises(SpecError, match=rf"autoscaling\.{field}: got 0\.0001; >= 0\.001"):
        parse_spec(keda_spec(**{field: 0.0001}))


def test_thresholds_are_thousandths_and_the_address_has_no_trailing_slash():
    doc = keda_spec(targetSaturation=0.3333, metrics={"source": "prometheus", "url": PROM + "/"})
    doc["engine"]["maxNumSeqs"] = 3
    obj = build_scaled_object({"uid": "u"}, "llm", "chat", parse_spec(doc))
    triggers = {t["name"]: t["metadata"] for t in obj["spec"]["triggers"]}
    assert triggers["saturation"]["threshold"] == "1"  # 3 x 0.3333 = 0.9999 -> 1.000
    assert {t["serverAddress"] for t in triggers.values()} == {PROM}


def test_no_spec_built_around_the_parser_holds_an_slo_in_keda_mode():
    """Belt and braces: a spec built around the parser (a test, a future caller) cannot
    carry an SLO in KEDA mode either, so no ScaledObject silently drops the latency
    targets: the policy's spec refuses the pair itself."""
    import dataclasses

    from kvpilot.autoscaler import SloSpec

    parsed = parse_spec(keda_spec())
    assert parsed.autoscaling is not None
    with pytest.raises(ValueError, match="slo is not allowed when engine is keda"):
        dataclasses.replace(parsed.autoscaling, slo=SloSpec(itl_seconds=0.05))
