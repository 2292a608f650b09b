"""The hold that scale to zero relies on, checked against the pinned vllm-router binary:
with the retry flags the operator gives a ``minReplicas: 0`` fleet's router, a request
that finds no engine is held (and counted where the operator's activation probe looks),
served by an engine that appears while it is held, and answered 503 once
``activationTimeoutSeconds`` has passed. The engine is a stand-in HTTP server (the router
only forwards), added through the router's ``/add_worker`` as service discovery would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvpilot.operator.autoscaling.activation import ActivationProbe
from kvpilot.operator.autoscaling.metrics_source import EnginePod
from kvpilot.operator.builders.router import retry_args
from kvpilot.operator.spec import parse_spec
from tests.serverproc import free_port

from .fake_apiserver import send_json

pytestmark = [pytest.mark.server]
EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}


def _spec(activation_timeout: int):
    return parse_spec({"model": EMBEDDED, "autoscaling": {
        "minReplicas": 0, "maxReplicas": 2, "activationTimeoutSeconds": activation_timeout}})


class _Engine(BaseHTTPRequestHandler):
    """Answers health checks and one completion, like an engine that just became ready."""

    def _send(self, body: dict) -> None:
        send_json(self, 200, body)

    def do_GET(self) -> None:
        self._send({"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send({"id": "cmpl-1", "object": "text_completion",
                    "choices": [{"index": 0, "text": " Paris", "finish_reason": "length"}]})

    def log_message(self, *args) -> None:
        pass


class Router:
    """vllm-router on 127.0.0.1 with no engine and the scale-to-zero retry flags."""

    def __init__(self, activation_timeout: int) -> None:
        binary = Path(sys.executable).with_name("vllm-router")
        if not binary.exists():
            pytest.fail("vllm-router is not installed: pip install -e '.[router]'", pytrace=False)
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(binary), "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
             "--policy", "round_robin", *retry_args(_spec(activation_timeout))],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.logs()
            try:
                if httpx.get(f"{self.url}/liveness", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"vllm-router did not start:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture
def router_for():
    started: list[Router] = []

    def start(activation_timeout: int) -> Router:
        started.append(Router(activation_timeout))
        return started[-1]
    yield start
    for router in started:
        router.stop()


@pytest.fixture
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def _complete(router: Router, out: dict) -> None:
    start = time.monotonic()
    try:
        response = httpx.post(f"{router.url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": "The capital of France is", "max_tokens": 2})
        out["status"], out["text"] = response.status_code, response.text
    except httpx.HTTPError as exc:
        out["status"], out["text"] = None, repr(exc)
    out["seconds"] = time.monotonic() - start


def test_a_held_request_is_seen_by_the_probe_and_served_by_an_engine_that_appears(
        router_for, engine):
    router = router_for(activation_timeout=30)
    probe = ActivationProbe("test/zero")
    pod = EnginePod("router", "127.0.0.1", router.metrics_port)
    try:
        assert probe.poll((pod,), 0.0) == 0.0  # baseline
        out: dict = {}
        client = threading.Thread(target=_complete, args=(router, out))
        client.start()
        time.sleep(1.5)
        held = probe.poll((pod,), 1.5)
        assert held is not None and held > 0, router.logs()  # the activation signal
        assert client.is_alive()  # held, not answered
        added = httpx.post(f"{router.url}/add_worker", params={"url": engine}, timeout=10)
        assert added.status_code == 200, added.text
        client.join(30)
        assert out["status"] == 200, (out, router.logs())
        assert json.loads(out["text"])["choices"][0]["text"] == " Paris"
        assert out["seconds"] >= 1.5
    finally:
        probe.close()


def test_a_request_held_past_the_activation_timeout_gets_a_503(router_for):
    router = router_for(activation_timeout=2)
    out: dict = {}
    _complete(router, out)
    assert out["status"] == 503, (out, router.logs())
    assert "No available workers" in out["text"]
    assert 2.0 <= out["seconds"] < 4.0, out
