"""parse_spec: defaults, typed values, and errors that name the field, the value and
what is allowed (house style: errors a person can act on)."""

from __future__ import annotations

import re

import pytest

from kvpilot.operator.model_uri import parse_model_uri
from kvpilot.operator.spec import SpecError, check_name, parse_spec

EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}


def test_minimal_spec_gets_the_crd_defaults():
    spec = parse_spec({"model": EMBEDDED})
    e = spec.engine
    assert (e.kv_cache_dtype, e.max_num_batched_tokens, e.max_num_seqs, e.block_size) == (
        "auto", 2048, 256, 16)
    assert e.enable_prefix_caching is True and e.image is None and e.extra_args == ()
    assert spec.replicas is None and spec.autoscaling is None
    assert spec.static_replicas == 1
    assert spec.pod.termination_grace_period_seconds == 300


def test_static_and_autoscaled_replicas():
    assert parse_spec({"model": EMBEDDED, "replicas": 0}).static_replicas == 0
    spec = parse_spec({"model": EMBEDDED, "autoscaling": {"maxReplicas": 5}})
    assert spec.static_replicas is None
    a = spec.autoscaling
    assert (a.min_replicas, a.max_replicas, a.target_cache_usage, a.target_queue_depth) == (
        1, 5, 0.75, 4.0)
    assert (a.startup_seconds, a.scale_up_stabilization_seconds,
            a.scale_down_stabilization_seconds, a.interval_seconds) == (120, 0, 300, 15)
    assert a.metrics.source == "pods" and a.metrics.url is None
    assert [a.clamp(n) for n in (0, 1, 3, 5, 9)] == [1, 1, 3, 5, 5]


