"""Pure builders: spec -> Deployment, Service, PodDisruptionBudget, PodMonitor.

Table tests on the engine command line and pod settings, plus every built object
validated against the Kubernetes schemas (kubernetes-validate, strict: unknown fields
are errors, so a typo in a field name fails here rather than in a cluster)."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.builders import Owner, build_children
from kvpilot.operator.builders.engine_args import engine_args
from kvpilot.operator.builders.pod import startup_budget_seconds
from kvpilot.operator.spec import SpecError, parse_spec

from .crdschema import REPO

OWNER = Owner("chat", "llm", "uid-chat")
IMAGE = "kvpilot/engine:test"
EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
# What the default router (kv_aware) adds to every engine command line: vLLM's KV-events
# JSON, byte for byte.
KV_EVENTS = ["--kv-events-config",
             '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
             ' "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}']


def sample(name: str) -> dict:
    return yaml.safe_load((REPO / "crds" / "samples" / f"{name}.yaml").read_text())["spec"]


def build(spec: dict, replicas: int = 1, pod_monitor: bool = False):
    return build_children(OWNER, parse_spec(spec), replicas, IMAGE, pod_monitor)


def engine(children) -> dict:
    (container,) = children.deployment["spec"]["template"]["spec"]["containers"]
    return container


ARGS = [
    ("defaults", {"model": EMBEDDED}, [
        "--host", "0.0.0.0", "--port", "8000", "--model", "embedded://smollm2-135m-instruct",
        "--device", "cpu", "--tensor-parallel-size", "1", "--kv-cache-dtype", "auto",
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--block-size", "16",
        "--enable-prefix-caching", "--drain-timeout", "285", *KV_EVENTS,
    ]),
    ("cpu-sample", sample("smollm2-cpu"), [
        "--host", "0.0.0.0", "--port", "8000", "--model", "embedded://smollm2-135m-instruct",
        "--served-model-name", "smollm2-135m-instruct", "--device", "cpu",
        "--tensor-parallel-size", "1", "--kv-cache-dtype", "auto",
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "32", "--block-size", "16",
        "--enable-prefix-caching", "--drain-timeout", "45", "--max-model-len", "4096",
        *KV_EVENTS,
    ]),
    ("gpu-fp8-sample", sample("llama3-8b-fp8-gpu"), [
        "--host", "0.0.0.0", "--port", "8000", "--model", "/models/Meta-Llama-3-8B-Instruct",
        "--served-model-name", "meta-llama/Meta-Llama-3-8B-Instruct", "--device", "cuda",
        "--tensor-parallel-size", "1", "--kv-cache-dtype", "fp8",
        "--max-num-batched-tokens", "8192", "--max-num-seqs", "256", "--block-size", "16",
        "--enable-prefix-caching", "--drain-timeout", "585",
        "--gpu-memory-utilization", "0.9", "--max-model-len", "8192", *KV_EVENTS,
    ]),
    ("gpu-tp4-sample", sample("llama3-70b-tp4-gpu"), [
        "--host", "0.0.0.0", "--port", "8000", "--model",
        "/models/meta-llama--Meta-Llama-3-70B-Instruct",
        "--served-model-name", "meta-llama/Meta-Llama-3-70B-Instruct", "--device", "cuda",
        "--tensor-parallel-size", "4", "--kv-cache-dtype", "auto",
        "--max-num-batched-tokens", "8192", "--max-num-seqs", "256", "--block-size", "16",
        "--enable-prefix-caching", "--drain-timeout", "585",
        "--gpu-memory-utilization", "0.9", "--max-model-len", "8192", *KV_EVENTS,
    ]),
    ("hf-no-prefix-cache-extra-args", {
        "model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
        "engine": {"enablePrefixCaching": False, "kvCacheDtype": "fp8_e5m2",
                   "extraArgs": ["--attention-backend", "torch", "--seed=7"]},
    }, [
        "--host", "0.0.0.0", "--port", "8000", "--model", "/models/Qwen--Qwen2.5-0.5B-Instruct",
        "--served-model-name", "Qwen/Qwen2.5-0.5B-Instruct", "--device", "cpu",
        "--tensor-parallel-size", "1", "--kv-cache-dtype", "fp8_e5m2",
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--block-size", "16",
        "--no-enable-prefix-caching", "--drain-timeout", "285", *KV_EVENTS,
        "--attention-backend", "torch", "--seed=7",
    ]),
    ("file-uri", {"model": {"uri": "file:///opt/models/smol.gguf"}}, [
        "--host", "0.0.0.0", "--port", "8000", "--model", "/opt/models/smol.gguf",
        "--device", "cpu", "--tensor-parallel-size", "1", "--kv-cache-dtype", "auto",
        "--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--block-size", "16",
        "--enable-prefix-caching", "--drain-timeout", "285", *KV_EVENTS,
    ]),
]


@pytest.mark.parametrize("case,spec,expected", ARGS, ids=[a[0] for a in ARGS])
def test_engine_command_line(case, spec, expected):
    container = engine(build(spec))
    assert container["command"] == ["kvpilot", "serve"]
    assert container["args"] == expected
    assert engine_args(parse_spec(spec)) == expected


@pytest.mark.parametrize("case,spec,_", ARGS, ids=[a[0] for a in ARGS])
@pytest.mark.parametrize("pod_monitor", [False, True])
def test_built_objects_are_valid_kubernetes_objects(case, spec, _, pod_monitor):
    children = build(spec, replicas=3, pod_monitor=pod_monitor)
    for obj in children.all():
        if obj["kind"] == "PodMonitor":
            continue  # not a Kubernetes API; shape checked in test_pod_monitor
        kubernetes_validate.validate(obj, "1.36.0", strict=True)


def test_builders_are_deterministic_and_do_not_share_state():
    spec = sample("llama3-8b-fp8-gpu")
    first, second = build(spec), build(copy.deepcopy(spec))
    assert first == second
    first.deployment["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "X"})
    assert build(spec) == second


def test_owner_reference_and_labels_on_every_child():
    children = build({"model": EMBEDDED, "router": {"replicas": 2}}, pod_monitor=True)
    assert len(children.router) == 6  # ServiceAccount ... PodMonitor: every router object
    for obj in children.all():
        meta = obj["metadata"]
        router = obj in children.router
        assert (meta["name"], meta["namespace"]) == ("chat-router" if router else "chat", "llm")
        assert meta["ownerReferences"] == [{
            "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceDeployment",
            "name": "chat", "uid": "uid-chat", "controller": True, "blockOwnerDeletion": True,
        }]
        assert meta["labels"][c.LABEL_MANAGED_BY] == "kvpilot-operator"
        assert meta["labels"][c.LABEL_OWNER] == "chat"


def test_pod_monitor_labels_for_a_prometheus_that_selects_by_them():
    """kube-prometheus-stack's Prometheus selects PodMonitors labelled ``release: <name>``
    (found in review: there was no way to put it on the engine PodMonitors)."""
    children = build_children(OWNER, parse_spec({"model": EMBEDDED}), 1, IMAGE, True,
                              (("release", "kps"), (c.LABEL_OWNER, "spoofed")))
    labels = children.pod_monitor["metadata"]["labels"]
    assert labels["release"] == "kps"
    assert labels[c.LABEL_OWNER] == "chat"  # ours win
    assert "release" not in children.deployment["metadata"]["labels"]


def test_selectors_are_stable_and_match_the_pods():
    children = build({"model": EMBEDDED}, pod_monitor=True)
    selector = {c.LABEL_COMPONENT: "engine", c.LABEL_OWNER: "chat"}
    deployment = children.deployment["spec"]
    assert deployment["selector"] == {"matchLabels": selector}
    pod_labels = deployment["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert children.service["spec"]["selector"] == selector
    assert children.pod_disruption_budget["spec"]["selector"] == {"matchLabels": selector}
    assert children.pod_monitor["spec"]["selector"] == {"matchLabels": selector}
    assert not any("version" in key for key in selector)


def test_replicas_and_rollout_strategy():
    deployment = build({"model": EMBEDDED}, replicas=4).deployment["spec"]
    assert deployment["replicas"] == 4
    assert deployment["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    with pytest.raises(ValueError, match="replicas must be >= 0; got -1"):
        build({"model": EMBEDDED}, replicas=-1)


def test_probes_sized_for_slow_model_loads():
    fast = engine(build({"model": EMBEDDED}))
    assert fast["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    budget = fast["startupProbe"]["periodSeconds"] * fast["startupProbe"]["failureThreshold"]
    assert budget >= 600
    assert fast["livenessProbe"]["httpGet"]["path"] == "/health"
    assert fast["readinessProbe"]["httpGet"]["path"] == "/ready"
    slow_spec = {"model": EMBEDDED, "autoscaling": {"maxReplicas": 2, "startupSeconds": 600}}
    slow = engine(build(slow_spec))
    budget = slow["startupProbe"]["periodSeconds"] * slow["startupProbe"]["failureThreshold"]
    assert budget == startup_budget_seconds(parse_spec(slow_spec)) == 3000
    progress = build(slow_spec).deployment["spec"]["progressDeadlineSeconds"]
    assert progress > budget


def test_graceful_drain():
    children = build({"model": EMBEDDED, "terminationGracePeriodSeconds": 900})
    pod = children.deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 900
    assert engine(children)["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "10"]}}
    short = build({"model": EMBEDDED, "terminationGracePeriodSeconds": 6})
    assert engine(short)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "2"]


@pytest.mark.parametrize(("grace", "drain"), [(900, 885), (300, 285), (60, 45), (6, 0), (0, 0)])
def test_the_engine_drains_for_what_the_grace_period_leaves(grace, drain):
    """Found in review: the engine kept its 120 s default drain, cutting generations a
    900 s grace would have let finish, and outliving a 60 s one (SIGKILL mid-drain)."""
    args = engine(build({"model": EMBEDDED, "terminationGracePeriodSeconds": grace}))["args"]
    assert args[args.index("--drain-timeout") + 1] == str(drain)
    sleep = int(engine(build({"model": EMBEDDED, "terminationGracePeriodSeconds": grace}))[
        "lifecycle"]["preStop"]["exec"]["command"][1])
    assert sleep + drain <= max(0, grace - 5) or drain == 0


def test_restricted_security_context_and_writable_volumes():
    children = build({"model": {"uri": "hf://org/model"}})
    pod = children.deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"] + pod["initContainers"]:
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/tmp", "/cache", "/models"} <= mounts
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["HOME"] == "/tmp" and env["HF_HOME"].startswith("/cache")


def test_prometheus_scrape_annotations_and_user_annotations():
    children = build({"model": EMBEDDED, "podAnnotations": {"team": "search"}})
    annotations = children.deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                           "prometheus.io/path": "/metrics", "team": "search"}


def test_gpu_pod_gets_device_toleration_and_shared_memory():
    children = build(sample("llama3-8b-fp8-gpu"))
    pod = children.deployment["spec"]["template"]["spec"]
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert engine(children)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "models", "persistentVolumeClaim": {
        "claimName": "llama3-8b-weights", "readOnly": True}} in pod["volumes"]
    # A toleration the user already gave is not repeated.
    spec = sample("llama3-8b-fp8-gpu")
    spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "h100",
                            "effect": "NoSchedule"}]
    assert build(spec).deployment["spec"]["template"]["spec"]["tolerations"] == spec["tolerations"]


def test_image_pull_secrets_and_priority_class_reach_the_pod():
    pod = build({"model": EMBEDDED, "imagePullSecrets": [{"name": "registry"}],
                 "priorityClassName": "inference-critical"}).deployment["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["priorityClassName"] == "inference-critical"
    plain = build({"model": EMBEDDED}).deployment["spec"]["template"]["spec"]
    assert "imagePullSecrets" not in plain and "priorityClassName" not in plain
    with pytest.raises(SpecError, match="imagePullSecrets"):
        build({"model": EMBEDDED, "imagePullSecrets": [{"nom": "x"}]})


def test_cpu_pod_has_no_gpu_bits():
    pod = build(sample("smollm2-cpu")).deployment["spec"]["template"]["spec"]
    assert "tolerations" not in pod
    assert all(v["name"] != "dshm" for v in pod["volumes"])
    assert "initContainers" not in pod


def test_hf_model_is_downloaded_by_an_init_container():
    pod = build({"model": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}, "env": [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]}).deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == IMAGE
    assert init["command"][:2] == ["python3", "-c"]
    assert init["command"][3:] == ["Qwen/Qwen2.5-0.5B-Instruct", "/models/Qwen--Qwen2.5-0.5B-Instruct"]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    assert any(e["name"] == "HF_TOKEN" for e in init["env"])
    # The engine reads the download read-only.
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in (
        pod["containers"][0]["volumeMounts"])


def test_user_env_overrides_by_name_without_duplicates():
    container = engine(build({"model": EMBEDDED, "env": [
        {"name": "HOME", "value": "/cache/home"}, {"name": "LOG_LEVEL", "value": "debug"}]}))
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["HOME"] == "/cache/home" and env["LOG_LEVEL"] == "debug"


def test_one_block_hash_seed_per_fleet():
    """Every engine pod of an InferenceDeployment gets the same PYTHONHASHSEED (vLLM's
    KV block hashes derive from it), stable across builds; another deployment gets
    another; the user's own value wins; a value Python would refuse is refused."""
    from kvpilot.operator.builders.pod import fleet_hash_seed

    def seed(children) -> str:
        return {e["name"]: e.get("value") for e in engine(children)["env"]}["PYTHONHASHSEED"]

    mine = seed(build({"model": EMBEDDED}, replicas=3))
    assert mine == seed(build({"model": EMBEDDED, "engine": {"maxNumSeqs": 8}})) == fleet_hash_seed(OWNER.name)
    assert mine.isdigit() and int(mine) < 2**32
    assert fleet_hash_seed("other") != mine
    # The headroom placeholders copy the engine pod template; only the engine gets it.
    children = build({"model": EMBEDDED})
    init = children.deployment["spec"]["template"]["spec"].get("initContainers", [])
    assert all("PYTHONHASHSEED" not in {e["name"] for e in c["env"]} for c in init)
    assert seed(build({"model": EMBEDDED, "env": [{"name": "PYTHONHASHSEED", "value": "42"}]})) == "42"
    for bad in ("-1", "4294967296", "abc", ""):
        with pytest.raises(SpecError, match=re.escape('PYTHONHASHSEED must be "random" or an integer in 0..4294967295')):
            parse_spec({"model": EMBEDDED, "env": [{"name": "PYTHONHASHSEED", "value": bad}]})


