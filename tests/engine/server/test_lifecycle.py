"""Server lifecycle: /health and /ready while loading, SIGTERM drain, load failures."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serverproc import ServerProcess, free_port

from .metrics_util import wait_metric

pytestmark = pytest.mark.slow


def test_sigterm_drains_in_flight_requests_then_exits_zero():
    proc = ServerProcess("--kv-cache-memory", "0.1", "--drain-timeout", "120", "--log-level", "info")
    try:
        proc.wait_ready()
        result = {}

        def long_request():
            r = httpx.post(f"{proc.url}/v1/completions",
                           json={"prompt": "Count:", "max_tokens": 40, "ignore_eos": True}, timeout=300)
            result["status"] = r.status_code
            result["tokens"] = r.json()["usage"]["completion_tokens"]

        t = threading.Thread(target=long_request)
        t.start()
        wait_metric(proc.url, "kvpilot:num_requests_running", lambda v: v == 1, timeout=60)
        proc.proc.send_signal(signal.SIGTERM)
        # Draining: not ready, new work refused, the in-flight request finishes.
        deadline = time.monotonic() + 10
        while httpx.get(f"{proc.url}/ready").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{proc.url}/ready").status_code == 503
        r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        t.join(300)
        assert result == {"status": 200, "tokens": 40}
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()


def test_at_the_drain_deadline_what_is_left_gets_a_clean_error_and_the_exit_is_bounded():
    """Found in review: at the deadline uvicorn cancelled the handlers, so clients got a
    500 or a cut stream and the log a traceback; and the process then lived on for a
    minute (uvicorn waiting for connections), past a pod's grace period. A client that
    sent half a request body and stalled is held open here on purpose."""
    import json
    import socket

    from kvpilot.engine.server.cli import ABORT_FLUSH_SECONDS, EXIT_GRACE_SECONDS

    drain = 1.0
    proc = ServerProcess("--kv-cache-memory", "0.1", "--drain-timeout", str(drain), "--log-level", "info")
    stalled = None
    try:
        proc.wait_ready()
        result: dict = {}
        body = {"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True}

        def whole():
            r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=300)
            result["whole"] = (r.status_code, r.json())

        def streamed():
            with httpx.stream("POST", f"{proc.url}/v1/completions", json={**body, "stream": True},
                              timeout=300) as r:
                result["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        wait_metric(proc.url, "kvpilot:num_requests_running", lambda v: v == 2, timeout=60)
        stalled = socket.create_connection((proc.host, proc.port), timeout=5)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.5)  # its headers are read before the signal: its handler waits for the body
        sent = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(120)
        exit_seconds = time.monotonic() - sent
        for t in threads:
            t.join(120)
        status, payload = result["whole"]
        assert status == 503 and "drain timeout" in payload["error"]["message"]
        events = result["stream"]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][6:])
        assert last["error"]["code"] == 503 and "drain timeout" in last["error"]["message"]
        assert len(events) > 2  # it had streamed tokens before the deadline
        assert code == 0
        bound = drain + ABORT_FLUSH_SECONDS + EXIT_GRACE_SECONDS
        # The bound is enforced from the signal by a watchdog; the slack covers signal
        # delivery and process teardown on a loaded two-core machine (the exit used to
        # take a minute past the deadline).
        assert exit_seconds <= bound + 8.0, f"exit took {exit_seconds:.1f}s after SIGTERM; bound {bound:.1f}s"
        logs = proc.logs()
        where = logs.find("Traceback")
        # The whole traceback in the message (pytest would truncate the log): seen once
        # in a cold CI run on a loaded machine, from uvicorn's run_asgi.
        assert where < 0, logs[max(0, where - 1500):where + 4000]
        # The stalled client was answered too: a 503 that says why, not a cut connection
        # (at the deadline if its handler was waiting for the body; at once if the server
        # was already draining when its headers were read).
        reply = b""
        with contextlib.suppress(OSError):
            while chunk := stalled.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 503"), reply
        assert b"drain timeout passed before the request body" in reply or b"the server is draining" in reply, reply
    finally:
        if stalled is not None:
            stalled.close()
        proc.stop()


def test_health_is_up_and_ready_is_503_while_loading():
    proc = ServerProcess("--kv-cache-memory", "0.1")
    try:
        deadline = time.monotonic() + 60
        seen = None
        while time.monotonic() < deadline:
            try:
                seen = (httpx.get(f"{proc.url}/health").status_code, httpx.get(f"{proc.url}/ready").status_code)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert seen == (200, 503)  # bound before the model finished loading
        r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code in (200, 503)
        proc.wait_ready()
    finally:
        proc.stop()


def test_missing_model_fails_fast_with_a_clear_message():
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "serve", "--port", str(port), "--model", "/nope/model.gguf"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "kvpilot serve: model '/nope/model.gguf' not found" in out.stderr


def test_unloadable_model_exits_1(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF but not really")
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "serve", "--port", str(port), "--model", str(bad)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 1
    assert "failed to load" in out.stderr
