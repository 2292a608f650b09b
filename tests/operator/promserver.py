"""Run a real Prometheus server (Debian's ``prometheus`` package, linked into .tools/bin
by scripts/install-tools.sh) for tests: 127.0.0.1 on a free port, a temporary config and
TSDB, a 1 s scrape interval, bounded waits, always stopped by pid (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.serverproc import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_SECONDS = 60.0


def prometheus_binary() -> str:
    """.tools/bin/prometheus, else the one on PATH; a clear failure (not a skip) if absent."""
    local = REPO / ".tools" / "bin" / "prometheus"
    if local.exists():
        return str(local)
    found = shutil.which("prometheus")
    if found:
        return found
    raise RuntimeError("the prometheus binary is missing: run `make tools` "
                       "(scripts/install-tools.sh installs Debian's prometheus package)")


class PrometheusProcess:
    """Prometheus scraping ``targets``: (``host:port``, extra target labels) pairs."""

    def __init__(self, targets: Sequence[tuple[str, Mapping[str, str]]],
                 scrape_interval: str = "1s") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvpilot-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval,
                       "scrape_timeout": scrape_interval},
            "scrape_configs": [{
                "job_name": "kvpilot-engine",
                "static_configs": [{"targets": [t], "labels": dict(labels)}
                                   for t, labels in targets],
            }],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout}s:\n{self.logs()}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        response.raise_for_status()
        return response.json()["data"]["result"]

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def logs(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