def test_image_default_and_override():
    assert engine(build({"model": EMBEDDED}))["image"] == IMAGE
    spec = {"model": EMBEDDED, "engine": {"image": "my/engine:1", "imagePullPolicy": "Always"}}
    container = engine(build(spec))
    assert (container["image"], container["imagePullPolicy"]) == ("my/engine:1", "Always")


def test_pod_settings_pass_through():
    affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": {"a": "b"}}}}]}}
    pod = build({"model": EMBEDDED, "affinity": affinity, "serviceAccountName": "engine-sa"}
                ).deployment["spec"]["template"]["spec"]
    assert pod["affinity"] == affinity
    assert pod["serviceAccountName"] == "engine-sa"


def test_service_and_pdb():
    children = build({"model": EMBEDDED})
    assert children.service["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert children.service["spec"]["type"] == "ClusterIP"
    pdb = children.pod_disruption_budget["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_pod_monitor():
    children = build({"model": EMBEDDED}, pod_monitor=True)
    monitor = children.pod_monitor
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert endpoint["relabelings"] == [{
        "sourceLabels": ["__meta_kubernetes_pod_label_kvpilot_dev_inference_deployment"],
        "targetLabel": "inference_deployment", "action": "replace"}]
    assert build({"model": EMBEDDED}, pod_monitor=False).pod_monitor is None


def test_schema_validation_catches_a_misspelt_field():
    """Guards the test above against a validator that accepts anything."""
    deployment = build({"model": EMBEDDED}).deployment
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, "1.36.0", strict=True)


def test_mig_slices_are_gpus_and_a_zero_gpu_limit_is_none():
    """Found in review: nvidia.com/mig-1g.10gb ran the engine with --device cpu and no
    toleration, and nvidia.com/gpu: 0 ran it with --device cuda on a pod without a GPU."""
    mig = build({"model": EMBEDDED, "resources": {"limits": {"nvidia.com/mig-1g.10gb": 1}}})
    args = engine(mig)["args"]
    assert args[args.index("--device") + 1] == "cuda"
    assert mig.deployment["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    none = build({"model": EMBEDDED, "resources": {"limits": {"nvidia.com/gpu": 0}}})
    args = engine(none)["args"]
    assert args[args.index("--device") + 1] == "cpu"
    assert "tolerations" not in none.deployment["spec"]["template"]["spec"]


PLATFORM = {
    "podLabels": {"team": "search", "cost-center": "ml-42"},
    "runtimeClassName": "nvidia",
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"},
        {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
         "labelSelector": {"matchLabels": {"team": "search"}}},
    ],
    "volumes": [{"name": "certs", "secret": {"secretName": "ca-bundle"}},
                {"name": "adapters", "persistentVolumeClaim": {"claimName": "lora", "readOnly": True}}],
    "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/custom", "readOnly": True},
                     {"name": "adapters", "mountPath": "/adapters"}],
    "envFrom": [{"secretRef": {"name": "hub-token"}}, {"configMapRef": {"name": "proxy"}, "prefix": "P_"}],
}


