"""The Helm chart: `helm lint`, `helm template` of scenario values validated against the
Kubernetes schemas, the CRD copy, least-privilege RBAC that still covers what the
operator does, commented values and rules, stable selector labels."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.kube import PLURALS

from .tools import CHART, KUBE_VERSION, REPO, helm_template, run, tool

pytestmark = pytest.mark.tools  # runs helm and promtool (`make tools`)

SCENARIOS = {
    "default": [],
    "minimal": [Path(__file__).parent / "chart-values" / "minimal.yaml"],
    "namespaced": [Path(__file__).parent / "chart-values" / "namespaced.yaml"],
    "full": [Path(__file__).parent / "chart-values" / "full.yaml"],
}
MONITORING_KINDS = {"PrometheusRule", "PodMonitor"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: helm_template(values) for name, values in SCENARIOS.items()}


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_crd_copy_in_the_chart_is_identical():
    source = REPO / "crds" / "inferencedeployments.kvpilot.dev.yaml"
    copy = CHART / "crds" / source.name
    assert copy.read_bytes() == source.read_bytes(), (
        f"{copy} drifted from {source}: cp {source} {copy}")
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == [source.name]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_helm_lint(scenario):
    args = [tool("helm"), "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION]
    for path in SCENARIOS[scenario]:
        args += ["--values", str(path)]
    assert "0 chart(s) failed" in run(args).stdout


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_objects_are_valid_kubernetes_objects(rendered, scenario):
    docs = rendered[scenario]
    assert docs
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            continue  # Prometheus-operator kinds: checked below and by promtool
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_monitoring_objects_shape(rendered):
    docs = rendered["default"]
    (rule,) = by_kind(docs, "PrometheusRule")
    assert [g["name"] for g in rule["spec"]["groups"]] == ["kvpilot-engine", "kvpilot-fleet"]
    (monitor,) = by_kind(docs, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    assert monitor["spec"]["selector"]["matchLabels"] == (
        by_kind(docs, "Deployment")[0]["spec"]["selector"]["matchLabels"])


def test_monitoring_objects_only_where_the_api_exists():
    docs = helm_template(apis=())
    assert not {d["kind"] for d in docs} & MONITORING_KINDS
    assert by_kind(docs, "ConfigMap")  # the dashboard needs no extra API


def test_operator_deployment(rendered):
    (deployment,) = by_kind(rendered["default"], "Deployment")
    spec = deployment["spec"]
    # One replica by default; a new one waits for the leader Lease the old one releases.
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["kvpilot", "operator"]
    assert container["args"] == [
        "--engine-image=kvpilot/engine:0.1.0", "--router-image=kvpilot/router:0.1.0",
        "--pod-monitor=auto", "--resync-seconds=300", "--headroom-priority-class=kvpilot-headroom",
        "--metrics-port=9090", "--health-port=8080", "--log-level=INFO", "--log-format=text",
        "--leader-elect", "--leader-election-id=kvpilot-operator",
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"} and set(resources["limits"]) == {"cpu", "memory"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == "kvp-kvpilot"


def test_an_unknown_log_format_fails_the_render_by_name():
    with pytest.raises(AssertionError, match="logFormat"):
        helm_template(sets=["logFormat=yaml"])


def test_namespaced_scenario_args_and_roles(rendered):
    docs = rendered["namespaced"]
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm" in args and "--namespace=llm-staging" in args
    assert "--pod-monitor=always" in args and "--resync-seconds=120" in args
    # The one ClusterRole is what the routers get, bound per namespace by the operator.
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == [c.ROUTER_CLUSTER_ROLE]
    assert not by_kind(docs, "ClusterRoleBinding")
    roles = [r for r in by_kind(docs, "Role") if not r["metadata"]["name"].endswith("-leader-election")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["llm", "llm-staging"]
    for binding in by_kind(docs, "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvp-kvpilot",
                                        "namespace": "kvpilot-system"}]


def test_minimal_scenario_renders_only_the_operator(rendered):
    kinds = sorted(d["kind"] for d in rendered["minimal"])
    assert kinds == ["CustomResourceDefinition", "Deployment", "Service"]
    (deployment,) = by_kind(rendered["minimal"], "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "kvpilot-operator"


def test_full_scenario_passes_values_through(rendered):
    docs = rendered["full"]
    (deployment,) = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example/kvpilot/operator:0.1.0-rc1"
    assert "--engine-image=registry.example/kvpilot/engine:0.1.0-cu128" in pod["containers"][0]["args"]
    assert "--router-image=registry.example/kvpilot/router:0.1.0-r1" in pod["containers"][0]["args"]
    assert "--pod-monitor-label=release=kube-prometheus-stack" in pod["containers"][0]["args"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["priorityClassName"] == "system-cluster-critical"
    (dashboard,) = by_kind(docs, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for group in rule["spec"]["groups"]:
        for alert in group["rules"]:
            assert alert["labels"]["team"] == "ml-platform"
            assert alert["annotations"]["runbook_url"].startswith("https://runbooks.example/kvpilot#")
    burn = next(a for g in rule["spec"]["groups"] for a in g["rules"]
            if a["alert"] == "KVPilotTTFTBudgetBurnFast")
    # full.yaml says "5"; the engine's histogram writes le="5.0" (found in review: the
    # alert matched no series and could never fire).
    assert 'le="5.0"' in burn["expr"] and "> 0.072" in burn["expr"]  # 14.4 x 0.5%


def test_the_ttft_bounds_the_chart_accepts_are_the_engines_buckets():
    from prometheus_client.utils import floatToGoString

    from kvpilot.engine.server.metrics import REQUEST_BUCKETS

    text = (CHART / "files" / "alerts.yaml").read_text()
    listed = re.search(r'\$bounds := list ((?:"[^"]+" ?)+)', text).group(1).split()
    assert [b.strip('"') for b in listed] == [floatToGoString(b) for b in REQUEST_BUCKETS]


def test_a_ttft_bound_that_is_no_bucket_fails_the_render():
    with pytest.raises(AssertionError, match="must be one of the engine's TTFT bucket bounds"):
        helm_template(sets=["alerts.ttftSlo.thresholdSeconds=3"])


def test_the_retired_preemption_rate_value_fails_the_render_by_name():
    """``alerts.preemptions.ratePerSecond`` (which fired on a single preemption) is no
    longer read; a values file that still sets it is refused, not silently ignored."""
    with pytest.raises(AssertionError, match=r"alerts\.preemptions\.ratePerSecond is no longer read.*perRequest"):
        helm_template(sets=["alerts.preemptions.ratePerSecond=0.5"])


def test_selector_labels_never_carry_a_version(rendered):
    for docs in rendered.values():
        for doc in docs:
            selectors = []
            if doc["kind"] == "Deployment":
                selectors.append(doc["spec"]["selector"]["matchLabels"])
            if doc["kind"] in ("Service",):
                selectors.append(doc["spec"]["selector"])
            if doc["kind"] == "PodMonitor":
                selectors.append(doc["spec"]["selector"]["matchLabels"])
            for selector in selectors:
                assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(selector), doc


def _rules(docs: list[dict]) -> list[dict]:
    """The operator's own rules: its ClusterRole, or the first of its per-namespace Roles."""
    roles = [r for r in by_kind(docs, "ClusterRole")
             if r["metadata"]["name"] != c.ROUTER_CLUSTER_ROLE] or [
        r for r in by_kind(docs, "Role") if not r["metadata"]["name"].endswith("-leader-election")][:1]
    return roles[0]["rules"]


