"""The InferenceDeployment CRD: structural, valid for Kubernetes, consistent with the
operator's parser, and refusing bad specs with clear messages (schema and CEL rules,
evaluated offline; the same checks on a real API server come with the e2e suite)."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.spec import (
    DEFAULTS,
    MANAGED_FLAGS,
    METRIC_SOURCES,
    SpecError,
    check_name,
    parse_spec,
)
from kvpilot.operator.spec.engine import BLOCK_SIZES, KV_CACHE_DTYPES, PULL_POLICIES
from kvpilot.operator.spec.model import QUANTIZATIONS

from .crdschema import (
    REPO,
    _program,
    admit,
    load_crd,
    root_schema,
    structural_problems,
    sub_schema,
    to_cel,
    validate,
)

SAMPLES = sorted((REPO / "crds" / "samples").glob("*.yaml"))
K8S_VERSION = "1.36.0"


@pytest.fixture(scope="module")
def crd():
    return load_crd()


def obj(spec: dict, name: str = "chat") -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": name, "namespace": "llm"}, "spec": spec}


EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}


def test_crd_is_structural(crd):
    assert structural_problems(root_schema(crd)) == []


def test_crd_is_a_valid_kubernetes_crd(crd):
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)


def test_crd_names_scope_and_version(crd):
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{c.PLURAL}.{c.GROUP}"
    assert spec["group"] == c.GROUP and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == c.KIND and spec["names"]["plural"] == c.PLURAL
    assert "infd" in spec["names"]["shortNames"]
    (version,) = spec["versions"]
    assert version["name"] == c.VERSION and version["served"] and version["storage"]


def test_crd_status_and_scale_subresources(crd):
    sub = crd["spec"]["versions"][0]["subresources"]
    assert sub["status"] == {}
    assert sub["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    schema = root_schema(crd)
    assert sub_schema(schema, "spec.replicas")["type"] == "integer"
    assert sub_schema(schema, "status.replicas")["type"] == "integer"
    assert sub_schema(schema, "status.selector")["type"] == "string"


def test_crd_printer_columns_point_at_declared_fields(crd):
    version = crd["spec"]["versions"][0]
    columns = {col["name"]: col["jsonPath"] for col in version["additionalPrinterColumns"]}
    assert columns == {
        "Model": ".spec.model.uri",
        "KV-Dtype": ".spec.engine.kvCacheDtype",
        "Ready": ".status.readyReplicas",
        "Desired": ".status.desiredReplicas",
        "Cache": ".status.signals.cacheUsage",
        "Queue": ".status.signals.requestsWaiting",
        "Age": ".metadata.creationTimestamp",
        "Cost/h": ".status.cost.costPerHour",
        "Cost/Mtok": ".status.cost.costPerMillionTokens",
        "KV-Tokens": ".status.capacity.kvCapacityTokensPerReplica",
        "Max-Reqs": ".status.capacity.maxConcurrentRequestsEstimate",
        "ITL-P90": ".status.signals.itlP90Seconds",
        "TTFT-P90": ".status.signals.ttftP90Seconds",
        "Hit-Rate": ".status.signals.prefixCacheHitRate",
        "Reason": ".status.lastScaleReason",
        "Adapters": ".status.adaptersReady",
        "Endpoint": ".status.endpoint",
    }
    schema = root_schema(crd)
    for path in columns.values():
        if path.startswith(".metadata"):
            continue
        sub_schema(schema, path.lstrip("."))  # KeyError = the column shows nothing, ever


def test_crd_defaults_equal_the_operators(crd):
    schema = sub_schema(root_schema(crd), "spec")
    for dotted, value in DEFAULTS.items():
        assert sub_schema(schema, dotted).get("default") == value, dotted
    # ...and every default in the CRD is known to the operator.
    found = {}

    def walk(node, path):
        for key, sub in node.get("properties", {}).items():
            dotted = f"{path}.{key}" if path else key
            if "default" in sub and sub["default"] != {}:
                found[dotted] = sub["default"]
            walk(sub, dotted)

    walk(schema, "")
    assert found == DEFAULTS


def test_crd_enums_equal_the_operators(crd):
    spec = sub_schema(root_schema(crd), "spec")
    assert tuple(sub_schema(spec, "engine.kvCacheDtype")["enum"]) == KV_CACHE_DTYPES
    assert tuple(sub_schema(spec, "model.quantization")["enum"]) == QUANTIZATIONS
    assert tuple(sub_schema(spec, "engine.blockSize")["enum"]) == BLOCK_SIZES
    assert tuple(sub_schema(spec, "engine.imagePullPolicy")["enum"]) == PULL_POLICIES
    assert tuple(sub_schema(spec, "autoscaling.metrics.source")["enum"]) == METRIC_SOURCES
    rule = sub_schema(spec, "engine.extraArgs")["x-kubernetes-validations"][0]["rule"]
    for flag in MANAGED_FLAGS:
        assert flag.removeprefix("--") in rule, flag


def test_replicas_has_no_default(crd):
    """A default would make every autoscaled object violate the exclusivity rule."""
    assert "default" not in sub_schema(root_schema(crd), "spec.replicas")


@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_samples_are_admitted_and_parse(crd, path: Path):
    sample = yaml.safe_load(path.read_text())
    stored, errors = admit(crd, sample)
    assert errors == []
    assert stored["spec"]["engine"]["kvCacheDtype"] in KV_CACHE_DTYPES
    parse_spec(stored["spec"])


def test_sample_set_covers_cpu_fp8_gpu_and_tensor_parallel():
    specs = {p.stem: yaml.safe_load(p.read_text())["spec"] for p in SAMPLES}
    cpu = specs["smollm2-cpu"]
    assert cpu["model"]["uri"] == "embedded://smollm2-135m-instruct"
    assert not any(k.endswith("/gpu") for k in cpu["resources"].get("limits", {}))
    gpu = specs["llama3-8b-fp8-gpu"]
    assert gpu["engine"]["kvCacheDtype"] == "fp8"
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Tensor parallelism over the pod's four GPUs, the size left to its default.
    tp = specs["llama3-70b-tp4-gpu"]
    assert tp["model"]["uri"] == "hf://meta-llama/Meta-Llama-3-70B-Instruct"
    assert "tensorParallelSize" not in tp["engine"]
    assert tp["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert tp["engine"]["kvCacheDtype"] == "auto"
    assert parse_spec(tp).engine.tensor_parallel_size == 4


def test_defaults_fill_engine_and_autoscaling(crd):
    stored, errors = admit(crd, obj({"model": EMBEDDED, "autoscaling": {"maxReplicas": 3}}))
    assert errors == []
    assert stored["spec"]["engine"]["maxNumBatchedTokens"] == 2048
    assert stored["spec"]["autoscaling"]["minReplicas"] == 1
    assert stored["spec"]["autoscaling"]["metrics"] == {"source": "pods"}
    assert "replicas" not in stored["spec"]


# Each bad spec: (case id, spec, a piece of the API server's message). The operator's own
# parser must refuse the same spec (an object admitted before a CRD upgrade).
REFUSED = [
    ("min-above-max", {"model": EMBEDDED, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
     "autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    ("replicas-and-autoscaling", {"model": EMBEDDED, "replicas": 2,
                                  "autoscaling": {"maxReplicas": 3}},
     "mutually exclusive"),
    ("unknown-kv-dtype", {"model": EMBEDDED, "engine": {"kvCacheDtype": "fp16"}},
     "'fp16' not in"),
    ("unknown-quantization", {"model": {**EMBEDDED, "quantization": "int3"}}, "'int3' not in"),
    ("quantization-in-extra-args", {"model": EMBEDDED, "engine": {"extraArgs": ["-q", "awq"]}},
     "must not repeat a flag the operator sets"),
    ("long-quantization-in-extra-args",
     {"model": EMBEDDED, "engine": {"extraArgs": ["--quantization=fp8"]}},
     "model.quantization the weights' format"),
    ("budget-zero", {"model": EMBEDDED, "engine": {"maxNumBatchedTokens": 0}},
     "below minimum 1"),
    ("budget-below-seqs", {"model": EMBEDDED,
                           "engine": {"maxNumBatchedTokens": 64, "maxNumSeqs": 128}},
     "engine.maxNumBatchedTokens must be >= engine.maxNumSeqs"),
    ("gs-uri", {"model": {"uri": "gs://bucket/llama"}},
     "unsupported model.uri gs://bucket/llama"),
    ("hf-uri-without-org", {"model": {"uri": "hf://llama"}}, "unsupported model.uri hf://llama"),
    ("relative-file-uri", {"model": {"uri": "file://models/x"}}, "unsupported model.uri"),
    ("other-embedded-model", {"model": {"uri": "embedded://tinyllama"}}, "unsupported model.uri"),
    ("pvc-path-climbing-out", {"model": {"uri": "pvc://w/../../etc"}},
     "a pvc:// path may not contain '..' segments"),
    ("target-usage-zero", {"model": EMBEDDED,
                           "autoscaling": {"maxReplicas": 2, "targetCacheUsage": 0}},
     "below minimum 0"),
    ("target-usage-above-one", {"model": EMBEDDED,
                                "autoscaling": {"maxReplicas": 2, "targetCacheUsage": 1.5}},
     "above maximum 0.95"),
    ("target-usage-at-starvation", {"model": EMBEDDED, "autoscaling": {
        "maxReplicas": 2, "targetCacheUsage": 0.95}}, "above maximum 0.95"),
    ("interval-above-a-minute", {"model": EMBEDDED, "autoscaling": {
        "maxReplicas": 2, "intervalSeconds": 61}}, "above maximum 60"),
    ("queue-target-negative", {"model": EMBEDDED,
                               "autoscaling": {"maxReplicas": 2, "targetQueueDepth": -1}},
     "below minimum 0"),
    ("saturation-zero", {"model": EMBEDDED,
                         "autoscaling": {"maxReplicas": 2, "targetSaturation": 0}},
     "below minimum 0"),
    ("saturation-above-one", {"model": EMBEDDED,
                              "autoscaling": {"maxReplicas": 2, "targetSaturation": 1.5}},
     "above maximum 1"),
    ("slo-ttft-zero", {"model": EMBEDDED, "autoscaling": {"maxReplicas": 2,
                                                         "slo": {"ttftSeconds": 0}}},
     "below minimum 0"),
    ("slo-itl-negative", {"model": EMBEDDED, "autoscaling": {"maxReplicas": 2,
                                                            "slo": {"itlSeconds": -1}}},
     "below minimum 0"),
    ("slo-itl-above-a-day", {"model": EMBEDDED, "autoscaling": {
        "maxReplicas": 2, "slo": {"itlSeconds": 86400.5}}}, "above maximum 86400"),
    ("slo-itl-text", {"model": EMBEDDED, "autoscaling": {"maxReplicas": 2,
                                                        "slo": {"itlSeconds": "fast"}}},
     "spec.autoscaling.slo.itlSeconds"),
    ("slo-percentile-one", {"model": EMBEDDED, "autoscaling": {
        "maxReplicas": 2, "slo": {"itlSeconds": 0.1, "percentile": 1}}}, "above maximum 1"),
    ("slo-percentile-zero", {"model": EMBEDDED, "autoscaling": {
        "maxReplicas": 2, "slo": {"ttftSeconds": 2, "percentile": 0}}}, "below minimum 0"),
    ("slo-without-target", {"model": EMBEDDED, "autoscaling": {
        "maxReplicas": 2, "slo": {"percentile": 0.5}}},
     "autoscaling.slo needs ttftSeconds or itlSeconds"),
    ("keda-with-slo",
     {"model": EMBEDDED, "autoscaling": {"maxReplicas": 3, "engine": "keda",
                                         "slo": {"itlSeconds": 0.1},
                                         "metrics": {"source": "prometheus",
                                                     "url": "http://prom:9090"}}},
     "autoscaling.engine keda cannot take autoscaling.slo"),
    ("prometheus-without-url", {"model": EMBEDDED, "autoscaling": {
        "maxReplicas": 2, "metrics": {"source": "prometheus"}}},
     "autoscaling.metrics.url is required"),
    ("managed-flag-in-extra-args", {"model": EMBEDDED, "engine": {"extraArgs": ["--port=9000"]}},
     "must not repeat a flag the operator sets"),
    ("odd-block-size", {"model": EMBEDDED, "engine": {"blockSize": 12}}, "12 not in"),
    ("gpu-utilization-zero", {"model": EMBEDDED, "engine": {"gpuMemoryUtilization": 0}},
     "below minimum 0"),
    ("negative-replicas", {"model": EMBEDDED, "replicas": -1}, "below minimum 0"),
    ("min-replicas-negative", {"model": EMBEDDED, "autoscaling": {"minReplicas": -1, "maxReplicas": 2}},
     "below minimum 0"),
    ("scale-to-zero-without-router",
     {"model": EMBEDDED, "autoscaling": {"minReplicas": 0, "maxReplicas": 2},
      "router": {"enabled": False}},
     "scale to zero"),
    ("scale-to-zero-gateway",
     {"model": EMBEDDED, "autoscaling": {"minReplicas": 0, "maxReplicas": 2},
      "router": {"mode": "gateway", "gateway": {"endpointPickerRef": {"name": "epp"}}}},
     "scale to zero"),
    ("activation-timeout-zero",
     {"model": EMBEDDED, "autoscaling": {"minReplicas": 0, "maxReplicas": 2,
                                         "activationTimeoutSeconds": 0}},
     "below minimum 1"),
    ("tensor-parallel-not-dividing-gpus",
     {"model": EMBEDDED, "engine": {"tensorParallelSize": 3},
      "resources": {"limits": {"nvidia.com/gpu": 4}}},
     "engine.tensorParallelSize must divide the pod's GPU count"),
    ("tensor-parallel-in-extra-args", {"model": EMBEDDED, "engine": {"extraArgs": ["-tp", "2"]}},
     "must not repeat a flag the operator sets"),
    ("tensor-parallel-zero", {"model": EMBEDDED, "engine": {"tensorParallelSize": 0}},
     "below minimum 1"),
    ("shm-size-not-a-quantity", {"model": EMBEDDED, "engine": {"shmSize": "2 GB"}},
     "does not match"),
    ("autoscaling-engine-unknown",
     {"model": EMBEDDED, "autoscaling": {"maxReplicas": 3, "engine": "hpa"}}, "hpa"),
    ("keda-with-pods-source",
     {"model": EMBEDDED, "autoscaling": {"maxReplicas": 3, "engine": "keda"}},
     "autoscaling.engine keda needs autoscaling.metrics.source prometheus"),
    ("keda-scale-to-zero",
     {"model": EMBEDDED, "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "engine": "keda",
                                         "metrics": {"source": "prometheus",
                                                     "url": "http://prom:9090"}}},
     "autoscaling.engine keda needs autoscaling.minReplicas >= 1"),
    ("keda-node-headroom",
     {"model": EMBEDDED, "autoscaling": {"maxReplicas": 3, "engine": "keda",
                                         "nodeStartupSeconds": 300,
                                         "metrics": {"source": "prometheus",
                                                     "url": "http://prom:9090"}}},
     "autoscaling.engine keda needs autoscaling.nodeStartupSeconds 0"),
    # KEDA reads a threshold as a milli-quantity: 1e-4 would be a target of 0.
    *[(f"keda-{field}-under-a-thousandth",
       {"model": EMBEDDED, "autoscaling": {"maxReplicas": 3, "engine": "keda", field: 0.0001,
                                           "metrics": {"source": "prometheus",
                                                       "url": "http://prom:9090"}}},
       "KEDA reads its thresholds in thousandths")
      for field in ("targetCacheUsage", "targetQueueDepth", "targetSaturation")],
]


@pytest.mark.parametrize("case,spec,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_bad_specs_are_refused_by_the_crd_and_the_operator(crd, case, spec, message):
    _, errors = admit(crd, obj(spec))
    assert errors, f"{case} was admitted"
    assert any(message in e for e in errors), errors
    with pytest.raises(SpecError):
        parse_spec(copy.deepcopy(spec))


def test_bad_names_are_refused(crd):
    _, errors = admit(crd, obj({"model": EMBEDDED}, name="Chat.v2"))
    assert any("DNS-1035" in e for e in errors)
    _, errors = admit(crd, obj({"model": EMBEDDED}, name="a" * 64))
    assert any("DNS-1035" in e for e in errors)
    # The router's Service is NAME-router: 56 characters while it runs, else 63.
    assert admit(crd, obj({"model": EMBEDDED}, name="a" * 56))[1] == []
    _, errors = admit(crd, obj({"model": EMBEDDED}, name="a" * 57))
    assert errors == ["<root>: metadata.name must be at most 56 characters while spec.router"
                      " runs in router mode: the router's Deployment and Service are named"
                      " NAME-router (a Service name has at most 63)"]
    with pytest.raises(SpecError, match=r"metadata\.name: got 'a{57}'; at most 56 characters"):
        check_name("a" * 57, parse_spec({"model": EMBEDDED}).router)
    for router in ({"enabled": False},
                   {"mode": "gateway", "gateway": {"endpointPickerRef": {"name": "epp"}}}):
        spec = {"model": EMBEDDED, "router": router}
        assert admit(crd, obj(spec, name="a" * 63))[1] == []
        check_name("a" * 63, parse_spec(spec).router)


def test_c16_kubectl_scale_is_refused_with_autoscaling(crd):
    """``kubectl scale`` writes spec.replicas through the scale subresource; the CEL rule
    on spec refuses it for an autoscaled object, saying why and what to do instead."""
    stored, errors = admit(crd, obj({"model": EMBEDDED, "autoscaling": {"maxReplicas": 4}}))
    assert errors == []
    scaled = copy.deepcopy(stored)
    scaled["spec"]["replicas"] = 4
    _, errors = admit(crd, scaled)
    assert len(errors) == 1
    assert "kubectl scale" in errors[0] and "autoscaling.minReplicas/maxReplicas" in errors[0]


def test_kubectl_scale_works_on_static_replicas(crd):
    stored, _ = admit(crd, obj({"model": EMBEDDED, "replicas": 1}))
    stored["spec"]["replicas"] = 3
    assert admit(crd, stored)[1] == []


def test_status_fields_outside_the_schema_are_pruned(crd):
    """The failure mode C14 guards against, shown on the offline model."""
    stored, _ = admit(crd, {**obj({"model": EMBEDDED}),
                            "status": {"readyReplicas": 1, "kopf": {"progress": {}}}})
    assert stored["status"] == {"readyReplicas": 1}


def _autoscaling_edges(crd) -> list[dict]:
    """Each autoscaling field at the lowest and highest value the CRD admits."""
    props = sub_schema(root_schema(crd), "spec.autoscaling")["properties"]
    edges = []
    for name, schema in props.items():
        if "minimum" not in schema:
            continue
        step = 1 if schema["type"] == "integer" else 0.001
        low = schema["minimum"] + (step if schema.get("exclusiveMinimum") else 0)
        high = schema["maximum"] - (step if schema.get("exclusiveMaximum") else 0)
        for value in (low, high):
            edge = {"maxReplicas": 1000, name: value}
            if name == "maxReplicas":
                edge["minReplicas"] = 1
            edges.append(edge)
    return edges


def test_every_admitted_autoscaling_spec_is_usable_by_the_policy(crd):
    """The CRD must not accept what the autoscaler cannot use (a controller failing later
    instead of `kubectl apply` refusing): the edges of every range go through both."""
    from kvpilot.autoscaler import spec as spec_module

    for edge in _autoscaling_edges(crd):
        stored, errors = admit(crd, obj({"model": EMBEDDED, "autoscaling": edge}))
        assert errors == [], (edge, errors)
        parse_spec(stored["spec"])
        spec_module.AutoscalingSpec.from_crd(stored["spec"]["autoscaling"])



def _validation_rules(schema: dict, path: str = ""):
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for name, sub in schema.get("properties", {}).items():
        yield from _validation_rules(sub, f"{path}.{name}")
    if "items" in schema:
        yield from _validation_rules(schema["items"], f"{path}[]")


def _defaulted_objects(schema: dict, path: str = ""):
    for name, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object" and "default" in sub:
            yield f"{path}.{name}", sub
        yield from _defaulted_objects(sub, f"{path}.{name}")


def test_rules_pass_the_api_servers_own_checks(crd):
    """Two refusals a real kube-apiserver gave this CRD (found by `make e2e`): a
    messageExpression with string(<int>) has no size bound, so its estimated cost is over
    budget; and the rules of an object with a ``default`` are evaluated against that bare
    default (nested defaults not applied), so they must not read a field it lacks."""
    schema = root_schema(crd)
    for path, rule in _validation_rules(schema):
        assert "string(" not in rule.get("messageExpression", ""), (path, rule)
    for path, sub in _defaulted_objects(schema):
        activation = {"self": to_cel(sub, sub["default"])}
        for rule in sub.get("x-kubernetes-validations", []):
            result = _program(rule["rule"]).evaluate(activation)
            assert not isinstance(result, Exception), (path, rule["rule"], result)


def test_platform_fields_are_admitted_whole_and_parse(crd):
    """podLabels, runtimeClassName, topologySpreadConstraints, volumes, volumeMounts and
    envFrom survive the API server's pruning (core/v1 objects kept whole) and parse."""
    from .test_builders import PLATFORM

    spec = {"model": EMBEDDED, **copy.deepcopy(PLATFORM)}
    stored, errors = admit(crd, obj(spec))
    assert errors == []
    for key, value in PLATFORM.items():
        assert stored["spec"][key] == value, key
    parse_spec(stored["spec"])