def test_platform_fields_reach_the_pod_and_the_engine_container():
    children = build({"model": {"uri": "hf://org/model"}, **PLATFORM})
    template = children.deployment["spec"]["template"]
    pod, container = template["spec"], engine(children)
    selector = children.deployment["spec"]["selector"]["matchLabels"]
    assert template["metadata"]["labels"]["team"] == "search"
    assert template["metadata"]["labels"]["cost-center"] == "ml-42"
    assert selector.items() <= template["metadata"]["labels"].items()  # the selector still matches
    assert pod["runtimeClassName"] == "nvidia"
    zone, host = pod["topologySpreadConstraints"]
    assert zone["labelSelector"] == {"matchLabels": selector}  # defaulted to this resource's pods
    assert host["labelSelector"] == {"matchLabels": {"team": "search"}}  # the user's kept
    names = [v["name"] for v in pod["volumes"]]
    assert names[-2:] == ["certs", "adapters"] and len(set(names)) == len(names)
    assert container["volumeMounts"][-2:] == PLATFORM["volumeMounts"]
    assert container["envFrom"] == PLATFORM["envFrom"]
    (download,) = pod["initContainers"]  # the hub download reads the same secrets
    assert download["envFrom"] == PLATFORM["envFrom"]
    # Still a valid pod for the API server's schema.
    kubernetes_validate.validate(children.deployment, "1.33", strict=True)


