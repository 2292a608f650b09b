"""A Prometheus server on loopback (or, on the real node, on the node's address inside the
suite's network namespace) that finds the engine pods through Kubernetes service
discovery (``kubernetes_sd_configs``, role ``pod``) against the real API server, with a
ServiceAccount token that may only list and watch pods, and scrapes them on their pod
addresses with the relabelling docs/operations.md documents.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import procs
from e2e.controlplane import binary_dir

SCRAPE_INTERVAL = "2s"


def config(api_server: str, ca: Path, token_file: Path) -> str:
    return json.dumps({
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [{
            "job_name": "kvpilot-engines",
            "kubernetes_sd_configs": [{
                "role": "pod", "api_server": api_server,
                "tls_config": {"ca_file": str(ca)},
                "authorization": {"credentials_file": str(token_file)},
            }],
            "relabel_configs": [
                {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
                 "action": "keep", "regex": "true"},
                {"source_labels": ["__meta_kubernetes_pod_phase"], "action": "keep",
                 "regex": "Running"},
                {"source_labels": ["__address__",
                                   "__meta_kubernetes_pod_annotation_prometheus_io_port"],
                 "regex": "([^:]+)(?::\\d+)?;(\\d+)", "replacement": "$1:$2",
                 "target_label": "__address__"},
                {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"],
                 "regex": "(.+)", "target_label": "__metrics_path__"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": [
                    "__meta_kubernetes_pod_label_kvpilot_dev_inference_deployment"],
                 "target_label": "inference_deployment"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            ],
        }],
    }, indent=1)  # JSON is YAML


@dataclass
class Prometheus:
    workdir: Path
    api_server: str
    ca: Path
    token_file: Path
    port: int = 0
    proc: procs.Proc | None = None
    host: str = "127.0.0.1"
    network: Any = None  # an e2e.netns.NodeNetwork to run inside, or None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(config(self.api_server, self.ca, self.token_file))
        self.port = self.port or procs.free_port()
        argv = [
            str(binary_dir() / "prometheus"), f"--config.file={cfg}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address={self.host}:{self.port}",
            "--storage.tsdb.retention.time=2h", "--log.level=warn",
        ]
        if self.network is not None:
            argv = self.network.wrap(argv)
        self.proc = procs.start("prometheus", argv, self.workdir.parent / "logs")

        def ready() -> bool:
            if not self.proc.alive():
                raise RuntimeError(f"prometheus exited:\n{self.proc.log_tail()}")
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=3) as r:
                return r.status == 200

        procs.wait_until(ready, timeout, "prometheus /-/ready")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)["data"]["result"]

