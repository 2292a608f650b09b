"""KubernetesApi over the real ``kubernetes`` client, against a scripted HTTP server on
127.0.0.1: the exact requests (paths, verbs, content types, fieldManager, force) and the
translation of HTTP errors into retry intent."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client as k8s

from kvpilot.operator.api import ConflictError, InvalidObjectError, TransientApiError
from kvpilot.operator.builders import Owner, build_children
from kvpilot.operator.kube import KubernetesApi, resource_path
from kvpilot.operator.spec import parse_spec

from .fake_apiserver import send_json


class Scripted(BaseHTTPRequestHandler):
    """Answers from ``server.responses[(method, path)]`` (a list, consumed in order; the
    last entry repeats) and records every request in ``server.requests``."""

    def _serve(self):
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.requests.append({
            "method": self.command, "path": url.path, "query": parse_qs(url.query),
            "content_type": self.headers.get("Content-Type"),
            "authorization": self.headers.get("Authorization"),
            "body": json.loads(body) if body else None,
        })
        answers = self.server.responses.get((self.command, url.path)) or [(404, {"message": "nf"})]
        status, payload = answers.pop(0) if len(answers) > 1 else answers[0]
        send_json(self, status, payload)

    do_GET = do_PATCH = do_DELETE = _serve

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    srv.requests, srv.responses = [], {}
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


def api_for(port: int, clock=None) -> KubernetesApi:
    config = k8s.Configuration(host=f"http://127.0.0.1:{port}")
    config.api_key = {"authorization": "Bearer test-token"}
    if clock is None:
        return KubernetesApi(k8s.ApiClient(config))
    return KubernetesApi(k8s.ApiClient(config), clock=clock)


def children():
    spec = parse_spec({"model": {"uri": "embedded://smollm2-135m-instruct"}})
    return build_children(Owner("chat", "llm", "u1"), spec, 2, "e:1", pod_monitor=True)


DEPLOYMENT_PATH = "/apis/apps/v1/namespaces/llm/deployments/chat"


def test_paths():
    assert resource_path("v1", "Service", "llm", "chat") == "/api/v1/namespaces/llm/services/chat"
    assert resource_path("apps/v1", "Deployment", "llm", "chat") == DEPLOYMENT_PATH
    assert resource_path("kvpilot.dev/v1alpha1", "InferenceDeployment", "llm", "chat") == (
        "/apis/kvpilot.dev/v1alpha1/namespaces/llm/inferencedeployments/chat")
    assert resource_path("rbac.authorization.k8s.io/v1", "RoleBinding", "llm", "chat-router") == (
        "/apis/rbac.authorization.k8s.io/v1/namespaces/llm/rolebindings/chat-router")
    assert resource_path("v1", "ServiceAccount", "llm", "chat-router") == (
        "/api/v1/namespaces/llm/serviceaccounts/chat-router")
    assert resource_path("inference.networking.k8s.io/v1", "InferencePool", "llm", "chat") == (
        "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/chat")
    assert resource_path("keda.sh/v1alpha1", "ScaledObject", "llm", "chat") == (
        "/apis/keda.sh/v1alpha1/namespaces/llm/scaledobjects/chat")
    with pytest.raises(ValueError, match="kind 'Pod' is not one the operator writes"):
        resource_path("v1", "Pod", "llm", "x")


def test_delete_runs_in_the_background_with_a_uid_precondition(server):
    path = "/apis/apps/v1/namespaces/llm/deployments/chat-router"
    server.responses[("DELETE", path)] = [(200, {"kind": "Status"}), (404, {"message": "nf"}),
                                          (409, {"message": "Precondition failed: UID"})]
    api = api_for(server.server_address[1])
    assert api.delete("apps/v1", "Deployment", "llm", "chat-router", uid="u-7") is True
    request = server.requests[0]
    assert (request["method"], request["path"]) == ("DELETE", path)
    assert request["body"] == {"kind": "DeleteOptions", "apiVersion": "v1",
                               "propagationPolicy": "Background",
                               "preconditions": {"uid": "u-7"}}
    assert api.delete("apps/v1", "Deployment", "llm", "chat-router") is False  # already gone
    assert "preconditions" not in server.requests[1]["body"]
    with pytest.raises(ConflictError, match="delete Deployment llm/chat-router"):
        api.delete("apps/v1", "Deployment", "llm", "chat-router", uid="u-old")


def test_apply_is_a_server_side_apply_with_our_field_manager(server):
    kids = children()
    stored = {**kids.deployment, "status": {"readyReplicas": 1}}
    server.responses[("PATCH", DEPLOYMENT_PATH)] = [(200, stored)]
    server.responses[("PATCH", "/api/v1/namespaces/llm/services/chat")] = [(201, kids.service)]
    api = api_for(server.server_address[1])
    assert api.apply(kids.deployment) == stored
    api.apply(kids.service)
    first, second = server.requests
    assert first["method"] == "PATCH" and first["path"] == DEPLOYMENT_PATH
    assert first["content_type"] == "application/apply-patch+yaml"
    assert first["query"] == {"fieldManager": ["kvpilot-operator"], "force": ["true"]}
    assert first["authorization"] == "Bearer test-token"
    assert first["body"] == kids.deployment
    assert second["path"] == "/api/v1/namespaces/llm/services/chat"


def test_a_hand_over_applies_with_another_field_manager_without_force(server):
    """KEDA mode hands spec.replicas over (reconcile.HANDOVER_FIELD_MANAGER) without force:
    a count someone changed meanwhile is a conflict, not overwritten."""
    server.responses[("PATCH", DEPLOYMENT_PATH)] = [(200, {"spec": {"replicas": 3}})]
    api = api_for(server.server_address[1])
    partial = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "chat", "namespace": "llm"}, "spec": {"replicas": 3}}
    api.apply(partial, force=False, field_manager="kvpilot-handover-to-keda")
    (request,) = server.requests
    assert request["query"] == {"fieldManager": ["kvpilot-handover-to-keda"]}
    assert request["body"] == partial


def test_get_returns_none_on_404_and_the_object_otherwise(server):
    api = api_for(server.server_address[1])
    assert api.get("apps/v1", "Deployment", "llm", "chat") is None
    server.responses[("GET", DEPLOYMENT_PATH)] = [(200, {"spec": {"replicas": 3}})]
    assert api.get("apps/v1", "Deployment", "llm", "chat") == {"spec": {"replicas": 3}}


def test_patch_status_is_a_merge_patch_on_the_subresource(server):
    path = "/apis/kvpilot.dev/v1alpha1/namespaces/llm/inferencedeployments/chat/status"
    server.responses[("PATCH", path)] = [(200, {})]
    api_for(server.server_address[1]).patch_status("llm", "chat", {"readyReplicas": 2})
    (request,) = server.requests
    assert request["content_type"] == "application/merge-patch+json"
    assert request["body"] == {"status": {"readyReplicas": 2}}


def test_patch_status_with_a_resource_version_is_a_precondition(server):
    path = "/apis/kvpilot.dev/v1alpha1/namespaces/llm/inferencedeployments/chat/status"
    server.responses[("PATCH", path)] = [(409, {"message": "the object has been modified"})]
    with pytest.raises(ConflictError, match="modified"):
        api_for(server.server_address[1]).patch_status("llm", "chat", {"readyReplicas": 2},
                                                       resource_version="41")
    (request,) = server.requests
    assert request["body"] == {"status": {"readyReplicas": 2},
                               "metadata": {"resourceVersion": "41"}}


def test_list_pods_selects_by_labels_in_the_namespace(server):
    path = "/api/v1/namespaces/llm/pods"
    server.responses[("GET", path)] = [(200, {"kind": "PodList", "items": [
        {"metadata": {"name": "chat-0"}}]}), (503, {"message": "overloaded"})]
    api = api_for(server.server_address[1])
    pods = api.list_pods("llm", {"kvpilot.dev/inference-deployment": "chat",
                                 "app.kubernetes.io/component": "engine"})
    assert pods == [{"metadata": {"name": "chat-0"}}]
    (request,) = server.requests
    assert request["query"]["labelSelector"] == [
        "app.kubernetes.io/component=engine,kvpilot.dev/inference-deployment=chat"]
    with pytest.raises(TransientApiError, match="list pods in llm"):
        api.list_pods("llm", {"a": "b"})


@pytest.mark.parametrize("status,error,text", [
    (409, ConflictError, "the object has been modified"),
    (422, InvalidObjectError, "HTTP 422"),
    (400, InvalidObjectError, "HTTP 400"),
    (404, InvalidObjectError, "HTTP 404"),
    (403, TransientApiError, "check the operator's RBAC rules"),
    (429, TransientApiError, "HTTP 429"),
    (503, TransientApiError, "HTTP 503"),
])
def test_http_errors_carry_retry_intent(server, status, error, text):
    server.responses[("PATCH", DEPLOYMENT_PATH)] = [
        (status, {"kind": "Status", "message": "the object has been modified; please retry"})]
    with pytest.raises(error, match=text) as info:
        api_for(server.server_address[1]).apply(children().deployment)
    assert info.value.status == status
    assert "apply Deployment llm/chat" in str(info.value)


def test_unreachable_api_is_transient():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    config = k8s.Configuration(host=f"http://127.0.0.1:{port}")
    config.retries = 0
    api = KubernetesApi(k8s.ApiClient(config))
    with pytest.raises(TransientApiError, match="get Deployment llm/chat"):
        api.get("apps/v1", "Deployment", "llm", "chat")


def test_discovery_is_cached_and_refreshed(server):
    now = [0.0]
    server.responses[("GET", "/apis/monitoring.coreos.com/v1")] = [
        (404, {"message": "not found"}),
        (200, {"resources": [{"kind": "PodMonitor", "name": "podmonitors"}]}),
    ]
    api = api_for(server.server_address[1], clock=lambda: now[0])
    assert api.has_api("monitoring.coreos.com/v1", "PodMonitor") is False
    assert api.has_api("monitoring.coreos.com/v1", "PodMonitor") is False  # cached
    assert len(server.requests) == 1
    now[0] = 301.0  # the Prometheus operator was installed meanwhile
    assert api.has_api("monitoring.coreos.com/v1", "PodMonitor") is True
    assert api.has_api("monitoring.coreos.com/v1", "ServiceMonitor") is False
