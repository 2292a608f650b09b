"""A fleet that keeps its cache: traffic enters through the router's Service, the router
(vllm-router, ``kv_aware``: the engines' KV events plus their load) sends each
conversation's next turn to the replica that holds its prefix and still spreads the
sessions, and a pod added to the fleet takes traffic as soon as it is Ready.

Measured in one run: the multi-turn agentic workload (8 sessions x 5 turns sharing a
128-token system prompt, all sessions at once) on one replica (the ceiling) and on three;
the fleet's prefix hit rate (sum of hits over sum of queries across the pods) must reach
90% of the ceiling with no replica taking more than half of the requests, and no request
of any bench run may fail. The figures (hit rates, the ceiling, requests per replica and
their shares, each run's failures and duration) are kept in ``routing.json`` in the run's
work directory, written before the assertions so a failing run's figures are kept too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from e2e.tests import helpers as h
from e2e.tests.conftest import delete_namespace

NS = "routing"
MODEL = "smollm2-135m-instruct"
RESULTS = "routing.json"  # in cluster.workdir, beside the logs
BENCH = [str(Path(sys.executable).parent / "kvpilot"), "bench", "serve", "--model", MODEL,
         "--dataset", "multi-turn", "--num-sessions", "8", "--num-turns", "5",
         "--system-prompt-len", "128", "--num-system-prompts", "1", "--turn-input-len", "48",
         "--output-len", "16", "--temperature", "0"]


def manifest(name: str, replicas: int) -> dict:
    doc = h.small_infd(name, autoscaling=None, replicas=replicas)
    spec = doc["spec"]
    spec["engine"]["maxModelLen"] = 2048
    spec["engine"]["extraArgs"] = list(h.CPU_ENGINE_ARGS)  # about 5,800 tokens of KV each
    return doc


def run_sessions(address: tuple[str, int], seed: int, tmp: Path, name: str) -> h.BenchRun:
    """The multi-turn load through ``address``; the caller checks it (``.checked()``)."""
    ip, port = address
    return h.bench_serve([*BENCH, "--base-url", f"http://{ip}:{port}", "--seed", str(seed)],
                         tmp / f"bench-{name}.json")


def fleet_counters(cluster, name: str) -> dict[str, dict[str, float]]:
    """Per engine pod: prefix-cache hits and queries (tokens) and finished requests."""
    out = {}
    for pod in h.ready_pods(cluster, NS, name):
        samples = h.scrape(pod["status"]["podIP"])
        out[pod["metadata"]["name"]] = {
            "hits": h.metric_sum(samples, "kvpilot:prefix_cache_hits_total"),
            "queries": h.metric_sum(samples, "kvpilot:prefix_cache_queries_total"),
            "requests": h.metric_sum(samples, "kvpilot:request_success_total"),
        }
    return out


def hit_rate(counters: dict[str, dict[str, float]]) -> float:
    queries = sum(c["queries"] for c in counters.values())
    return sum(c["hits"] for c in counters.values()) / queries if queries else 0.0


@pytest.fixture(scope="module")
def fleets(cluster):
    cluster.kubectl("create", "namespace", NS)
    for name, replicas in (("single", 1), ("fleet", 3)):
        h.apply(cluster, NS, manifest(name, replicas))
    for name, replicas in (("single", 1), ("fleet", 3)):
        h.wait_ready(cluster, NS, name, replicas=replicas, timeout=420)
        cluster.wait_for(lambda n=name: h.condition_is(cluster, NS, n, "RouterReady", "True"),
                         180, f"{name} RouterReady")
    yield
    delete_namespace(cluster, NS)


def test_router_objects_and_endpoint(cluster, fleets):
    obj = h.infd(cluster, NS, "fleet")
    dep = h.deployment(cluster, NS, "fleet-router")
    assert dep is not None, "no router Deployment"
    container = dep["spec"]["template"]["spec"]["containers"][0]
    argv = container.get("command", []) + container.get("args", [])
    assert argv[0] == "vllm-router" and argv[argv.index("--policy") + 1] == "kv_aware", argv
    svc = cluster.get_json("-n", NS, "service", "fleet-router")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    # The endpoint users are told to call is the router's Service, not the engines'.
    assert "fleet-router" in json.dumps(obj["status"]), obj["status"]


def test_fleet_keeps_the_cache_and_spreads(cluster, fleets, tmp_path):
    runs = {name: run_sessions(h.wait_service(cluster, NS, f"{name}-router"), seed=1,
                               tmp=tmp_path, name=name) for name in ("single", "fleet")}
    ceiling = hit_rate(fleet_counters(cluster, "single"))
    counters = fleet_counters(cluster, "fleet")
    rate = hit_rate(counters)
    requests = [c["requests"] for c in counters.values()]
    total = sum(requests)
    report = f"ceiling {ceiling:.3f}, fleet {rate:.3f}, requests per replica {requests}"
    print(report)
    h.keep_results(cluster, RESULTS, "fleet_keeps_the_cache", {
        "ceiling_hit_rate": ceiling, "fleet_hit_rate": rate,
        "ratio_to_ceiling": rate / ceiling if ceiling else None,
        "requests_per_replica": {pod: c["requests"] for pod, c in counters.items()},
        "request_shares": {pod: c["requests"] / total if total else None
                           for pod, c in counters.items()},
        "largest_share": max(requests) / total if total else None,
        "runs": {name: run.figures() for name, run in runs.items()},
    })
    for run in runs.values():
        run.checked()  # no request failed or went unsent, the bench exited 0
    assert ceiling > 0.5, report  # the workload is mostly prefix hits on one replica
    assert rate >= 0.9 * ceiling, report
    assert max(requests) <= 0.5 * total, report


def test_new_pod_takes_traffic_when_ready(cluster, fleets, tmp_path):
    before = fleet_counters(cluster, "fleet")
    doc = manifest("fleet", 4)
    h.apply(cluster, NS, doc)
    h.wait_ready(cluster, NS, "fleet", replicas=4, timeout=420)
    (new,) = [p for p in h.ready_pods(cluster, NS, "fleet") if p["metadata"]["name"] not in before]
    # The router discovers the pod through the API server once it is Ready.
    address = h.wait_service(cluster, NS, "fleet-router")
    runs: list[h.BenchRun] = []
    start = time.monotonic()

    def served() -> float | None:
        # fresh sessions: no cached prefix yet; every run is kept and checked below (the
        # poll would retry past a failed one)
        runs.append(run_sessions(address, seed=7, tmp=tmp_path, name=f"new-pod-{len(runs)}"))
        n = h.metric_sum(h.scrape(new["status"]["podIP"]), "kvpilot:request_success_total")
        return n or None

    try:
        served_requests = cluster.wait_for(served, 600, "the new pod serving requests",
                                           interval=1)
    finally:
        h.keep_results(cluster, RESULTS, "new_pod_takes_traffic", {
            "seconds_until_served": round(time.monotonic() - start, 1),
            "new_pod": new["metadata"]["name"],
            "runs": [run.figures() for run in runs],
        })
    assert served_requests
    for run in runs:
        run.checked()


@pytest.mark.parametrize(("verb", "resource", "namespace", "allowed"), [
    ("list", "pods", NS, "yes"),
    ("watch", "pods", NS, "yes"),
    ("list", "pods", "default", "no"),
    ("get", "secrets", NS, "no"),
    ("create", "pods", NS, "no"),
    ("list", "services", NS, "no"),
])
def test_router_account_is_least_privilege(cluster, fleets, verb, resource, namespace, allowed):
    """The router's ServiceAccount may only find the engine pods of its own namespace."""
    r = cluster.kubectl("auth", "can-i", verb, resource, "-n", namespace,
                        f"--as=system:serviceaccount:{NS}:fleet-router", check=False)
    assert r.stdout.strip() == allowed, (verb, resource, namespace, r.stdout, r.stderr)
