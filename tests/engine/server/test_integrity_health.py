"""The KV cache integrity check that runs when the engine goes idle is visible outside the
process: counted in /metrics, and a failure makes /health fail (so Kubernetes restarts the
pod) while the loop goes on answering."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from kvpilot.engine.server.api_server import build_app
from kvpilot.engine.server.async_engine import AsyncEngine, wait_until
from kvpilot.engine.server.metrics import EngineMetrics
from kvpilot.engine.server.state import ServerState


class FakeScheduler:
    def __init__(self, broken: bool) -> None:
        self.broken = broken
        self.checked = threading.Event()

    def check_integrity(self) -> None:
        self.checked.set()
        if self.broken:
            raise RuntimeError("free 3 + cached 2 + used 4 != total 10 blocks")


class FakeEngine:
    """Busy for ``busy_steps`` steps, then idle (when the loop runs the check)."""

    def __init__(self, broken: bool, busy_steps: int = 2) -> None:
        self.scheduler = FakeScheduler(broken)
        self.busy_steps = busy_steps

    def has_unfinished_requests(self) -> bool:
        return self.busy_steps > 0

    def step(self) -> list:
        self.busy_steps -= 1
        return []


def serve(broken: bool):
    fake = FakeEngine(broken)
    metrics = EngineMetrics("m")
    engine = AsyncEngine(lambda: fake, on_integrity_check=metrics.observe_integrity_check)
    engine.start()
    assert fake.scheduler.checked.wait(10)
    assert wait_until(lambda: engine.integrity_checks == 1, 5)
    return fake, engine, TestClient(build_app(ServerState(engine, metrics, "m")))


def sample(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_a_passing_check_is_counted_and_health_stays_ok():
    _, engine, client = serve(broken=False)
    try:
        assert client.get("/health").status_code == 200
        assert sample(client, "kvpilot:kv_cache_integrity_checks_total") == 1.0
        assert sample(client, "kvpilot:kv_cache_integrity_failures_total") == 0.0
    finally:
        engine.shutdown()


def test_a_failed_check_fails_health_with_the_reason_and_is_counted():
    _, engine, client = serve(broken=True)
    try:
        r = client.get("/health")
        assert r.status_code == 503
        assert "integrity check failed" in r.json()["error"]["message"]
        assert "free 3 + cached 2 + used 4 != total 10" in r.json()["error"]["message"]
        assert sample(client, "kvpilot:kv_cache_integrity_checks_total") == 1.0
        assert sample(client, "kvpilot:kv_cache_integrity_failures_total") == 1.0
        assert engine._thread.is_alive()  # the loop itself carries on
    finally:
        engine.shutdown()