@pytest.mark.parametrize("scenario", ["default", "namespaced"])
def test_leader_election_is_on_with_a_role_for_one_lease(rendered, scenario):
    """The operator waits for the leader Lease (several replicas may run); its Role lives
    in the release namespace and reaches that one Lease by name (create cannot be
    restricted by name in RBAC)."""
    docs = rendered[scenario]
    (deployment,) = [d for d in by_kind(docs, "Deployment")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--leader-elect" in container["args"]
    assert "--leader-election-id=kvpilot-operator" in container["args"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["kvpilot-operator"],
         "verbs": ["get", "update"]}]
    (binding,) = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"].endswith("-leader-election")]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_without_leader_election_one_operator_recreated():
    docs = helm_template(sets=["leaderElection.enabled=false"])
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]


def _granted(rules: list[dict], group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in rules:
        if group in rule["apiGroups"] and resource in rule["resources"]:
            verbs |= set(rule["verbs"])
    return verbs


@pytest.mark.parametrize("scenario", ["default", "namespaced"])
def test_rbac_covers_what_the_operator_does(rendered, scenario):
    """Derived from the code: every kind the operator applies (kube.PLURALS) needs create
    and patch; reconcile reads Deployments; the status subresource; Events; Kopf's watch."""
    rules = _rules(rendered[scenario])
    groups = {"Deployment": "apps", "Service": "", "PodDisruptionBudget": "policy",
              "PodMonitor": "monitoring.coreos.com", "ServiceAccount": "",
              "RoleBinding": "rbac.authorization.k8s.io",
              c.INFERENCE_POOL_KIND: "inference.networking.k8s.io", c.KIND: c.GROUP,
              "ScaledObject": "keda.sh", "ConfigMap": ""}
    for kind, plural in PLURALS.items():
        if kind == c.KIND:
            continue
        # get before every apply (never take over a stranger's object), delete when the
        # router is turned off (router_kinds below: every kind but the engine's).
        assert {"get", "create", "patch", "delete"} <= _granted(rules, groups[kind], plural), kind
    # A RoleBinding to kvpilot-router needs `bind` on it (RBAC escalation check).
    (bind,) = [r for r in rules if "bind" in r["verbs"]]
    assert bind == {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                    "resourceNames": [c.ROUTER_CLUSTER_ROLE], "verbs": ["bind"]}
    assert {"get", "list", "watch"} <= _granted(rules, "apps", "deployments")
    # The child watches (deleted or edited children restored, kvpilot.operator.repair).
    assert {"list", "watch"} <= _granted(rules, "", "services")
    assert {"get", "list", "watch", "patch"} <= _granted(rules, c.GROUP, c.PLURAL)
    assert {"patch"} <= _granted(rules, c.GROUP, f"{c.PLURAL}/status")
    assert {"create"} <= _granted(rules, "", "events")
    assert {"update"} <= _granted(rules, c.GROUP, f"{c.PLURAL}/finalizers")


@pytest.mark.parametrize("scenario", ["default", "namespaced"])
def test_rbac_is_least_privilege(rendered, scenario):
    # Deletes only of kinds the router objects have, the KEDA ScaledObject and the adapters
    # ConfigMap (the operator deletes nothing else).
    deletable = {"deployments", "services", "serviceaccounts", "poddisruptionbudgets",
                 "podmonitors", "rolebindings", "inferencepools", "scaledobjects", "configmaps"}
    for rule in _rules(rendered[scenario]):
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert not {"deletecollection", "escalate", "impersonate"} & set(rule["verbs"]), rule
        if "delete" in rule["verbs"]:
            assert set(rule["resources"]) <= deletable, rule
        if "bind" in rule["verbs"]:  # on the routers' ClusterRole by name, nothing else
            assert rule["resources"] == ["clusterroles"] and rule["verbs"] == ["bind"], rule
            assert rule["resourceNames"] == [c.ROUTER_CLUSTER_ROLE], rule
        # `update` only where the API server demands it: blockOwnerDeletion on an owner
        # reference needs it on the owner's finalizers (OwnerReferencesPermissionEnforcement),
        # and renewing the leader Lease (that one Lease, by name).
        if "update" in rule["verbs"] and rule["resources"] == ["leases"]:
            assert rule["resourceNames"] == ["kvpilot-operator"] and rule["verbs"] == ["get", "update"], rule
        elif "update" in rule["verbs"]:
            assert rule["resources"] == [f"{c.PLURAL}/finalizers"] and rule["verbs"] == ["update"], rule
        assert "secrets" not in rule["resources"]
    # Only the CRD watch is cluster-scoped beyond what the per-namespace Role grants.
    cluster = {tuple(r["resources"]) for r in _rules(rendered["default"])}
    namespaced = {tuple(r["resources"]) for r in _rules(rendered["namespaced"])}
    assert cluster - namespaced == {("customresourcedefinitions",)}


@pytest.mark.parametrize("scenario", ["default", "namespaced", "full"])
def test_the_router_cluster_role_allows_exactly_what_discovery_needs(rendered, scenario):
    """vllm-router's Kubernetes service discovery (src/service_discovery.rs) runs a kube-rs
    watcher on the pods of one namespace: list + watch, and get. Nothing more."""
    (role,) = [r for r in by_kind(rendered[scenario], "ClusterRole")
               if r["metadata"]["name"] == c.ROUTER_CLUSTER_ROLE]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]