def test_no_platform_fields_no_keys():
    pod = build({"model": EMBEDDED}).deployment["spec"]["template"]["spec"]
    assert not {"runtimeClassName", "topologySpreadConstraints"} & set(pod)
    assert "envFrom" not in pod["containers"][0]


def test_reserved_names_and_paths_are_what_the_builders_use():
    """spec.py refuses user volumes and mounts that clash with kvpilot's; its lists must
    name every volume and path the builders create (an hf:// model with adapters on a GPU
    has them all)."""
    from kvpilot.operator.spec.pod import RESERVED_MOUNT_PATHS, RESERVED_VOLUME_NAMES

    children = build({"model": {"uri": "hf://org/model"}, "resources": {"limits": {"nvidia.com/gpu": 1}},
                      "adapters": [{"name": "a", "uri": "hf://org/a"}]})
    pod = children.deployment["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == set(RESERVED_VOLUME_NAMES)
    paths = {m["mountPath"] for c_ in pod["containers"] + pod["initContainers"] for m in c_["volumeMounts"]}
    assert paths == set(RESERVED_MOUNT_PATHS)


@pytest.mark.parametrize("spec,field,message", [
    ({"podLabels": {"app.kubernetes.io/name": "x"}}, "spec.podLabels", "outside kvpilot's own label prefixes"),
    ({"podLabels": {"team": "a b"}}, "spec.podLabels.team", "a label value"),
    ({"podLabels": {"-bad": "x"}}, "spec.podLabels", "a label key"),
    ({"runtimeClassName": "Nvidia_GPU"}, "spec.runtimeClassName", "DNS-1123"),
    ({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}, "spec.topologySpreadConstraints",
     "whenUnsatisfiable"),
    ({"volumes": [{"name": "models", "emptyDir": {}}]}, "spec.volumes", "kvpilot's own volumes"),
    ({"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}, "spec.volumes", "unique"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "spec.volumeMounts", "one of spec.volumes"),
    ({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/models/extra"}]},
     "spec.volumeMounts", "outside kvpilot's own mounts"),
    ({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "relative"}]},
     "spec.volumeMounts", "absolute mountPath"),
    # The kubelet's path, not the string: '//models' and '/tmp/../models' are /models, and
    # '/' or '/dev' would cover /models or /dev/shm.
    *[({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": path}]},
       "spec.volumeMounts", "outside kvpilot's own mounts")
      for path in ("//models", "/tmp/../models", "/models/", "/", "/dev", "/cache//x")],
    ({"podLabels": {"pod-template-hash": "x"}}, "spec.podLabels", "the controllers' (pod-template-hash)"),
    ({"podLabels": {"team\n": "x"}}, "spec.podLabels", "a label key"),
    ({"podLabels": {"team": "search\n"}}, "spec.podLabels.team", "a label value"),
    ({"runtimeClassName": "nvidia\n"}, "spec.runtimeClassName", "DNS-1123"),
    ({"envFrom": [{"prefix": "X_"}]}, "spec.envFrom", "configMapRef"),
    ({"envFrom": [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]}, "spec.envFrom", "configMapRef"),
])
def test_bad_platform_fields_are_refused_by_name(spec, field, message):
    with pytest.raises(SpecError) as info:
        parse_spec({"model": EMBEDDED, **spec})
    assert str(info.value).startswith(field + ":") and message in str(info.value), str(info.value)
