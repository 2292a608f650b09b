"""A local node: stands in for the kubelet and a container runtime, which these machines
cannot run (no container engine, no cgroups to delegate).

It registers one Node (capacity, ``Ready``, heartbeats through its Lease and its status)
and runs every pod the scheduler binds to it as local processes:

- each container's ``command`` + ``args`` with its ``env`` (values and the downward API's
  name/namespace/podIP); the image is not pulled: ``kvpilot ...`` runs this repo's
  ``.venv/bin/kvpilot`` (what the engine image's entrypoint is), ``python3`` its python;
- each pod on its own loopback address 127.0.0.N: ``--host 0.0.0.0`` (and any
  ``--...host 0.0.0.0``, such as the router's ``--prometheus-host``) becomes
  ``--host 127.0.0.N``, ZMQ bind addresses ``tcp://*:PORT`` become ``tcp://127.0.0.N:PORT``,
  and the container port is kept, so pods never collide; ``vllm-router`` runs this repo's
  ``.venv/bin/vllm-router`` (what the router image's entrypoint is);
- a pod whose service account token is mounted (``automountServiceAccountToken`` not
  false) gets a token from the TokenRequest API, bound to the pod and its service account
  as the kubelet's projected token is, written into a kubeconfig that ``KUBECONFIG``
  names (clients such as the router's Kubernetes discovery read it before the in-cluster
  files), so the pod's RBAC is what its requests are checked against;
- emptyDir volumes are per-pod directories; env values under a mount path are rewritten
  to point into them (``HOME=/tmp`` becomes ``<pod dir>/tmp``);
- the pod's own startup, liveness and readiness probes (HTTP GET) decide ``Ready`` and
  restarts; a container that exits is restarted as restartPolicy says (with a short
  back-off) and its restartCount, lastState and exit code are reported;
- on deletion it runs the preStop ``sleep``, sends SIGTERM, honours the grace period,
  then SIGKILL, and removes the pod object (as the kubelet does).

Not modelled: images, resource limits, init container retries, exec probes other than
none, logs/exec/port-forward, node-pressure eviction.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

log = logging.getLogger("e2e.node")
REPO = Path(__file__).resolve().parent.parent
RESTART_BACKOFF_SECONDS = 2.0


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def resolve_argv(container: dict[str, Any], pod_ip: str) -> list[str]:
    """The local command line of a container (see the module docstring)."""
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    if not argv:
        raise ValueError(f"container {container['name']} has no command: images are not run")
    bin_dir = Path(sys.executable).parent
    if argv[0] in ("kvpilot", "vllm-router"):
        argv[0] = str(bin_dir / argv[0])
    elif argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    for i, arg in enumerate(argv[:-1]):
        if arg.startswith("--") and arg.endswith("host") and argv[i + 1] in ("0.0.0.0", "::"):
            argv[i + 1] = pod_ip
    # ZMQ bind addresses (the engine's KV events endpoints, also inside its JSON config).
    return [a.replace("tcp://*:", f"tcp://{pod_ip}:").replace("tcp://0.0.0.0:", f"tcp://{pod_ip}:")
            for a in argv]


@dataclass
class Container:
    spec: dict[str, Any]
    proc: subprocess.Popen | None = None
    restart_count: int = 0
    started_at: str | None = None
    started: bool = False  # the startup probe passed
    ready: bool = False
    last_exit: dict[str, Any] | None = None
    liveness_failures: int = 0
    readiness_failures: int = 0
    startup_failures: int = 0


@dataclass
class PodRunner:
    """One pod's processes and probes; runs in its own thread."""

    node: LocalNode
    pod: dict[str, Any]
    ip: str
    containers: list[Container] = field(default_factory=list)
    deleting: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def key(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    # ---- processes
    def _pod_dir(self) -> Path:
        return self.node.workdir / "pods" / self.pod["metadata"]["uid"]

    def _env(self, container: dict[str, Any]) -> dict[str, str]:
        meta = self.pod["metadata"]
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}
        mounts = {m["mountPath"]: self._pod_dir() / m["name"]
                  for m in container.get("volumeMounts") or []}
        for item in container.get("env") or []:
            value = item.get("value")
            ref = (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
            if ref:
                value = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                         "status.podIP": self.ip}.get(ref, "")
            if value is None:
                continue
            for path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
                if value == path or value.startswith(path.rstrip("/") + "/"):
                    value = str(local) + value[len(path.rstrip("/")):]
                    break
            env[item["name"]] = value
        env.update(self.node.extra_env)
        kubeconfig = self._service_account_kubeconfig()
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        for local in mounts.values():
            local.mkdir(parents=True, exist_ok=True)
        return env

    def _service_account_kubeconfig(self) -> Path | None:
        """A kubeconfig holding a token of the pod's service account, bound to the pod
        (None when the pod does not mount one). Tokens live an hour; pods in the suite
        live minutes."""
        spec, meta = self.pod["spec"], self.pod["metadata"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        account = spec.get("serviceAccountName") or "default"
        request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=3600,
            bound_object_ref=client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"])))
        deadline = time.monotonic() + 30
        while True:  # the account may be created just after the pod, as with a kubelet
            try:
                token = self.node.core.create_namespaced_service_account_token(
                    account, meta["namespace"], request).status.token
                break
            except ApiException as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise
                time.sleep(1)
        conf = self.node.core.api_client.configuration
        path = self._pod_dir() / "serviceaccount.kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "pod",
            "clusters": [{"name": "e2e", "cluster": {
                "server": conf.host, "certificate-authority": conf.ssl_ca_cert}}],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [{"name": "pod", "context": {
                "cluster": "e2e", "user": account, "namespace": meta["namespace"]}}],
        }))
        path.chmod(0o600)
        return path

    def _spawn(self, c: Container) -> None:
        argv = resolve_argv(c.spec, self.ip)
        log_dir = self.node.workdir / "logs" / "pods"
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"{self.pod['metadata']['namespace']}_{self.pod['metadata']['name']}_{c.spec['name']}"
        out = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        c.proc = subprocess.Popen(argv, env=self._env(c.spec), stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd=self._pod_dir(),
                                  start_new_session=True)
        out.close()
        c.started_at, c.started, c.ready = _now(), False, False
        c.liveness_failures = c.readiness_failures = c.startup_failures = 0

    def kill(self, container_name: str | None = None, sig: int = signal.SIGKILL) -> None:
        """Fault injection: signal a container's process group as an OOM kill would."""
        for c in self.containers:
            if c.proc and (container_name is None or c.spec["name"] == container_name):
                _killpg(c.proc.pid, sig)

    # ---- probes
    def _probe(self, c: Container, kind: str) -> bool | None:
        probe = c.spec.get(kind)
        if not probe:
            return None
        get = probe.get("httpGet")
        if not get:
            return True  # exec/tcp probes are not modelled: treated as passing
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in c.spec.get("ports", []) if p.get("name") == port)
        url = f"http://{self.ip}:{port}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1)) as r:
                return 200 <= r.status < 400
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _tick(self, c: Container, now: float, due: dict[str, float]) -> None:
        """Run whichever of the container's probes are due."""
        spec = c.spec
        if not c.started:
            if now >= due.get("startup", 0):
                p = spec.get("startupProbe")
                ok = self._probe(c, "startupProbe")
                due["startup"] = now + (p or {}).get("periodSeconds", 10) if p else now
                if ok is None or ok:
                    c.started = True
                else:
                    c.startup_failures += 1
                    if c.startup_failures >= p.get("failureThreshold", 3):
                        log.warning("%s/%s failed its startup probe: restarting", self.key,
                                    spec["name"])
                        _killpg(c.proc.pid, signal.SIGKILL)
            return
        if now >= due.get("liveness", 0) and spec.get("livenessProbe"):
            p = spec["livenessProbe"]
            due["liveness"] = now + p.get("periodSeconds", 10)
            if self._probe(c, "livenessProbe"):
                c.liveness_failures = 0
            else:
                c.liveness_failures += 1
                if c.liveness_failures >= p.get("failureThreshold", 3):
                    log.warning("%s/%s failed liveness: restarting", self.key, spec["name"])
                    _killpg(c.proc.pid, signal.SIGKILL)
        if now >= due.get("readiness", 0):
            p = spec.get("readinessProbe")
            due["readiness"] = now + (p.get("periodSeconds", 10) if p else 1)
            ok = self._probe(c, "readinessProbe")
            if ok is None or ok:
                c.readiness_failures, c.ready = 0, True
            else:
                c.readiness_failures += 1
                if not c.ready or c.readiness_failures >= p.get("failureThreshold", 3):
                    c.ready = False

    # ---- status
    def _status(self, phase: str) -> dict[str, Any]:
        statuses = []
        for c in self.containers:
            running = c.proc is not None and c.proc.poll() is None
            state = ({"running": {"startedAt": c.started_at}} if running
                     else {"waiting": {"reason": "CrashLoopBackOff" if c.last_exit else
                                       "ContainerCreating"}})
            if phase in ("Succeeded", "Failed") and c.last_exit:
                state = {"terminated": c.last_exit}
            # A merge patch merges maps: null removes the states this one replaces.
            state = {k: state.get(k) for k in ("running", "waiting", "terminated")}
            status = {"name": c.spec["name"], "image": c.spec.get("image", ""), "imageID": "",
                      "containerID": f"local://{c.proc.pid}" if c.proc else "",
                      "ready": c.ready and running, "started": c.started and running,
                      "restartCount": c.restart_count, "state": state}
            if c.last_exit:
                status["lastState"] = {"terminated": c.last_exit}
            statuses.append(status)
        all_ready = bool(self.containers) and all(s["ready"] for s in statuses)
        ready = "True" if all_ready and phase == "Running" else "False"
        conditions = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": ready},
            {"type": "Ready", "status": ready},
        ]
        return {"phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": self.ip, "podIPs": [{"ip": self.ip}], "conditions": conditions,
                "containerStatuses": statuses, "startTime": self.start_time}

    def _report(self, phase: str, last: list) -> None:
        """Patch the pod's status when it changed; ``last`` holds [sent, sent-with-times]."""
        status = self._status(phase)
        if last and last[0] == status:
            return
        sent = copy.deepcopy(status)
        now = _now()
        previous = {c["type"]: c for c in (last[1]["conditions"] if last else [])}
        for cond in status["conditions"]:
            prev = previous.get(cond["type"])
            same = prev is not None and prev["status"] == cond["status"]
            cond["lastTransitionTime"] = prev["lastTransitionTime"] if same else now
        meta = self.pod["metadata"]
        try:
            self.node.core.patch_namespaced_pod_status(meta["name"], meta["namespace"],
                                                       {"status": status})
            last[:] = [sent, status]
        except ApiException as exc:
            if exc.status != 404:
                log.warning("%s: status update failed: %s", self.key, exc.reason)

    # ---- life cycle
    def run(self) -> None:
        try:
            self._run()
        except Exception:
            if not self.node.stopping.is_set():  # else: the apiserver is going away too
                log.exception("%s: pod runner crashed", self.key)
        finally:
            self.done.set()
            self.node.forget(self)

    def _run(self) -> None:
        spec = self.pod["spec"]
        self.start_time = _now()
        self.containers = [Container(c) for c in spec.get("containers", [])]
        last: list = []
        self._report("Pending", last)
        for init in spec.get("initContainers") or []:
            c = Container(init)
            self._spawn(c)
            if c.proc.wait() != 0:
                self._report("Failed", last)
                return
        for c in self.containers:
            self._spawn(c)
        due: dict[str, dict[str, float]] = {c.spec["name"]: {} for c in self.containers}
        restart_at: dict[str, float] = {}
        policy = spec.get("restartPolicy", "Always")
        while not self.deleting.is_set() and not self.node.stopping.is_set():
            now = time.monotonic()
            for c in self.containers:
                code = c.proc.poll() if c.proc else None
                if c.proc and code is not None and c.spec["name"] not in restart_at:
                    c.last_exit = {"exitCode": code if code >= 0 else 128 - code,
                                   "reason": "Completed" if code == 0 else "Error",
                                   "startedAt": c.started_at, "finishedAt": _now()}
                    c.ready = c.started = False
                    if policy == "Always" or (policy == "OnFailure" and code != 0):
                        restart_at[c.spec["name"]] = now + RESTART_BACKOFF_SECONDS
                    else:
                        self._report("Succeeded" if code == 0 else "Failed", last)
                        return
                if c.spec["name"] in restart_at and now >= restart_at[c.spec["name"]]:
                    del restart_at[c.spec["name"]]
                    c.restart_count += 1
                    self._spawn(c)
                    due[c.spec["name"]] = {}
                if c.proc and c.proc.poll() is None:
                    self._tick(c, now, due[c.spec["name"]])
            self._report("Running", last)
            self.deleting.wait(0.5)
        if not self.node.stopping.is_set():
            self._terminate(last)

    def _terminate(self, last: list) -> None:
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        deadline = time.monotonic() + grace
        for c in self.containers:
            c.ready = False
        self._report("Running", last)
        pre_stop = max((_prestop_sleep(c.spec) for c in self.containers), default=0)
        if pre_stop:
            time.sleep(min(pre_stop, max(0.0, deadline - time.monotonic())))
        for c in self.containers:
            if c.proc and c.proc.poll() is None:
                _killpg(c.proc.pid, signal.SIGTERM)
        for c in self.containers:
            if c.proc:
                try:
                    c.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s/%s outlived its grace period: SIGKILL", self.key, c.spec["name"])
                _killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        try:
            self.node.core.delete_namespaced_pod(
                meta["name"], meta["namespace"], grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0,
                                            preconditions=client.V1Preconditions(uid=meta["uid"])))
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("%s: final delete failed: %s", self.key, exc.reason)