def test_no_router_cluster_role_without_rbac(rendered):
    assert not by_kind(rendered["minimal"], "ClusterRole")


def test_every_rbac_rule_is_commented():
    for path in (CHART / "templates" / "_rbac-rules.tpl", CHART / "templates" / "rbac.yaml"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("- apiGroups:"):
                assert lines[i - 1].strip().startswith("#"), f"{path.name}:{i + 1} needs a why"


def test_every_values_key_is_commented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^\s*(- )?[A-Za-z_][\w.-]*:")
    for i, line in enumerate(lines):
        if key.match(line) and not line.strip().startswith("#"):
            previous = next((p for p in reversed(lines[:i]) if p.strip()), "")
            assert previous.strip().startswith("#") or "#" in line, f"values.yaml:{i + 1}: {line}"


def test_values_defaults_are_used_by_the_templates():
    """A value no template reads is a lie in the docs."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sources = "\n".join(p.read_text() for p in (CHART / "templates").iterdir())
    sources += (CHART / "files" / "alerts.yaml").read_text()
    for key in values:
        assert re.search(rf"\.{key}\b", sources) or f"$a := .Values.{key}" in sources, key


def test_dashboard_is_valid_json_with_targets(rendered):
    (config_map,) = by_kind(rendered["default"], "ConfigMap")
    dashboard = json.loads(config_map["data"]["kvpilot.json"])
    assert dashboard["uid"] == "kvpilot-fleet"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_notes_mention_uninstall_order():
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "delete every InferenceDeployment first" in notes


@pytest.mark.parametrize(("sets", "message"), [
    (["logLevel=info"], "logLevel"),
    (["podMonitorMode=bogus"], "podMonitorMode"),
    (["alerts.ttftSlo.objective=1.5"], "objective"),
    (["watchNamespaces={a,a}"], "watchNamespaces"),
    (["metrics.port=8080"], "metrics.port and health.port must differ"),
    (["replicaCount=2", "leaderElection.enabled=false"], "replicaCount 2 needs leaderElection.enabled=true"),
    (["leaderElection.leaseName=Bad_Name"], "leaseName"),
])
def test_values_the_operator_would_refuse_fail_the_render(sets, message):
    """Found in review: these rendered fine and then crash-looped the operator (argparse
    choices, duplicate container ports, duplicate Roles) or paged constantly."""
    with pytest.raises(AssertionError, match=message):
        helm_template(sets=sets)


def test_the_headroom_priority_class_is_below_the_engines_and_never_preempts():
    (pc,) = [d for d in helm_template() if d["kind"] == "PriorityClass"]
    assert pc["metadata"]["name"] == "kvpilot-headroom"
    assert pc["value"] < 0 and pc["preemptionPolicy"] == "Never" and pc["globalDefault"] is False
    assert not [d for d in helm_template(sets=["headroom.priorityClass.create=false"]) if d["kind"] == "PriorityClass"]
