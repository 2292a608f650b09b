"""A real Kubernetes control plane on loopback, started the way envtest starts one.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler (built by
``e2e/build-k8s.sh`` into ``~/.cache/kvpilot/k8s/<version>/bin``) run as local processes
on 127.0.0.1 and free ports:

- TLS from a throwaway CA made with openssl; the apiserver's certificate names 127.0.0.1.
- ``--token-auth-file`` with one user, ``admin`` in ``system:masters``, used by the tests,
  the controllers and the node harness. The operator does not use it: it logs in with a
  token of the chart's ServiceAccount (TokenRequest), so it has exactly the chart's RBAC.
- ``--authorization-mode=RBAC``; the three ``--service-account-*`` flags (one RSA key).
- The controller-manager and scheduler serve no HTTPS port (``--secure-port=0``).

Everything lives in one work directory (certs, etcd data, kubeconfigs, logs) and every
process is stopped by pid through :mod:`e2e.procs`.
"""

from __future__ import annotations

import os
import secrets
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from e2e import procs
from e2e.netns import SERVICE_CIDR, NodeNetwork

K8S_VERSION = os.environ.get("K8S_VERSION", "v1.37.2")


def binary_dir() -> Path:
    return Path(os.environ.get("KVPILOT_K8S_CACHE",
                               Path.home() / ".cache" / "kvpilot" / "k8s" / K8S_VERSION)) / "bin"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_certs(d: Path, host: str = "127.0.0.1") -> None:
    """ca.crt/ca.key; apiserver.crt/.key (SAN ``host``, 127.0.0.1, localhost, kubernetes);
    kubelet-client.crt/.key (the API server's identity towards kubelets: ``system:masters``);
    sa.key/.pub."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"), "-subj", "/CN=kvpilot-e2e-ca")
    (d / "san.cnf").write_text(
        "[v3]\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName=IP:{host},IP:127.0.0.1,IP:10.96.0.1,"
        "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\n"
        "[client]\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "apiserver.key"),
             "-out", str(d / "apiserver.csr"), "-subj", "/CN=kube-apiserver")
    _openssl("x509", "-req", "-in", str(d / "apiserver.csr"), "-CA", str(d / "ca.crt"),
             "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
             "-extfile", str(d / "san.cnf"), "-extensions", "v3", "-out", str(d / "apiserver.crt"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "kubelet-client.key"),
             "-out", str(d / "kubelet-client.csr"),
             "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client")
    _openssl("x509", "-req", "-in", str(d / "kubelet-client.csr"), "-CA", str(d / "ca.crt"),
             "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
             "-extfile", str(d / "san.cnf"), "-extensions", "client",
             "-out", str(d / "kubelet-client.crt"))
    _openssl("genrsa", "-out", str(d / "sa.key"), "2048")
    _openssl("rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub"))


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: e2e\n  cluster:\n    server: {server}\n"
        f"    certificate-authority: {ca}\n"
        f"users:\n- name: {user}\n  user:\n    token: {token}\n"
        f"contexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: {user}\n"
        "    namespace: default\n"
        "current-context: e2e\n")
    path.chmod(0o600)
    return path


@dataclass
class ControlPlane:
    """A started control plane; ``admin_kubeconfig`` is cluster-admin."""

    workdir: Path
    server: str = ""
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    admin_kubeconfig: Path = Path()
    procs: dict[str, procs.Proc] = field(default_factory=dict)
    # With a network namespace (the real node), every process runs inside it and the API
    # server binds and advertises the node's address, so pods reach it through the
    # ``kubernetes`` Service; without one, everything is on the machine's loopback.
    network: NodeNetwork | None = None
    host: str = "127.0.0.1"
    node_token: str = field(default_factory=lambda: secrets.token_hex(16))
    proxy_token: str = field(default_factory=lambda: secrets.token_hex(16))

    @property
    def ca(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    def start(self, timeout: float = 120.0) -> ControlPlane:
        bins = binary_dir()
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            if not (bins / name).exists():
                raise FileNotFoundError(f"{bins / name} is missing: run e2e/build-k8s.sh first")
        pki = self.workdir / "pki"
        make_certs(pki, self.host)
        self._start_etcd(bins)
        self._start_apiserver(bins, pki, timeout)
        kubeconfig = self.admin_kubeconfig
        self.procs["kube-controller-manager"] = procs.start("kube-controller-manager", self._wrap([
            str(bins / "kube-controller-manager"), f"--kubeconfig={kubeconfig}",
            "--secure-port=0", "--leader-elect=false",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}", f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--use-service-account-credentials=false", "--controllers=*",
            # Pods of a Deployment scaled down or rolled go away within a test's time.
            "--concurrent-deployment-syncs=5", "--concurrent-replicaset-syncs=5",
        ]), self.log_dir)
        self.procs["kube-scheduler"] = procs.start("kube-scheduler", self._wrap([
            str(bins / "kube-scheduler"), f"--kubeconfig={kubeconfig}",
            "--secure-port=0", "--leader-elect=false",
        ]), self.log_dir)
        return self

    def _wrap(self, argv: list[str]) -> list[str]:
        return self.network.wrap(argv) if self.network is not None else argv

    def _start_etcd(self, bins: Path) -> None:
        client, peer = procs.free_port(), procs.free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self.procs["etcd"] = procs.start("etcd", self._wrap([
            str(bins / "etcd"), "--name=e2e", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=e2e=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level=warn",
        ]), self.log_dir)

    def _start_apiserver(self, bins: Path, pki: Path, timeout: float) -> None:
        port = procs.free_port()
        self.server = f"https://{self.host}:{port}"
        tokens = self.workdir / "tokens.csv"
        # The node's kubelet and kube-proxy log in as the identities the Node authorizer
        # and the bootstrap RBAC (system:node-proxier) expect.
        tokens.write_text(
            f'{self.admin_token},admin,admin-uid,"system:masters"\n'
            f'{self.node_token},system:node:kvpilot-e2e-node,node-uid,"system:nodes"\n'
            f'{self.proxy_token},system:kube-proxy,kube-proxy-uid\n')
        tokens.chmod(0o600)
        if self.network is not None:
            node_flags = [
                # The `kubernetes` Service's endpoint is this address (lease reconciler).
                "--authorization-mode=Node,RBAC", "--enable-admission-plugins="
                "OwnerReferencesPermissionEnforcement,NodeRestriction",
                f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP",
            ]
        else:
            node_flags = [
                "--authorization-mode=RBAC",
                # As on real clusters: an owner reference with blockOwnerDeletion needs
                # `update` on the owner's finalizers subresource.
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
                "--endpoint-reconciler-type=none",
            ]
        self.procs["kube-apiserver"] = procs.start("kube-apiserver", self._wrap([
            str(bins / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.host}", f"--advertise-address={self.host}",
            f"--secure-port={port}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={tokens}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true", "--profiling=false",
            *node_flags,
        ]), self.log_dir)
        self.admin_kubeconfig = write_kubeconfig(
            self.workdir / "admin.kubeconfig", self.server, pki / "ca.crt", self.admin_token,
            "admin")
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))

        def ready() -> bool:
            apiserver = self.procs["kube-apiserver"]
            if not apiserver.alive():
                raise RuntimeError(f"kube-apiserver exited:\n{apiserver.log_tail()}")
            request = urllib.request.Request(
                f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"})
            with urllib.request.urlopen(request, context=context, timeout=5) as response:
                return response.status == 200

        procs.wait_until(ready, timeout, "kube-apiserver /readyz",
                         on_timeout=lambda: self.procs["kube-apiserver"].log_tail())

    def stop(self) -> None:
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()