def _prestop_sleep(container: dict[str, Any]) -> float:
    pre = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in pre:
        return float(pre["sleep"].get("seconds", 0))
    command = (pre.get("exec") or {}).get("command") or []
    if len(command) == 2 and command[0] == "sleep":
        return float(command[1])
    return 0.0


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class LocalNode:
    """Registers ``name`` and runs the pods bound to it until :meth:`stop`."""

    def __init__(self, api_client: client.ApiClient, workdir: Path, name: str = "e2e-node",
                 extra_env: dict[str, str] | None = None, capacity: dict[str, str] | None = None):
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.name = name
        self.workdir = workdir
        self.extra_env = dict(extra_env or {})
        self.capacity = capacity or {"cpu": "32", "memory": "64Gi", "pods": "110"}
        self.runners: dict[str, PodRunner] = {}
        self._lock = threading.Lock()
        self._free_ips = [f"127.0.0.{n}" for n in range(10, 250)]
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- registration and heartbeats
    def _node_status(self) -> dict[str, Any]:
        now = _now()
        cond = [{"type": t, "status": s, "reason": r, "message": r, "lastHeartbeatTime": now,
                 "lastTransitionTime": self._registered}
                for t, s, r in (("Ready", "True", "KubeletReady"),
                                ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                                ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                                ("PIDPressure", "False", "KubeletHasSufficientPID"))]
        return {"capacity": self.capacity, "allocatable": self.capacity, "conditions": cond,
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                              {"type": "Hostname", "address": self.name}],
                "nodeInfo": {"machineID": "e2e", "systemUUID": "e2e", "bootID": "e2e",
                             "kernelVersion": os.uname().release, "osImage": "kvpilot e2e",
                             "containerRuntimeVersion": "local://0", "kubeletVersion": "v1.37.2",
                             "kubeProxyVersion": "", "operatingSystem": "linux",
                             "architecture": "amd64"}}

    def start(self) -> LocalNode:
        self._registered = _now()
        body = {"metadata": {"name": self.name, "labels": {
            "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64"}}, "spec": {}}
        try:
            self.core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self.core.patch_node_status(self.name, {"status": self._node_status()})
        for target in (self._heartbeat, self._watch):
            thread = threading.Thread(target=target, name=f"node-{target.__name__}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _heartbeat(self) -> None:
        lease_ns = "kube-node-lease"
        while not self.stopping.is_set():
            lease = {"metadata": {"name": self.name, "namespace": lease_ns},
                     "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 40,
                              "renewTime": _micro_now()}}
            try:
                try:
                    self.coordination.patch_namespaced_lease(self.name, lease_ns, lease)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    self.coordination.create_namespaced_lease(lease_ns, lease)
                self.core.patch_node_status(self.name, {"status": self._node_status()})
            except Exception as exc:  # the apiserver may be stopping
                log.debug("heartbeat failed: %r", exc)
            self.stopping.wait(10)

    # ---- pods
    def _watch(self) -> None:
        sanitize = self.core.api_client.sanitize_for_serialization
        while not self.stopping.is_set():
            try:
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=f"spec.nodeName={self.name}", timeout_seconds=30)
                for event in stream:
                    if self.stopping.is_set():
                        break
                    self._on_pod(event["type"], sanitize(event["object"]))
            except Exception as exc:
                if not self.stopping.is_set():
                    log.debug("pod watch restarted: %r", exc)
                    self.stopping.wait(1)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        with self._lock:
            runner = self.runners.get(key)
            if runner and runner.pod["metadata"]["uid"] != meta["uid"]:
                runner = None
            if kind == "DELETED":
                if runner:
                    runner.deleting.set()
                return
            if runner:
                if meta.get("deletionTimestamp"):
                    runner.pod = pod
                    runner.deleting.set()
                return
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return
            if meta.get("deletionTimestamp"):
                self._delete_now(pod)
                return
            runner = PodRunner(node=self, pod=pod, ip=self._free_ips.pop(0))
            self.runners[key] = runner
        threading.Thread(target=runner.run, name=f"pod-{key}", daemon=True).start()

    def _delete_now(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0)

    def forget(self, runner: PodRunner) -> None:
        with self._lock:
            if self.runners.get(runner.key) is runner:
                del self.runners[runner.key]
            self._free_ips.append(runner.ip)

    def runner(self, namespace: str, name: str) -> PodRunner:
        with self._lock:
            return self.runners[f"{namespace}/{name}"]

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every pod's processes (SIGTERM, then SIGKILL) and the node's threads."""
        self.stopping.set()
        with self._lock:
            runners = list(self.runners.values())
        for r in runners:
            for c in r.containers:
                if c.proc and c.proc.poll() is None:
                    _killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for r in runners:
            for c in r.containers:
                if c.proc:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(max(0.1, deadline - time.monotonic()))
                    _killpg(c.proc.pid, signal.SIGKILL)
