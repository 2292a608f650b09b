"""LoRA adapters, the operator's side: ``spec.adapters`` and ``spec.engine.lora`` as the
CRD (schema and CEL, offline) and the parser refuse or accept them, and what the builders
and the reconcile make of them (engine flags, env, the adapters ConfigMap and its mount,
a pod template that an adapter list change leaves alone)."""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.builders import Owner, build_children
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile import Resource, reconcile
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.spec.adapters import LoraSpec

from .crdschema import admit, load_crd
from .fakes import T0, FakeKubeApi, inference

OWNER = Owner("chat", "llm", "uid-chat")
IMAGE = "kvpilot/engine:test"
EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
HF_MODEL = {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}
SQL = {"name": "sql", "uri": "s3://adapters/llama/sql-lora"}
CHAT = {"name": "team/chat-v2", "uri": "hf://acme/chat-lora"}
BAKED = {"name": "baked", "uri": "file:///opt/adapters/baked"}
OCI = {"name": "oci:1", "uri": "oci://registry.example.com/adapters/tone:v1"}


@pytest.fixture(scope="module")
def crd():
    return load_crd()


def obj(spec: dict) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": "chat", "namespace": "llm"}, "spec": spec}


def children(spec: dict):
    return build_children(OWNER, parse_spec(spec), 1, IMAGE, False)


def engine(built) -> dict:
    (container,) = built.deployment["spec"]["template"]["spec"]["containers"]
    return container


# ---------------------------------------------------------------- spec and CRD
def test_adapters_and_lora_limits_are_admitted_defaulted_and_parsed(crd):
    spec = {"model": HF_MODEL, "adapters": [SQL, CHAT, BAKED, OCI], "engine": {"lora": {}},
            "router": {"enabled": False}}
    stored, errors = admit(crd, obj(spec))
    assert errors == []
    assert stored["spec"]["engine"]["lora"] == {"maxLoras": 1, "maxLoraRank": 16}
    parsed = parse_spec(stored["spec"])
    assert [(a.name, a.uri, a.scheme) for a in parsed.adapters] == [
        ("sql", SQL["uri"], "s3"), ("team/chat-v2", CHAT["uri"], "hf"),
        ("baked", BAKED["uri"], "file"), ("oci:1", OCI["uri"], "oci")]
    assert parsed.lora == LoraSpec(1, 16, None) and parsed.lora_enabled


def test_lora_is_off_without_adapters_or_limits_and_on_with_either():
    assert not parse_spec({"model": EMBEDDED}).lora_enabled
    assert parse_spec({"model": EMBEDDED}).lora is None
    assert parse_spec({"model": EMBEDDED, "adapters": []}).lora is None
    assert parse_spec({"model": EMBEDDED, "adapters": [SQL]}).lora == LoraSpec()
    limits = parse_spec({"model": EMBEDDED, "engine": {"lora": {"maxLoras": 4, "maxLoraRank": 64,
                                                              "maxCpuLoras": 8}}})
    assert limits.lora == LoraSpec(4, 64, 8) and limits.adapters == ()


