"""Scenario: scale to zero and back. An InferenceDeployment with ``minReplicas: 0`` starts
with one engine, goes to zero once idle, stays Ready (the router holds requests), and the
first request through the router's Service brings an engine back and is served: measured
from the request to its first streamed token. A request held past
``activationTimeoutSeconds`` gets a 503, and still wakes the fleet."""

from __future__ import annotations

import threading
import time

import httpx

from e2e.tests import helpers as h
from kvpilot.operator.builders.router import hold_attempts

NAME = "zero"
IDLE_SECONDS = 10
AUTOSCALING = {"minReplicas": 0, "maxReplicas": 1, "intervalSeconds": 3,
               "scaleToZeroAfterSeconds": IDLE_SECONDS, "startupSeconds": 30,
               "scaleDownStabilizationSeconds": 30}
# Long enough for a CPU engine pod to start on the two-core node (about 20-40 s).
HOLD_SECONDS = 180


def _manifest(activation_timeout: int) -> dict:
    return h.small_infd(NAME, autoscaling={**AUTOSCALING,
                                           "activationTimeoutSeconds": activation_timeout})


def _at_zero(cluster, namespace):
    obj = h.condition_is(cluster, namespace, NAME, "Ready", "True", "ScaledToZero")
    dep = h.deployment(cluster, namespace, NAME)
    if obj and dep and dep["spec"]["replicas"] == 0 and not h.pods(cluster, namespace, NAME):
        return obj
    return None


def _router_rolled_out(cluster, namespace, retries: str):
    dep = h.deployment(cluster, namespace, f"{NAME}-router")
    if not dep:
        return None
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    status = dep.get("status", {})
    done = (args[args.index("--retry-max-retries") + 1] == retries
            and status.get("observedGeneration") == dep["metadata"]["generation"]
            and status.get("updatedReplicas") == status.get("replicas") == status.get("readyReplicas") == 1)
    return dep if done else None


def _first_token(address: tuple[str, int], timeout: float) -> tuple[int, float, str]:
    """Stream one completion through the router: (status, seconds to the first token, text)."""
    ip, port = address
    start = time.monotonic()
    body = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
            "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"http://{ip}:{port}/v1/completions", json=body,
                      timeout=timeout) as response:
        if response.status_code != 200:
            return response.status_code, time.monotonic() - start, response.read().decode()
        first, text = None, ""
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first if first is not None else time.monotonic() - start
                text += line
        return 200, first if first is not None else float("inf"), text


def test_an_idle_fleet_goes_to_zero_and_the_first_request_brings_it_back(cluster, namespace):
    h.apply(cluster, namespace, _manifest(activation_timeout=3))
    h.wait_ready(cluster, namespace, NAME, 1)
    router = h.wait_service(cluster, namespace, f"{NAME}-router")

    start = time.monotonic()
    obj = cluster.wait_for(lambda: _at_zero(cluster, namespace), 120, "the idle fleet at zero")
    print(f"e2e scale to zero: at zero {time.monotonic() - start:.1f} s after Ready"
          f" (scaleToZeroAfterSeconds={IDLE_SECONDS})")
    decision = obj["status"]["autoscaler"]["lastDecision"]
    assert decision["rule"] in ("scale_to_zero", "scaled_to_zero"), decision
    assert h.condition(obj, "MetricsAvailable")["reason"] == "ScaledToZero"
    assert any(e["reason"] == "ScaledDown" and "rule scale_to_zero" in e["message"]
               for e in h.events(cluster, namespace, NAME))
    # The router stays ready with no engine behind it: the Service keeps its endpoint.
    assert h.service_address(cluster, namespace, f"{NAME}-router") == router

    # Held for 3 s (activationTimeoutSeconds), longer than an engine takes to start: 503.
    status, seconds, text = _first_token(router, timeout=60)
    print(f"e2e scale to zero: held {seconds:.1f} s, then {status}: {text.strip()}")
    assert status == 503 and "No available workers" in text
    assert 3.0 <= seconds < 10.0
    # ... and the request woke the fleet anyway.
    cluster.wait_for(lambda: (h.deployment(cluster, namespace, NAME) or {}).get("spec", {})
                     .get("replicas") == 1, 20, "the fleet activated by the held request")
    assert any(e["reason"] == "ScaledUp" and "rule activation" in e["message"]
               for e in h.events(cluster, namespace, NAME))

    # Hold long enough for a start-up, wait for zero again, and time a cold start.
    h.apply(cluster, namespace, _manifest(activation_timeout=HOLD_SECONDS))
    cluster.wait_for(lambda: _router_rolled_out(cluster, namespace, str(hold_attempts(HOLD_SECONDS))),
                     120, "the router rolled out with the longer hold")
    cluster.wait_for(lambda: _at_zero(cluster, namespace), 180, "the fleet back at zero")
    router = h.wait_service(cluster, namespace, f"{NAME}-router")

    activated: dict = {}

    def watch_scale(t0: float) -> None:
        while time.monotonic() - t0 < 60 and "seconds" not in activated:
            dep = h.deployment(cluster, namespace, NAME)
            if dep and dep["spec"]["replicas"] == 1:
                activated["seconds"] = time.monotonic() - t0
            time.sleep(0.25)

    t0 = time.monotonic()
    watcher = threading.Thread(target=watch_scale, args=(t0,), daemon=True)
    watcher.start()
    status, ttft, text = _first_token(router, timeout=HOLD_SECONDS + 30)
    watcher.join(65)
    print(f"e2e scale to zero: time to first token from zero {ttft:.1f} s"
          f" (engine Deployment scaled to 1 after {activated.get('seconds', float('nan')):.1f} s)")
    assert status == 200, text
    assert "data: " in text and ttft < HOLD_SECONDS
    assert activated.get("seconds", 99.0) < 10.0  # the operator polls the router every second
    obj = h.infd(cluster, namespace, NAME)
    assert h.condition(obj, "Ready")["status"] == "True"
