"""The scaling timeline: the resource's status, its Deployment's replica count and each
engine pod's finished requests sampled once a second (in a thread), printed as a table
and plotted as a PNG."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

COLUMNS = ("t", "deploymentReplicas", "readyReplicas", "cacheUsage", "requestsRunning",
           "requestsWaiting", "metricsAvailable")


class Recorder:
    """``with Recorder(cluster, ns, name) as r: ...``; the samples are in ``r.rows``."""

    def __init__(self, cluster: Any, namespace: str, name: str, period: float = 1.0):
        self.cluster, self.namespace, self.name, self.period = cluster, namespace, name, period
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)
        self.t0 = time.time()

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> dict[str, Any]:
        obj = self.cluster.get_json("-n", self.namespace, "inferencedeployment", self.name)
        dep = self.cluster.kubectl("get", "-n", self.namespace, "deployment", self.name, "-o",
                                   "json", check=False)
        dep = json.loads(dep.stdout) if dep.returncode == 0 else {}
        st = obj.get("status", {})
        sig = st.get("signals", {})
        metrics = next((c["status"] for c in st.get("conditions", [])
                        if c["type"] == "MetricsAvailable"), None)
        return {
            "t": round(time.time() - self.t0, 1),
            "deploymentReplicas": dep.get("spec", {}).get("replicas"),
            "readyReplicas": st.get("readyReplicas"),
            "desiredReplicas": st.get("desiredReplicas"),
            "cacheUsage": sig.get("cacheUsage"),
            "maxCacheUsage": sig.get("maxCacheUsage"),
            "requestsRunning": sig.get("requestsRunning"),
            "requestsWaiting": sig.get("requestsWaiting"),
            "metricsAvailable": metrics,
            "lastScaleReason": st.get("lastScaleReason"),
            "podRequests": self._pod_requests(),
        }

    def _pod_requests(self) -> dict[str, float]:
        """Finished requests per ready engine pod, read from its own /metrics."""
        pods = self.cluster.get_json(
            "-n", self.namespace, "pods", "-l",
            f"kvpilot.dev/inference-deployment={self.name},app.kubernetes.io/component=engine")
        out: dict[str, float] = {}
        for pod in pods["items"]:
            ip = pod.get("status", {}).get("podIP")
            if not ip or pod["metadata"].get("deletionTimestamp"):
                continue
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=2) as r:
                    text = r.read().decode()
                out[pod["metadata"]["name"]] = sum(
                    float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("kvpilot:request_success_total{"))
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            # A poll during an apiserver hiccup is skipped, not fatal.
            with contextlib.suppress(Exception):
                self.rows.append(self.sample())
            self._stop.wait(self.period)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.rows, indent=1))
        return path


def table(rows: list[dict[str, Any]], every: int = 5) -> str:
    """Every ``every``-th sample (and every change of replicas) as a text table."""
    lines = ["  ".join(f"{c:>18}" for c in COLUMNS)]
    last = None
    for i, r in enumerate(rows):
        key = (r.get("deploymentReplicas"), r.get("readyReplicas"))
        if i % every == 0 or key != last or i == len(rows) - 1:
            lines.append("  ".join(f"{_fmt(r.get(c)):>18}" for c in COLUMNS))
        last = key
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "-" if v is None else str(v)


def _smooth(ys: list[float], window: int = 10) -> list[float]:
    """Trailing mean over ``window`` samples (counters move in bursts of whole requests)."""
    return [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1])
            for i in range(len(ys))]


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Replicas (Deployment, ready) over time above KV usage, queued requests and each
    engine pod's request rate (finished requests per second, from its counter)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]

    def col(name: str) -> list[float]:
        return [float("nan") if r.get(name) is None else r[name] for r in rows]

    fig, (top, mid, low, pods) = plt.subplots(4, 1, sharex=True, figsize=(9, 9))
    top.step(t, col("deploymentReplicas"), where="post", label="Deployment replicas")
    top.step(t, col("readyReplicas"), where="post", label="ready pods")
    top.set_ylabel("replicas")
    top.legend(loc="upper left")
    top.set_title(title)
    mid.plot(t, col("cacheUsage"), label="mean KV usage")
    mid.plot(t, col("maxCacheUsage"), label="max KV usage", linestyle="--")
    mid.set_ylabel("KV usage")
    mid.set_ylim(0, 1)
    mid.legend(loc="upper left")
    low.plot(t, col("requestsRunning"), label="running")
    low.plot(t, col("requestsWaiting"), label="waiting")
    low.set_ylabel("requests")
    low.legend(loc="upper left")
    names = sorted({n for r in rows for n in (r.get("podRequests") or {})})
    for i, name in enumerate(names):
        xs, ys = [], []
        prev = None
        for r in rows:
            n = (r.get("podRequests") or {}).get(name)
            if n is not None and prev is not None and r["t"] > prev[0]:
                xs.append(r["t"])
                ys.append(max(0.0, n - prev[1]) / (r["t"] - prev[0]))
            prev = (r["t"], n) if n is not None else None
        pods.plot(xs, _smooth(ys), label=f"pod {i + 1} ({name[-5:]})")
    pods.set_ylabel("requests/s per pod")
    pods.set_xlabel("seconds")
    if names:
        pods.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