# (case, spec, a piece of the API server's message, the field the parser names)
REFUSED = [
    ("duplicate-name", {"model": EMBEDDED, "adapters": [SQL, {**CHAT, "name": "sql"}]},
     "names must be unique", "adapters[1].name"),
    ("name-with-space", {"model": EMBEDDED, "adapters": [{**SQL, "name": "my adapter"}]},
     "does not match", "adapters[0].name"),
    ("name-starting-with-dash", {"model": EMBEDDED, "adapters": [{**SQL, "name": "-x"}]},
     "does not match", "adapters[0].name"),
    ("name-too-long", {"model": EMBEDDED, "adapters": [{**SQL, "name": "a" * 129}]},
     "length 129 out of bounds", "adapters[0].name"),
    ("name-is-the-served-model", {"model": {**EMBEDDED, "servedModelName": "base"},
                                  "adapters": [{**SQL, "name": "base"}]},
     "may not be the base model's served name", "adapters[0].name"),
    ("name-is-the-hf-repo-id", {"model": HF_MODEL,
                                "adapters": [{**SQL, "name": "meta-llama/Llama-3.1-8B-Instruct"}]},
     "may not be the base model's served name", "adapters[0].name"),
    ("pvc-uri", {"model": EMBEDDED, "adapters": [{**SQL, "uri": "pvc://adapters/sql"}]},
     "pvc:// adapters are not supported", "adapters[0].uri"),
    ("gs-uri", {"model": EMBEDDED, "adapters": [{**SQL, "uri": "gs://bucket/sql"}]},
     "unsupported adapter uri gs://bucket/sql", "adapters[0].uri"),
    ("relative-file-uri", {"model": EMBEDDED, "adapters": [{**SQL, "uri": "file://sql"}]},
     "unsupported adapter uri", "adapters[0].uri"),
    ("hf-without-org", {"model": EMBEDDED, "adapters": [{**SQL, "uri": "hf://sql"}]},
     "unsupported adapter uri", "adapters[0].uri"),
    ("embedded-uri", {"model": EMBEDDED, "adapters": [{**SQL, "uri": EMBEDDED["uri"]}]},
     "unsupported adapter uri", "adapters[0].uri"),
    ("oci-without-registry-dot", {"model": EMBEDDED,
                                  "adapters": [{**SQL, "uri": "oci://zot/adapters/x"}]},
     "unsupported adapter uri", "adapters[0].uri"),
    ("too-many", {"model": EMBEDDED,
                  "adapters": [{"name": f"a{i}", "uri": f"hf://org/a{i}"} for i in range(65)]},
     "65 items above maxItems 64", "adapters"),
    ("rank-not-vllms", {"model": EMBEDDED, "engine": {"lora": {"maxLoraRank": 24}}},
     "24 not in", "engine.lora.maxLoraRank"),
    ("max-loras-zero", {"model": EMBEDDED, "engine": {"lora": {"maxLoras": 0}}},
     "below minimum 1", "engine.lora.maxLoras"),
    ("cpu-loras-below-max-loras", {"model": EMBEDDED,
                                   "engine": {"lora": {"maxLoras": 4, "maxCpuLoras": 2}}},
     "maxCpuLoras must be >= engine.lora.maxLoras", "engine.lora.maxCpuLoras"),
    ("secret-with-lora-off", {"model": {**HF_MODEL, "credentialsSecret": "s3"}, "adapters": []},
     "model.credentialsSecret is for s3:// and oci:// models and for LoRA adapters",
     "model.credentialsSecret"),
    ("lora-flag-in-extra-args", {"model": EMBEDDED, "engine": {"extraArgs": ["--max-loras=4"]}},
     "must not repeat a flag the operator sets", "engine.extraArgs"),
    ("lora-switch-off-in-extra-args", {"model": EMBEDDED, "adapters": [SQL],
                                       "engine": {"extraArgs": ["--no-enable-lora"]}},
     "must not repeat a flag the operator sets", "engine.extraArgs"),
    ("adapters-file-in-extra-args", {"model": EMBEDDED, "engine": {
        "extraArgs": ["--lora-adapters-file", "/x.json"]}},
     "must not repeat a flag the operator sets", "engine.extraArgs"),
]


@pytest.mark.parametrize("case,spec,message,field", REFUSED, ids=[r[0] for r in REFUSED])
def test_bad_adapter_specs_are_refused_by_the_crd_and_the_operator(crd, case, spec, message,
                                                                     field):
    _, errors = admit(crd, obj(copy.deepcopy(spec)))
    assert any(message in e for e in errors), errors
    with pytest.raises(SpecError) as info:
        parse_spec(copy.deepcopy(spec))
    assert info.value.field == field


def test_refusals_name_the_field_the_value_and_what_is_allowed():
    with pytest.raises(SpecError) as info:
        parse_spec({"model": EMBEDDED, "adapters": [{**SQL, "uri": "pvc://claim/sql"}]})
    assert str(info.value).startswith("spec.adapters[0].uri: got 'pvc://claim/sql'; pvc://")
    assert "file:///MOUNT/PATH" in str(info.value)
    with pytest.raises(SpecError, match=r"spec.engine.lora.maxLoraRank: got 24; one of 1, 8, 16"):
        parse_spec({"model": EMBEDDED, "engine": {"lora": {"maxLoraRank": 24}}})
    with pytest.raises(SpecError, match=r"spec.adapters\[1\].name: got 'sql'; adapter names must"):
        parse_spec({"model": EMBEDDED, "adapters": [SQL, {**CHAT, "name": "sql"}]})


