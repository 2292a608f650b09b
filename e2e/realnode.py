"""A real Kubernetes node for the e2e suite: containerd, the kubelet and kube-proxy, running
the project's own images in the suite's network namespace (:mod:`e2e.netns`).

- **containerd** (Debian's package) with the CRI plugin: runc, the overlayfs snapshotter,
  ``restrict_oom_score_adj`` (the machine's root lacks CAP_SYS_RESOURCE, so runc may not
  lower ``oom_score_adj``), the sandbox image built by :mod:`e2e.images`, CNI from Debian's
  ``containernetworking-plugins``. Its root (content store and unpacked snapshots) is cached
  in ``~/.cache/kvpilot/containerd`` so imported images survive between runs; its state,
  socket and everything else live in the run's work directory. Containers a crashed run
  left behind are removed before the kubelet starts.
- **CNI**: the ``bridge`` plugin on ``cni0`` with host-local addresses from ``10.244.0.0/24``
  (its data directory in the work directory), routes to the node and the Service range
  only: pods have no default route and reach nothing outside the machine.
- **kubelet** (built by ``e2e/build-k8s.sh``): the ``cgroupfs`` driver under its own cgroup
  root ``/kvpilot-e2e-<pid>`` (``failCgroupV1: false``: these machines have a hybrid layout),
  a node identity (``system:node:<name>``, authorized by the Node authorizer), x509 and
  webhook authentication and authorization for the API server's ``logs``/``exec`` calls,
  pod logs in the work directory, no DNS (no cluster DNS runs here).
- **kube-proxy** in iptables mode as ``system:kube-proxy``; ``masqueradeAll`` so a pod
  reaching a Service backed by a pod on the same bridge gets its replies back without
  ``br_netfilter``; no conntrack sysctls (they are not per-namespace).

:meth:`RealNode.stop` deletes every pod through the API (so the kubelet runs preStop hooks
and tears sandboxes down), stops the kubelet, kube-proxy and containerd, kills what is
left in the cgroup root and containerd's shims, unmounts everything under the work
directory and the pods' network namespaces, and removes the cgroups, the CNI state and
the ``/var/log/containers`` links it made. Nothing outside the work directory and the
caches remains, also when a test failed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from e2e import images, procs
from e2e.controlplane import binary_dir, write_kubeconfig
from e2e.netns import NODE_IP, POD_CIDR, POD_GATEWAY, SERVICE_CIDR, NodeNetwork

log = logging.getLogger("e2e.realnode")
NODE_NAME = "kvpilot-e2e-node"
CNI_BIN = Path("/usr/lib/cni")
CNI_NETWORK = "kvpilot-e2e"
CONTAINERD_ROOT = Path(os.environ.get(
    "KVPILOT_CONTAINERD_CACHE", Path.home() / ".cache" / "kvpilot" / "containerd"))
CONTAINER_LOGS = Path("/var/log/containers")
CNI_CACHE = Path("/var/lib/cni")


def containerd_config(workdir: Path, cni_conf: Path) -> str:
    state = workdir / "containerd" / "state"
    return f"""version = 2
