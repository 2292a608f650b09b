"""s3:// and oci:// models in the engine pod: the init container that runs `kvpilot
fetch-model` (credentials from model.credentialsSecret, after the user's envFrom), or, for
oci:// with ociMount ImageVolume, an image volume the kubelet mounts; and the CRD admits
and refuses the same specs as the operator."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from kvpilot.operator.spec import SpecError, parse_spec

from .crdschema import admit, load_crd
from .test_builders import build
from .test_crd import obj

S3 = {"uri": "s3://models/llama/llama-3-8b", "credentialsSecret": "s3-creds"}
OCI = {"uri": "oci://ghcr.io/acme/models/qwen3:v2"}


def _pod(model: dict, **spec) -> dict:
    children = build({"model": model, **spec})
    for item in children.all():
        if item["kind"] != "PodMonitor":
            kubernetes_validate.validate(item, "1.36.0", strict=True)
    return children.deployment["spec"]["template"]["spec"]


def _volume(pod: dict, name: str) -> dict:
    return next(v for v in pod["volumes"] if v["name"] == name)


def test_an_s3_model_is_fetched_by_an_init_container_with_the_credentials_secret():
    pod = _pod(S3, envFrom=[{"configMapRef": {"name": "proxy"}}])
    (init,) = pod["initContainers"]
    assert init["name"] == "model-download"
    assert init["command"] == ["kvpilot", "fetch-model", "s3://models/llama/llama-3-8b",
                               "/models/llama-3-8b"]
    # The user's envFrom first, the credentials last (their keys win).
    assert init["envFrom"] == [{"configMapRef": {"name": "proxy"}},
                               {"secretRef": {"name": "s3-creds"}}]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    assert _volume(pod, "models") == {"name": "models", "emptyDir": {}}
    engine = pod["containers"][0]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    args = engine["args"]
    assert args[args.index("--model") + 1] == "/models/llama-3-8b"
    assert args[args.index("--served-model-name") + 1] == "llama-3-8b"
    # The credentials are the download's only: the engine never sees them.
    assert {"secretRef": {"name": "s3-creds"}} not in engine.get("envFrom", [])


def test_an_oci_model_is_pulled_by_the_init_container_by_default():
    pod = _pod(OCI)
    (init,) = pod["initContainers"]
    assert init["command"] == ["kvpilot", "fetch-model", "oci://ghcr.io/acme/models/qwen3:v2",
                               "/models/qwen3"]
    assert "envFrom" not in init
    assert _volume(pod, "models") == {"name": "models", "emptyDir": {}}


def test_an_oci_model_as_an_image_volume_needs_no_init_container():
    pod = _pod({**OCI, "ociMount": "ImageVolume"}, imagePullSecrets=[{"name": "ghcr"}])
    assert "initContainers" not in pod
    assert _volume(pod, "models") == {"name": "models", "image": {
        "reference": "ghcr.io/acme/models/qwen3:v2", "pullPolicy": "IfNotPresent"}}
    engine = pod["containers"][0]
    assert {"name": "models", "mountPath": "/models/qwen3", "readOnly": True} in engine["volumeMounts"]
    assert engine["args"][engine["args"].index("--model") + 1] == "/models/qwen3"
    assert pod["imagePullSecrets"] == [{"name": "ghcr"}]  # the kubelet's pull credentials


@pytest.fixture(scope="module")
def crd():
    return load_crd()


@pytest.mark.parametrize("model", [S3, OCI, {**OCI, "ociMount": "ImageVolume"},
                                   {"uri": "s3://bucket"}, {"uri": "s3://bucket/"},
                                   {"uri": "s3://bucket//models/m/"}, {"uri": "s3://bucket/a/.cfg/..x"},
                                   {"uri": "oci://localhost:5000/m"},
                                   {"uri": "oci://registry.local:5000/m@sha256:" + "a" * 64}])
def test_the_crd_admits_s3_and_oci_models_and_the_operator_parses_them(crd, model):
    assert admit(crd, obj({"model": model}))[1] == []
    parse_spec(copy.deepcopy({"model": model}))


@pytest.mark.parametrize(("model", "message"), [
    ({"uri": "hf://org/m", "credentialsSecret": "c"}, "model.credentialsSecret is for s3://"),
    ({"uri": "s3://bucket/m", "ociMount": "ImageVolume"}, "model.ociMount is for oci://"),
    ({"uri": "s3://B/m"}, "unsupported model.uri"),
    ({"uri": "oci://ghcr.io/Acme/m"}, "unsupported model.uri"),
    # What the operator's parser refuses, the CRD refuses at apply time too.
    ({"uri": "oci://reg.io/foo/"}, "unsupported model.uri"),
    ({"uri": "oci://registry/m:v1"}, "unsupported model.uri"),  # no dot, no port: Docker Hub
    ({"uri": "oci://reg.io/a//b"}, "unsupported model.uri"),
    ({"uri": "s3://bucket/a//b"}, "unsupported model.uri"),
    ({"uri": "s3://bucket/a/../b"}, "unsupported model.uri"),
    ({"uri": "s3://bucket/./b"}, "unsupported model.uri"),
    ({"uri": "oci://r.io/m", "ociMount": "Mounted"}, "not in ['InitContainer', 'ImageVolume']"),
])
def test_the_crd_and_the_operator_refuse_the_same_model_specs(crd, model, message):
    _, errors = admit(crd, obj({"model": model}))
    assert any(message in e for e in errors), errors
    with pytest.raises(SpecError):
        parse_spec(copy.deepcopy({"model": model}))


def test_credentials_are_refused_with_an_image_volume(crd):
    spec = {"model": {**OCI, "ociMount": "ImageVolume", "credentialsSecret": "c"}}
    with pytest.raises(SpecError, match="imagePullSecrets"):
        parse_spec(spec)
    _, errors = admit(crd, obj(spec))  # the API server refuses it too, at apply time
    assert len(errors) == 1 and "not used with model.ociMount ImageVolume" in errors[0], errors


@pytest.mark.parametrize("uri", ["s3://bucket/p\n", "s3://bucket\n", "oci://ghcr.io/acme/m:v1\n",
                                 "hf://org/name\n", "pvc://claim\n", "file:///models/x\n"])
def test_a_trailing_newline_is_not_a_uri(crd, uri):
    """Python's ``$`` also matches before a final newline; the API server's patterns (and
    now the operator's) take the whole string."""
    with pytest.raises(SpecError, match=r"model\.uri"):
        parse_spec({"model": {"uri": uri}})