def test_the_s3_models_default_name_is_refused_by_the_operator():
    """An s3:// model is served as its prefix's last segment: the CRD cannot derive it,
    the parser does."""
    with pytest.raises(SpecError) as info:
        parse_spec({"model": {"uri": "s3://models/llama-8b"}, "adapters": [{**SQL, "name": "llama-8b"}]})
    assert info.value.field == "adapters[0].name"


@pytest.mark.parametrize("model", [HF_MODEL, EMBEDDED,
                                   {"uri": "oci://registry.example.com/m/llama:1",
                                    "ociMount": "ImageVolume"}])
def test_credentials_are_allowed_with_lora_on_whatever_the_model(crd, model):
    """The engines download the adapters with them: allowed with any adapter list (so a
    list change never turns a valid spec invalid) or with engine.lora alone."""
    for lora in ({"adapters": [CHAT, SQL]}, {"adapters": [CHAT]}, {"engine": {"lora": {}}}):
        spec = {"model": {**model, "credentialsSecret": "store"}, **lora}
        assert admit(crd, obj(copy.deepcopy(spec)))[1] == [], lora
        assert parse_spec(spec).model.credentials_secret == "store"


def test_rules_hold_against_adapters_absent(crd):
    """The spec-level rules read spec.adapters only behind has()."""
    assert admit(crd, obj({"model": {**HF_MODEL}}))[1] == []
    assert admit(crd, obj({"model": {"uri": "s3://models/m", "credentialsSecret": "s"}}))[1] == []


# ---------------------------------------------------------------- builders
def test_engine_flags_env_mount_and_credentials():
    built = children({"model": {**HF_MODEL, "credentialsSecret": "store"},
                      "adapters": [SQL, CHAT], "engine": {"lora": {"maxLoras": 4,
                                                                  "maxLoraRank": 64,
                                                                  "maxCpuLoras": 8}},
                      "envFrom": [{"configMapRef": {"name": "proxy"}}]})
    container = engine(built)
    args = container["args"]
    i = args.index("--enable-lora")
    assert args[i:i + 10] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64",
                              "--max-cpu-loras", "8", "--lora-adapters-file",
                              "/etc/kvpilot/adapters/adapters.json", *args[i + 9:i + 10]]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[c.RUNTIME_LORA_ENV] == "true"
    # The engine downloads the adapters: the Secret after the user's envFrom (its keys win).
    assert container["envFrom"] == [{"configMapRef": {"name": "proxy"}},
                                    {"secretRef": {"name": "store"}}]
    assert {"name": "kvpilot-adapters", "mountPath": "/etc/kvpilot/adapters", "readOnly": True} in \
        container["volumeMounts"]
    pod = built.deployment["spec"]["template"]["spec"]
    assert {"name": "kvpilot-adapters", "configMap": {"name": "chat-adapters"}} in pod["volumes"]
    for o in built.all():
        kubernetes_validate.validate(o, "1.36.0", strict=True)


def test_the_adapters_config_map_lists_the_spec_in_order():
    built = children({"model": EMBEDDED, "adapters": [SQL, CHAT]})
    cm = built.adapters
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "chat-adapters"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
    assert cm["metadata"]["labels"][c.LABEL_OWNER] == "chat"
    assert json.loads(cm["data"]["adapters.json"]) == [SQL, CHAT]
    assert built.all()[:2] == [built.deployment, cm]
    assert "ConfigMap" not in {ref.kind for ref in built.unwanted}


def test_limits_alone_write_an_empty_list_and_lora_off_writes_nothing():
    built = children({"model": EMBEDDED, "engine": {"lora": {}}})
    assert json.loads(built.adapters["data"]["adapters.json"]) == []
    assert "--enable-lora" in engine(built)["args"]
    off = children({"model": EMBEDDED})
    container = engine(off)
    assert off.adapters is None
    assert ("ConfigMap", "chat-adapters") in {(r.kind, r.name) for r in off.unwanted}
    assert not any("lora" in a for a in container["args"])
    assert c.RUNTIME_LORA_ENV not in {e["name"] for e in container["env"]}
    assert "kvpilot-adapters" not in {v["name"] for v in off.deployment["spec"]["template"]["spec"]["volumes"]}


