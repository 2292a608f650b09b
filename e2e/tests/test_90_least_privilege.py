"""Scenario 6: the operator runs as the chart's ServiceAccount, bound by the chart's own
ClusterRole, and needed nothing more during the whole session (runs last)."""

from __future__ import annotations

import pytest

from e2e.cluster import OPERATOR_NAMESPACE

ALLOWED = [
    ("get", "inferencedeployments.kvpilot.dev"),
    ("watch", "inferencedeployments.kvpilot.dev"),
    ("patch", "inferencedeployments.kvpilot.dev"),
    ("patch", "inferencedeployments.kvpilot.dev/status"),
    ("update", "inferencedeployments.kvpilot.dev/finalizers"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "deployments.apps"),
    ("patch", "deployments.apps"),
    ("create", "services"),
    ("create", "poddisruptionbudgets.policy"),
    ("list", "pods"),
    ("watch", "pods"),  # engine restarts, reported on the InferenceDeployment
    ("create", "events"),
    # The request router: its ServiceAccount, the RoleBinding to kvpilot-router, and the
    # deletes when a spec turns its router off (docs/operator.md, "Routing").
    ("create", "serviceaccounts"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("bind", "clusterroles.rbac.authorization.k8s.io:kvpilot-router"),
    ("delete", "deployments.apps"),
    ("delete", "services"),
    ("watch", "services"),  # children restored within seconds of a delete or edit
]
DENIED = [
    ("bind", "clusterroles.rbac.authorization.k8s.io:cluster-admin"),
    ("bind", "clusterroles.rbac.authorization.k8s.io:admin"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("delete", "namespaces"),
    ("delete", "inferencedeployments.kvpilot.dev"),
    ("update", "inferencedeployments.kvpilot.dev"),
    ("get", "secrets"),
    ("list", "configmaps"),
    ("create", "pods"),
    ("delete", "pods"),
    ("get", "nodes"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("escalate", "clusterroles.rbac.authorization.k8s.io"),
    ("create", "serviceaccounts/token"),
    ("update", "inferencedeployments.kvpilot.dev/status"),
    ("patch", "deployments.apps/scale"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
]


def _can_i(cluster, verb: str, resource: str):
    # `kubectl auth can-i VERB RES/NAME` reads NAME as an object name: subresources go
    # through --subresource; here "RES:NAME" names one object.
    resource, _, name = resource.partition(":")
    resource, _, sub = resource.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    target = f"{resource}/{name}" if name else resource
    return cluster.kubectl("auth", "can-i", verb, target, *extra, "-n", "default",
                           kubeconfig=cluster.operator_kubeconfig, check=False)


@pytest.mark.parametrize(("verb", "resource"), ALLOWED)
def test_chart_role_allows(cluster, verb, resource):
    r = _can_i(cluster, verb, resource)
    assert r.stdout.strip() == "yes", (verb, resource, r.stdout, r.stderr)


@pytest.mark.parametrize(("verb", "resource"), DENIED)
def test_chart_role_denies(cluster, verb, resource):
    r = _can_i(cluster, verb, resource)
    assert r.stdout.strip() == "no", (verb, resource, r.stdout, r.stderr)


def test_operator_identity_is_the_charts(cluster):
    who = cluster.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}",
                          kubeconfig=cluster.operator_kubeconfig).stdout
    assert who == f"system:serviceaccount:{OPERATOR_NAMESPACE}:kvpilot"
    groups = cluster.kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.groups}",
                             kubeconfig=cluster.operator_kubeconfig).stdout
    assert "system:masters" not in groups


def test_operator_never_forbidden(cluster):
    log = cluster.operator_logs()
    assert log, "no operator log"
    for needle in ("HTTP 403", "code': 403", "status=403", "Forbidden", "forbidden"):
        lines = [line for line in log.splitlines() if needle in line]
        assert not lines, "the operator hit RBAC denials:\n" + "\n".join(lines[:10])
