"""Manifests and reads shared by the scenarios."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import REPO, Cluster
from e2e.timeline import Recorder  # noqa: F401  (re-exported for the scenarios)
from kvpilot.bench import count_failures

SAMPLE = REPO / "crds" / "samples" / "smollm2-cpu.yaml"
# Two cores for everything: a small KV pool per engine keeps memory and start time down.
# 0.25 GiB holds the sample's maxModelLen of 4096 float32 tokens (about 5,800 tokens).
CPU_ENGINE_ARGS = ["--kv-cache-memory", "0.25"]
# small_infd(): maxModelLen 1024 in 0.05 GiB (about 1,150 tokens), so a few requests
# move the KV usage the autoscaler scales on.
SMALL_ENGINE_ARGS = ["--kv-cache-memory", "0.05"]


def sample() -> dict[str, Any]:
    return yaml.safe_load(SAMPLE.read_text())


def small_infd(name: str, **spec_overrides: Any) -> dict[str, Any]:
    """The sample with test-sized resources, a small KV pool and the given spec keys."""
    doc = sample()
    doc["metadata"] = {"name": name}
    spec = doc["spec"]
    spec["engine"]["extraArgs"] = list(SMALL_ENGINE_ARGS)
    spec["engine"]["maxModelLen"] = 1024
    spec["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    spec["terminationGracePeriodSeconds"] = 15
    for key, value in spec_overrides.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = copy.deepcopy(value)
    return doc


def apply(cluster: Cluster, namespace: str, doc: dict[str, Any], check: bool = True):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc),
                           check=check)


def infd(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return cluster.get_json("-n", namespace, "inferencedeployment", name)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == kind:
            return c
    return None


def condition_is(cluster: Cluster, namespace: str, name: str, kind: str, status: str,
                 reason: str | None = None) -> dict | None:
    obj = infd(cluster, namespace, name)
    c = condition(obj, kind)
    if c and c["status"] == status and (reason is None or c.get("reason") == reason):
        return obj
    return None


def reconciled(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The InferenceDeployment once a reconcile of its current generation has written
    its status (``status.observedGeneration == metadata.generation``): every child that
    reconcile applied is then known to the operator as its own. None before."""
    obj = infd(cluster, namespace, name)
    if obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]:
        return obj
    return None


def deployment(cluster: Cluster, namespace: str, name: str) -> dict[str, Any] | None:
    r = cluster.kubectl("get", "-n", namespace, "deployment", name, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def pods(cluster: Cluster, namespace: str, name: str,
         component: str = "engine") -> list[dict[str, Any]]:
    """Every pod of ``name``'s engines (or routers), whatever its state."""
    return cluster.get_json("-n", namespace, "pods", "-l",
                            f"kvpilot.dev/inference-deployment={name},"
                            f"app.kubernetes.io/component={component}")["items"]


def ready_pods(cluster: Cluster, namespace: str, name: str,
               component: str = "engine") -> list[dict[str, Any]]:
    return [p for p in pods(cluster, namespace, name, component) if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in p.get("status", {}).get("conditions", []))]


def start_seconds(pod: dict[str, Any]) -> float | None:
    """A Ready pod's PodScheduled -> Ready seconds (the conditions' transition times,
    one-second resolution); None while it is not Ready."""
    stamps = {c["type"]: c["lastTransitionTime"] for c in pod.get("status", {}).get("conditions", [])
              if c.get("status") == "True"}
    if "Ready" not in stamps or "PodScheduled" not in stamps:
        return None
    ready, scheduled = (datetime.fromisoformat(stamps[k].replace("Z", "+00:00"))
                        for k in ("Ready", "PodScheduled"))
    return (ready - scheduled).total_seconds()


def wait_ready(cluster: Cluster, namespace: str, name: str, replicas: int,
               timeout: float = 240) -> dict[str, Any]:
    """Until ``Ready=True`` with ``replicas`` ready pods; returns the resource."""

    def ok():
        obj = condition_is(cluster, namespace, name, "Ready", "True")
        if obj and obj["status"].get("readyReplicas") == replicas:
            return obj
        return None

    return cluster.wait_for(ok, timeout, f"{namespace}/{name} Ready with {replicas} pods")


def completion(ip: str, prompt: str = "The capital of France is", max_tokens: int = 8,
               model: str = "smollm2-135m-instruct", timeout: float = 60,
               port: int = 8000) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{ip}:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.load(r)


def events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return [e for e in cluster.get_json("-n", namespace, "events")["items"]
            if e["involvedObject"].get("name") == name
            and e["involvedObject"].get("kind") == "InferenceDeployment"]