def test_credentials_stay_off_the_engine_without_lora():
    built = children({"model": {"uri": "s3://models/m", "credentialsSecret": "store"}})
    assert "envFrom" not in engine(built)
    download = built.deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert download["envFrom"] == [{"secretRef": {"name": "store"}}]


def template(spec: dict) -> dict:
    return children(spec).deployment["spec"]["template"]


def test_changing_the_adapter_list_leaves_the_pod_template_alone():
    """What pod-template-hash is computed from must not move with the list: no rollout."""
    base = {"model": {**HF_MODEL, "credentialsSecret": "store"}}
    one = template({**base, "adapters": [CHAT]})
    for adapters in ([CHAT, SQL], [SQL], [{**CHAT, "uri": "hf://acme/chat-lora-v3"}], [OCI, BAKED]):
        assert template({**base, "adapters": adapters}) == one, adapters
    # An empty list with the limits set keeps LoRA (and the template) as it was.
    assert template({**base, "adapters": [], "engine": {"lora": {}}}) == one
    # Turning LoRA on, or changing a limit, is a new template (a rollout).
    assert template({"model": HF_MODEL}) != template({"model": HF_MODEL, "adapters": [CHAT]})
    assert template({**base, "adapters": [CHAT], "engine": {"lora": {"maxLoras": 2}}}) != one


# ---------------------------------------------------------------- reconcile
OPTIONS = OperatorOptions(engine_image=IMAGE)


def run(api: FakeKubeApi, spec: dict, status: dict | None = None):
    body = inference(spec=spec, status=status)
    if api.stored(c.KIND, "llm", "chat") is None:
        api.put(body)
    return reconcile(api, Resource.from_body(body), OPTIONS, T0)


def test_the_config_map_is_applied_before_the_deployment_and_deleted_with_lora_off():
    api = FakeKubeApi()
    result = run(api, {"model": EMBEDDED, "adapters": [SQL], "router": {"enabled": False}})
    assert result.applied[:2] == ("ConfigMap/chat-adapters", "Deployment/chat")
    applies = [call[1] for call in api.calls if call[0] == "apply"]
    assert applies.index("ConfigMap") < applies.index("Deployment")
    assert applies.count("ConfigMap") == 1
    stored = api.stored("ConfigMap", "llm", "chat-adapters")
    assert json.loads(stored["data"]["adapters.json"]) == [SQL]
    # A new list: the ConfigMap changes, the Deployment's generation does not.
    generation = api.stored("Deployment", "llm", "chat")["metadata"]["generation"]
    run(api, {"model": EMBEDDED, "adapters": [SQL, CHAT], "router": {"enabled": False}})
    assert json.loads(api.stored("ConfigMap", "llm", "chat-adapters")["data"]["adapters.json"]) \
        == [SQL, CHAT]
    assert api.stored("Deployment", "llm", "chat")["metadata"]["generation"] == generation
    # LoRA off: the ConfigMap goes (it is ours), the status the sync wrote is dropped.
    result = run(api, {"model": EMBEDDED, "router": {"enabled": False}},
                 status={"adapters": [{"name": "sql"}], "adaptersReady": "1/1"})
    assert "ConfigMap/chat-adapters" in result.deleted
    assert api.stored("ConfigMap", "llm", "chat-adapters") is None
    assert result.status["adapters"] is None and result.status["adaptersReady"] is None
    assert c.ADAPTERS_CONDITION in result.drop_conditions


def test_a_foreign_config_map_of_that_name_is_not_taken_over():
    from kvpilot.operator.api import InvalidObjectError

    api = FakeKubeApi()
    api.put({"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": "chat-adapters", "namespace": "llm"}, "data": {}})
    with pytest.raises(InvalidObjectError, match="ConfigMap llm/chat-adapters"):
        run(api, {"model": EMBEDDED, "adapters": [SQL]})
    assert api.writes() == []