root = "{CONTAINERD_ROOT / 'root'}"
state = "{state}"
disabled_plugins = ["io.containerd.internal.v1.tracing", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{workdir / 'containerd' / 'containerd.sock'}"

[ttrpc]
  address = "{workdir / 'containerd' / 'containerd.sock.ttrpc'}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{workdir / 'containerd' / 'opt'}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{images.PAUSE_REF}"
  restrict_oom_score_adj = true
  stream_server_address = "{NODE_IP}"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"""


def import_containerd_config(workdir: Path) -> str:
    """A containerd on the cached root with no CRI plugin and no network: what
    :func:`import_offline` starts to fill the root before any node runs."""
    return f"""version = 2
root = "{CONTAINERD_ROOT / 'root'}"
state = "{workdir / 'state'}"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.tracing",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{workdir / 'containerd.sock'}"

[ttrpc]
  address = "{workdir / 'containerd.sock.ttrpc'}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{workdir / 'opt'}"
"""


def lock_containerd_root() -> int:
    """An exclusive lock on the cached containerd root (a file descriptor to close to
    release it): one containerd at a time may use that root.

    Raises:
        RuntimeError: another e2e session or ``make e2e-images`` holds it.
    """
    CONTAINERD_ROOT.mkdir(parents=True, exist_ok=True)
    fd = os.open(CONTAINERD_ROOT / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"the containerd cache {CONTAINERD_ROOT} is in use by another e2e "
                           "session or `make e2e-images`; wait for it to end") from None
    return fd


def import_offline(builder: images.Builder, refs: list[str], *,
                   progress=lambda line: None, timeout: float = 1800) -> dict[str, float]:
    """Import the sandbox image and ``refs`` into the cached containerd root (namespace
    ``k8s.io``, unpacked for overlayfs, as the CRI plugin finds them when a node starts on
    that root) and remove every other image there; returns seconds per imported ref
    (0 for those already present).

    Runs a containerd of its own, without the CRI plugin, on a socket in a temporary
    directory; stops it and unmounts what it left, also on error. The node's containerd
    must not run on the same root at the same time.

    Raises:
        images.ImageBuildError: an import failed or the imports ran past ``timeout``
            seconds together (the output's tail).
        RuntimeError: the root is locked by another run (:func:`lock_containerd_root`),
            or containerd exited at start (its log's tail).
        TimeoutError: containerd did not answer within 60 s (its log's tail).
        FileNotFoundError: containerd or ctr is not installed.
    """
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        raise FileNotFoundError("containerd is not installed: run scripts/install-tools.sh")
    lock = lock_containerd_root()
    (CONTAINERD_ROOT / "root").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvpilot-ctr-import-"))
    config = work / "config.toml"
    config.write_text(import_containerd_config(work))
    proc = procs.start("containerd-import", ["containerd", "--config", str(config)],
                       builder.logs)
    ctr = ["ctr", "--address", str(work / "containerd.sock"), "--namespace", "k8s.io"]
    timings: dict[str, float] = {}
    try:
        procs.wait_until(lambda: subprocess.run([*ctr, "version"], capture_output=True,
                                                check=False).returncode == 0
                         or not proc.alive(), 60, "the import containerd",
                         on_timeout=proc.log_tail)
        if not proc.alive():
            raise RuntimeError(f"containerd exited:\n{proc.log_tail()}")
        wanted = [builder.ensure_pause(), *refs]
        deadline = time.monotonic() + timeout
        for ref in wanted:
            start = time.monotonic()
            if start >= deadline:
                raise images.ImageBuildError(f"importing the images ran past {timeout:.0f} s "
                                             f"before {ref}")
            imported = images.import_into(builder, ref, ctr, timeout=deadline - start)
            timings[ref] = time.monotonic() - start if imported else 0.0
            if imported:
                progress(f"imported {ref} into containerd in {timings[ref]:.0f} s")
        images.prune_containerd(ctr, wanted)
    finally:
        proc.stop(grace_seconds=20)
        RealNode._unmount_under([work, CONTAINERD_ROOT])
        shutil.rmtree(work, ignore_errors=True)
        os.close(lock)
    return timings


def cni_config(workdir: Path) -> dict:
    """The pods' network: bridge cni0, host-local IPAM, routes to the node and Services."""
    return {
        "cniVersion": "1.0.0", "name": CNI_NETWORK,
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "isDefaultGateway": False,
             "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(workdir / "cni" / "ipam"),
                      "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                      "routes": [{"dst": SERVICE_CIDR, "gw": POD_GATEWAY},
                                 {"dst": f"{NODE_IP}/32", "gw": POD_GATEWAY}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


@dataclass
class RealNode:
    """A started node; ``ctr`` is the argv prefix for its containerd (namespace k8s.io)."""

    workdir: Path
    network: NodeNetwork
    server: str  # the API server as the node reaches it
    ca: Path
    node_token: str
    proxy_token: str
    procs: dict[str, procs.Proc] = field(default_factory=dict)
    cgroup_root: str = ""
    _netns_before: set[str] = field(default_factory=set)
    _root_lock: int | None = None
    _dirs_before: dict[Path, bool] = field(default_factory=dict)

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def ctr(self) -> list[str]:
        return ["ctr", "--address", str(self.workdir / "containerd" / "containerd.sock"),
                "--namespace", "k8s.io"]

    # ---- start
    def start_containerd(self) -> RealNode:
        for tool in ("containerd", "runc", "ctr", "nsenter", "iptables", "conntrack"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"{tool} is not installed: run scripts/install-tools.sh")
        if not (CNI_BIN / "bridge").exists():
            raise FileNotFoundError(f"{CNI_BIN}/bridge is missing: install "
                                    "containernetworking-plugins (scripts/install-tools.sh)")
        self._root_lock = lock_containerd_root()
        self._netns_before = set(os.listdir("/run/netns")) if Path("/run/netns").exists() else set()
        # Directories the kubelet and libcni create outside the work directory.
        self._dirs_before = {d: d.exists() for d in (CONTAINER_LOGS, CNI_CACHE / "results",
                                                     CNI_CACHE)}
        cni_conf = self.workdir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-kvpilot.conflist").write_text(json.dumps(cni_config(self.workdir),
                                                                 indent=2))
        (self.workdir / "containerd").mkdir(parents=True, exist_ok=True)
        (CONTAINERD_ROOT / "root").mkdir(parents=True, exist_ok=True)
        config = self.workdir / "containerd" / "config.toml"
        config.write_text(containerd_config(self.workdir, cni_conf))
        self._start_containerd(config)
        leftovers = self._ctr("containers", "ls", "-q").stdout.split()
        if leftovers:
            log.warning("realnode: removing %d containers a previous run left", len(leftovers))
            self._remove_all_containers()
            self.procs.pop("containerd").stop(grace_seconds=20)
            self._start_containerd(config)
        return self

    def _start_containerd(self, config: Path) -> None:
        self.procs["containerd"] = procs.start(
            "containerd", self.network.wrap(["containerd", "--config", str(config)]),
            self.log_dir)
        procs.wait_until(lambda: self._ctr("version", check=False).returncode == 0
                         or not self.procs["containerd"].alive(), 60, "containerd")
        if not self.procs["containerd"].alive():
            raise RuntimeError(f"containerd exited:\n{self.procs['containerd'].log_tail()}")

    def _ctr(self, *args: str, check: bool = True, timeout: float = 120
             ) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.ctr, *args], capture_output=True, text=True,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def load_images(self, builder: images.Builder, refs: list[str]) -> None:
        """Import the sandbox image and ``refs`` (already built) unless containerd has them;
        remove every other image (older builds) from the cached containerd root."""
        wanted = [builder.ensure_pause(), *refs]
        for ref in wanted:
            images.import_into(builder, ref, self.ctr)
        images.prune_containerd(self.ctr, wanted)

    def start_kubelet(self) -> RealNode:
        """The kubelet and kube-proxy; waits until the Node is Ready."""
        bins = binary_dir()
        for name in ("kubelet", "kube-proxy"):
            if not (bins / name).exists():
                raise FileNotFoundError(f"{bins / name} is missing: run e2e/build-k8s.sh first")
        pki = self.workdir / "pki"
        kubelet_dir = self.workdir / "kubelet"
        kubelet_dir.mkdir(parents=True, exist_ok=True)
        self.cgroup_root = f"/kvpilot-e2e-{os.getpid()}"
        # The kubelet wants its cgroup root to exist in every hierarchy already.
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            if hierarchy.is_dir() and not hierarchy.is_symlink():
                with contextlib.suppress(OSError):
                    (hierarchy / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)
        kubeconfig = write_kubeconfig(kubelet_dir / "kubelet.kubeconfig", self.server, self.ca,
                                 self.node_token, f"system:node:{NODE_NAME}")
        resolv = kubelet_dir / "resolv.conf"
        resolv.write_text("# no DNS in the e2e cluster\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": NODE_IP, "port": procs.free_port(), "readOnlyPort": 0,
            "healthzBindAddress": NODE_IP, "healthzPort": 0,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.ca)}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root, "failCgroupV1": False,
            "failSwapOn": False, "containerRuntimeEndpoint":
                f"unix://{self.workdir / 'containerd' / 'containerd.sock'}",
            "podLogsDir": str(self.workdir / "pod-logs"), "resolvConf": str(resolv),
            "clusterDomain": "cluster.local", "podCIDR": POD_CIDR,
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False, "nodeStatusUpdateFrequency": "4s",
            "syncFrequency": "10s", "fileCheckFrequency": "10s",
            "shutdownGracePeriod": "0s", "protectKernelDefaults": False,
            "localStorageCapacityIsolation": False,
        }
        (kubelet_dir / "config.yaml").write_text(yaml.safe_dump(config))
        self.procs["kubelet"] = procs.start("kubelet", self.network.wrap([
            str(bins / "kubelet"), f"--config={kubelet_dir / 'config.yaml'}",
            f"--kubeconfig={kubeconfig}", f"--root-dir={kubelet_dir / 'root'}",
            f"--cert-dir={pki / 'kubelet'}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}", "--v=1",
        ]), self.log_dir)
        proxy_kubeconfig = write_kubeconfig(self.workdir / "kube-proxy.kubeconfig", self.server,
                                       self.ca, self.proxy_token, "system:kube-proxy")
        proxy_config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(proxy_kubeconfig)},
            "mode": "iptables", "hostnameOverride": NODE_NAME, "bindAddress": NODE_IP,
            "healthzBindAddress": f"{NODE_IP}:{procs.free_port()}",
            "metricsBindAddress": f"{NODE_IP}:{procs.free_port()}",
            "clusterCIDR": POD_CIDR,
            "iptables": {"masqueradeAll": True, "localhostNodePorts": False},
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }
        (self.workdir / "kube-proxy.yaml").write_text(yaml.safe_dump(proxy_config))
        self.procs["kube-proxy"] = procs.start("kube-proxy", self.network.wrap([
            str(bins / "kube-proxy"), f"--config={self.workdir / 'kube-proxy.yaml'}",
        ]), self.log_dir)
        return self

    def kill_task(self, container_id: str) -> None:
        """SIGKILL a container's processes through containerd (the kubelet then sees exit
        code 137 and restarts it as the pod's restartPolicy says)."""
        self._ctr("tasks", "kill", "--all", "-s", "SIGKILL", container_id)

    # ---- stop
    def stop(self, api_delete_pods=None) -> None:
        """Tear everything down (see the module docstring); ``api_delete_pods`` is called
        first, while the kubelet still runs, to delete every pod through the API."""
        if api_delete_pods is not None and self.procs.get("kubelet") is not None:
            with contextlib.suppress(Exception):
                api_delete_pods()
        for name in ("kube-proxy", "kubelet"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop(grace_seconds=15)
        if self.procs.get("containerd") is not None and self.procs["containerd"].alive():
            with contextlib.suppress(Exception):
                self._remove_all_containers()
        proc = self.procs.pop("containerd", None)
        if proc is not None:
            proc.stop(grace_seconds=20)
        self._kill_shims()
        self._remove_cgroups()
        # The cached root only when this node holds it (never another run's mounts).
        self._unmount_under([self.workdir, *([CONTAINERD_ROOT] if self._root_lock is not None
                                             else [])])
        self._remove_pod_netns()
        self._remove_cni_state()
        self._remove_container_log_links()
        for directory, existed in self._dirs_before.items():
            if not existed:
                with contextlib.suppress(OSError):
                    directory.rmdir()  # only when empty: never someone else's files
        if self._root_lock is not None:
            os.close(self._root_lock)
            self._root_lock = None

    def _remove_all_containers(self) -> None:
        for task in self._ctr("tasks", "ls", "-q", check=False).stdout.split():
            self._ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 20
        while self._ctr("tasks", "ls", "-q", check=False).stdout.split() and \
                time.monotonic() < deadline:
            for task in self._ctr("tasks", "ls", "-q", check=False).stdout.split():
                self._ctr("tasks", "rm", "-f", task, check=False)
            time.sleep(0.5)
        for container in self._ctr("containers", "ls", "-q", check=False).stdout.split():
            self._ctr("containers", "rm", container, check=False)

    def _kill_shims(self) -> None:
        """containerd's shims run in sessions of their own; kill ours by their -address."""
        sock = str(self.workdir / "containerd" / "containerd.sock")
        for pid in _pids():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmdline and cmdline[0].endswith(b"containerd-shim-runc-v2") and \
                    sock.encode() in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _remove_cgroups(self) -> None:
        """Kill every process under the cgroup root, then rmdir it bottom-up in each hierarchy."""
        if not self.cgroup_root:
            return
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            top = hierarchy / self.cgroup_root.lstrip("/")
            if not top.is_dir():
                continue
            for attempt in range(20):
                dirs = [*sorted((p for p in top.rglob("*") if p.is_dir()),
                                key=lambda p: len(p.parts), reverse=True), top]
                for d in dirs:
                    for name in ("cgroup.procs", "tasks"):
                        with contextlib.suppress(OSError):
                            for pid in (d / name).read_text().split():
                                with contextlib.suppress(ProcessLookupError, ValueError):
                                    os.kill(int(pid), signal.SIGKILL)
                    with contextlib.suppress(OSError):
                        d.rmdir()
                if not top.exists():
                    break
                time.sleep(0.25 * (attempt + 1))
            if top.exists():
                log.warning("realnode: could not remove cgroup %s", top)

    @staticmethod
    def _unmount_under(roots: list[Path]) -> None:
        """Lazily unmount every mount point under ``roots``, deepest first."""
        prefixes = [str(r.resolve()) + "/" for r in roots]
        points = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].encode().decode("unicode_escape")
                if any(point.startswith(p) for p in prefixes):
                    points.append(point)
        for point in sorted(set(points), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)

    def _remove_pod_netns(self) -> None:
        """The pods' namespaces containerd made under /run/netns (cni-<uuid>)."""
        if not Path("/run/netns").exists():
            return
        for name in set(os.listdir("/run/netns")) - self._netns_before:
            if name.startswith("cni-"):
                subprocess.run(["umount", "-l", f"/run/netns/{name}"], capture_output=True,
                               check=False)
                with contextlib.suppress(OSError):
                    os.unlink(f"/run/netns/{name}")

    @staticmethod
    def _remove_cni_state() -> None:
        """libcni's result cache entries of this suite's network (/var/lib/cni/results)."""
        results = CNI_CACHE / "results"
        if results.is_dir():
            for entry in results.glob(f"{CNI_NETWORK}-*"):
                entry.unlink(missing_ok=True)

    def _remove_container_log_links(self) -> None:
        """The kubelet's /var/log/containers links into this run's pod log directory."""
        if not CONTAINER_LOGS.is_dir():
            return
        ours = str(self.workdir / "pod-logs")
        for link in CONTAINER_LOGS.iterdir():
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith(ours):
                    link.unlink()


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]