def service_address(cluster: Cluster, namespace: str, service: str) -> tuple[str, int] | None:
    """Where a client reaches ``service``: its ClusterIP and port (kube-proxy's rules in
    the node's namespace, the host's route to the Service range), once an EndpointSlice
    lists a ready endpoint; None until then."""
    svc = cluster.get_json("-n", namespace, "service", service)
    slices = cluster.get_json("-n", namespace, "endpointslices", "-l",
                              f"kubernetes.io/service-name={service}")["items"]
    if any(e.get("conditions", {}).get("ready") for sl in slices
           for e in sl.get("endpoints") or []):
        return svc["spec"]["clusterIP"], int(svc["spec"]["ports"][0]["port"])
    return None


def wait_service(cluster: Cluster, namespace: str, service: str,
                 timeout: float = 120) -> tuple[str, int]:
    """Until ``service`` has a ready endpoint; returns its (address, port)."""
    return cluster.wait_for(lambda: service_address(cluster, namespace, service), timeout,
                            f"a ready endpoint behind {namespace}/{service}")


def scrape(ip: str, port: int = 8000, path: str = "/metrics") -> dict[str, float]:
    """A pod's Prometheus text as ``{"name{labels}": value}`` (comments dropped)."""
    with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric_sum(samples: dict[str, float], name: str) -> float:
    """The sum of every series of ``name`` (any labels)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def router_log(cluster: Cluster, namespace: str, name: str) -> str:
    """The logs of ``name``'s router pods (``kubectl logs``), ANSI colours removed."""
    return re.sub(r"\x1b\[[0-9;]*m", "", cluster.pod_logs(
        namespace, f"kvpilot.dev/inference-deployment={name},app.kubernetes.io/component=router"))


@dataclass
class BenchRun:
    """One ``kvpilot bench serve`` run: its exit status, stderr and result JSON (None when
    it wrote none)."""

    returncode: int
    stderr: str
    result: dict[str, Any] | None

    def problem(self) -> str | None:
        """Why the run does not count (a failed or unsent request, a non-zero exit, no
        result), or None. Reads the result's real fields (``summary.requests_failed``,
        ``requests_not_sent``, per class); a result without them raises ``KeyError``."""
        if self.result is None:
            return (f"kvpilot bench serve wrote no result (exit {self.returncode}): "
                    f"{self.stderr.strip()[-2000:]}")
        problems = []
        summary = self.result["summary"]
        failed, not_sent = summary["requests_failed"], summary["requests_not_sent"]
        failures = count_failures(self.result)  # every class, with the first error
        if failed or not_sent or failures.unfinished:
            problems.append(failures.describe())
        if self.returncode != 0:
            problems.append(f"kvpilot bench serve exited {self.returncode}: "
                            f"{self.stderr.strip()[-2000:]}")
        return "; ".join(problems) or None

    def checked(self) -> dict[str, Any]:
        """The result JSON; AssertionError when any request failed or the run failed."""
        problem = self.problem()
        assert problem is None, problem
        assert self.result is not None
        return self.result

    def figures(self) -> dict[str, Any]:
        """What a scenario keeps of the run: counts, first error, duration, throughput."""
        out: dict[str, Any] = {"exit_status": self.returncode}
        if self.result is None:
            return out | {"error": self.stderr.strip()[-2000:]}
        summary = self.result["summary"]
        failures = count_failures(self.result)
        ttft = summary.get("ttft_ms") or {}
        return out | {
            "requests_completed": summary["requests_completed"],
            "requests_failed": summary["requests_failed"],
            "requests_not_sent": summary["requests_not_sent"],
            "first_error": failures.first_error,
            "duration_s": self.result["duration_s"],
            "request_throughput": summary.get("request_throughput"),
            "ttft_ms_mean": ttft.get("mean"),
        }


def bench_serve(argv: list[str], result_json: Path, timeout: float = 900) -> BenchRun:
    """Run ``kvpilot bench serve`` (``argv`` without ``--result-json``), unchecked: the
    caller checks the run (``BenchRun.checked``) where a failed request must fail the test."""
    result_json.unlink(missing_ok=True)  # never read an earlier run's file
    proc = subprocess.run([*argv, "--result-json", str(result_json)], capture_output=True,
                          text=True, timeout=timeout)
    result = json.loads(result_json.read_text()) if result_json.exists() else None
    return BenchRun(proc.returncode, proc.stderr, result)


def keep_results(cluster: Cluster, file_name: str, key: str, value: Any) -> Path:
    """Merge ``{key: value}`` into the JSON file ``file_name`` in the run's work directory
    (where the e2e run keeps its logs, timelines and figures); returns its path."""
    path = cluster.workdir / file_name
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
