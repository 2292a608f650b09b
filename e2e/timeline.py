"""The scaling timeline: the resource's status and its Deployment's replica count sampled
once a second (in a thread), printed as a table and plotted as a PNG."""

from __future__ import annotations

import contextlib
import json
import threading
import time
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
        }

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


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Replicas (Deployment, ready) over time above KV usage and queued requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]

    def col(name: str) -> list[float]:
        return [float("nan") if r.get(name) is None else r[name] for r in rows]

    fig, (top, mid, low) = plt.subplots(3, 1, sharex=True, figsize=(9, 7))
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
    low.set_xlabel("seconds")
    low.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