def test_condition_types_are_open_but_well_formed(crd):
    """A pattern (metav1.Condition's), not an enum: a newer operator may add a type."""
    def status(kind):
        return {**obj({"model": EMBEDDED}), "status": {"conditions": [
            {"type": kind, "status": "True", "lastTransitionTime": "2026-12-04T00:00:00Z"}]}}

    schema = root_schema(crd)
    for ok in ("Ready", "NodeHeadroom", "example.com/Drained"):
        assert validate(schema, status(ok)) == [], ok
    for bad in ("not a type", "Ready!", ""):
        assert validate(schema, status(bad)), bad


@pytest.mark.parametrize("slo", [
    {"itlSeconds": 0.001}, {"ttftSeconds": 86400}, {"itlSeconds": 1e-6, "ttftSeconds": 0.5},
    {"itlSeconds": 0.05, "percentile": 0.5}, {"ttftSeconds": 2, "percentile": 0.999},
])
def test_slo_edges_the_crd_admits_parse_and_default_to_p90(crd, slo):
    stored, errors = admit(crd, obj({"model": EMBEDDED,
                                     "autoscaling": {"maxReplicas": 3, "slo": slo}}))
    assert errors == []
    assert stored["spec"]["autoscaling"]["slo"]["percentile"] == slo.get("percentile", 0.9)
    parsed = parse_spec(stored["spec"]).autoscaling.slo
    assert parsed.percentile == slo.get("percentile", 0.9)
    assert parsed.itl_seconds == slo.get("itlSeconds")
    assert parsed.ttft_seconds == slo.get("ttftSeconds")
    assert parsed.profile == "cpu"


def test_slo_on_a_gpu_pod_starts_from_the_gpu_prior():
    spec = {"model": EMBEDDED, "autoscaling": {"maxReplicas": 3, "slo": {"itlSeconds": 0.05}},
            "resources": {"limits": {"nvidia.com/gpu": 1}}}
    assert parse_spec(spec).autoscaling.slo.profile == "gpu"


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_every_quantization_is_admitted_and_parses(crd, quantization):
    stored, errors = admit(crd, obj({"model": {**EMBEDDED, "quantization": quantization}}))
    assert errors == []
    assert parse_spec(stored["spec"]).model.quantization == quantization


def test_quantization_has_no_default(crd):
    """Unset means auto (the engine reads the checkpoint); no default, so objects that
    predate the field read back unchanged."""
    stored, errors = admit(crd, obj({"model": EMBEDDED}))
    assert errors == [] and "quantization" not in stored["spec"]["model"]
    assert parse_spec(stored["spec"]).model.quantization == "auto"