@pytest.mark.parametrize("spec,field,value,allowed", [
    ({"model": EMBEDDED, "engine": {"kvCacheDtype": "fp16"}}, "engine.kvCacheDtype", "fp16",
     "one of auto, bfloat16, float16, float32, fp8, fp8_e4m3, fp8_e5m2, fp4_e2m1, int4"),
    ({"model": EMBEDDED, "engine": {"maxNumSeqs": True}}, "engine.maxNumSeqs", True,
     "an integer in [1, 65536] is required"),
    ({"model": EMBEDDED, "engine": {"maxNumBatchedTokens": 2.5}}, "engine.maxNumBatchedTokens",
     2.5, "an integer in [1, 1048576] is required"),
    ({"model": EMBEDDED, "engine": {"gpuMemoryUtilization": 0}}, "engine.gpuMemoryUtilization",
     0, "a number in (0.0, 1.0] is required"),
    ({"model": EMBEDDED, "autoscaling": {"maxReplicas": 2, "targetCacheUsage": "high"}},
     "autoscaling.targetCacheUsage", "high", "a number in (0.0, 0.95) is required"),
    ({"model": EMBEDDED, "autoscaling": {"maxReplicas": 2, "targetCacheUsage": 0.95}},
     "autoscaling.targetCacheUsage", 0.95, "a number in (0.0, 0.95) is required"),
    ({"model": EMBEDDED, "autoscaling": {"maxReplicas": 2, "intervalSeconds": 90}},
     "autoscaling.intervalSeconds", 90, "an integer in [1, 60] is required"),
    ({"model": EMBEDDED, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
     "autoscaling.minReplicas", 3, "must be <= autoscaling.maxReplicas (2)"),
    ({"model": EMBEDDED, "autoscaling": {"maxReplicas": 2, "metrics": {
        "source": "prometheus", "url": "prometheus:9090"}}},
     "autoscaling.metrics.url", "prometheus:9090", "an http(s) URL is required"),
    ({"model": {"uri": "gs://b/m"}}, "model.uri", "gs://b/m", "unsupported model URI"),
    ({"model": {}}, "model.uri", None, "a non-empty string is required"),
    ({}, "model.uri", None, "a non-empty string is required"),
    ({"model": EMBEDDED, "engine": {"extraArgs": ["--max-num-seqs=3"]}}, "engine.extraArgs",
     "--max-num-seqs=3", "set the matching spec field"),
    ({"model": EMBEDDED, "env": [{"value": "x"}]}, "env", {"value": "x"},
     "each entry needs a string name"),
    ({"model": EMBEDDED, "engine": "fast"}, "engine", "fast", "an object is required"),
])
def test_errors_name_field_value_and_allowed(spec, field, value, allowed):
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    err = info.value
    assert (err.field, err.value) == (field, value)
    assert allowed in str(err)
    assert str(err).startswith(f"spec.{field}: got {value!r}")


def test_check_name():
    check_name("llama3-8b")
    for bad in ("Llama", "1llama", "llama-", "a" * 64, "llama.v2"):
        with pytest.raises(SpecError, match=r"^metadata.name: got .*DNS-1035"):
            check_name(bad)


@pytest.mark.parametrize("uri,scheme,model_arg,served,extra", [
    ("embedded://smollm2-135m-instruct", "embedded", "embedded://smollm2-135m-instruct", None, {}),
    ("hf://meta-llama/Meta-Llama-3-8B-Instruct", "hf", "/models/meta-llama--Meta-Llama-3-8B-Instruct",
     "meta-llama/Meta-Llama-3-8B-Instruct", {"hf_repo": "meta-llama/Meta-Llama-3-8B-Instruct"}),
    ("pvc://weights", "pvc", "/models", None, {"claim_name": "weights"}),
    ("pvc://weights/llama/3", "pvc", "/models/llama/3", None, {"claim_name": "weights"}),
    ("file:///opt/m.gguf", "file", "/opt/m.gguf", None, {}),
    ("s3://models/llama/llama-3-8b/", "s3", "/models/llama-3-8b", "llama-3-8b", {}),
    ("s3://llama-weights", "s3", "/models/llama-weights", "llama-weights", {}),
    ("oci://ghcr.io/acme/models/qwen3:v2", "oci", "/models/qwen3", "qwen3",
     {"oci_reference": "ghcr.io/acme/models/qwen3:v2"}),
])
def test_model_uris(uri, scheme, model_arg, served, extra):
    source = parse_model_uri(uri)
    assert (source.scheme, source.model_arg, source.served_model_name) == (scheme, model_arg, served)
    for key, value in extra.items():
        assert getattr(source, key) == value
    assert parse_model_uri(uri, "mine").served_model_name == "mine"


@pytest.mark.parametrize("uri", ["gs://b/k", "hf://only", "pvc://Upper/x", "file://rel",
                                 "embedded://other", "pvc://w/ space", ""])
def test_bad_model_uris(uri):
    with pytest.raises(ValueError, match=r"unsupported model URI .*use hf://ORG/NAME"):
        parse_model_uri(uri)


@pytest.mark.parametrize(("uri", "message"), [
    ("s3://b/k", "use s3://BUCKET"),  # a bucket name has 3 characters at least
    ("s3://bucket/a/../b", "'..' segments"),
    ("oci://ghcr.io/Acme/m", "use oci://REGISTRY"),
])
def test_bad_object_store_and_registry_uris(uri, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_model_uri(uri)


@pytest.mark.parametrize(("model", "field", "allowed"), [
    ({"uri": "hf://org/m", "credentialsSecret": "creds"}, "model.credentialsSecret",
     "is for s3:// and oci:// models"),
    ({"uri": "s3://bucket/m", "credentialsSecret": "Not_A_Name"}, "model.credentialsSecret",
     "a Secret name"),
    ({"uri": "s3://bucket/m", "ociMount": "ImageVolume"}, "model.ociMount", "is for oci://"),
    ({"uri": "oci://r.io/m:v1", "ociMount": "Mounted"}, "model.ociMount",
     "must be one of InitContainer, ImageVolume"),
])
def test_model_fetch_options_are_checked(model, field, allowed):
    with pytest.raises(SpecError) as info:
        parse_spec({"model": model})
    assert info.value.field == field and allowed in info.value.allowed


@pytest.mark.parametrize("uri", ["pvc://w/../../etc", "pvc://w/a/..", "pvc://w/.."])
def test_a_pvc_path_may_not_climb_out_of_the_claim(uri):
    with pytest.raises(ValueError, match=r"may not contain '\.\.' segments"):
        parse_model_uri(uri)
    assert parse_model_uri("pvc://w/a..b/c").model_arg == "/models/a..b/c"  # not a segment


def test_the_operator_and_the_crd_agree_on_served_names_and_maxima():
    """Found in review: "my model" passed the operator but not the CRD; maxModelLen 2^30+1
    and a cost of 1e12 passed the CRD but not the operator."""
    from tests.operator.crdschema import load_crd, root_schema, sub_schema

    with pytest.raises(SpecError, match=r"model\.servedModelName"):
        parse_spec({"model": {"uri": "embedded://smollm2-135m-instruct",
                              "servedModelName": "my model"}})
    spec = sub_schema(root_schema(load_crd()), "spec")
    assert spec["properties"]["engine"]["properties"]["maxModelLen"]["maximum"] == 1 << 30
    assert spec["properties"]["finops"]["properties"]["costPerReplicaHour"]["maximum"] == 1e9
