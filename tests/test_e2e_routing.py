"""The routing scenario (e2e/tests/test_30_routing.py) fails on a failed request, without a
cluster: its bench runs go to the bench's fake server (which fails a chosen request with
HTTP 500), and the cluster reads (Service address, pod counters) are stand-ins. The
scenario's helper that judges a bench result is checked on results fed to it directly."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from e2e import procs
from e2e.tests import helpers as h
from e2e.tests import test_30_routing as routing

from tests.bench.fake_server import Behaviour, FakeServer

pytestmark = pytest.mark.server

# What the scenario's hit-rate and spread assertions pass on: a ceiling of 0.8, a fleet
# at 0.78 with 40 requests spread 14/13/13.
SINGLE = {"single-0": {"hits": 80.0, "queries": 100.0, "requests": 40.0}}
FLEET = {f"fleet-{i}": {"hits": 26.0, "queries": 100 / 3, "requests": n}
         for i, n in enumerate((14.0, 13.0, 13.0))}


def result(completed: int, failed: int = 0, not_sent: int = 0) -> dict:
    summary = {"requests_completed": completed, "requests_failed": failed,
               "requests_cancelled": 0, "requests_not_sent": not_sent,
               "request_throughput": 2.0, "ttft_ms": {"mean": 12.0}}
    errors = [{"error": "HTTP 400: prompt too long", "count": failed}] if failed else []
    return {"summary": summary, "by_class": {"main": summary}, "errors": errors,
            "duration_s": 20.0}


def test_a_clean_run_passes():
    run = h.BenchRun(0, "", result(40))
    assert run.problem() is None and run.checked()["summary"]["requests_completed"] == 40
    assert run.figures() == {"exit_status": 0, "requests_completed": 40, "requests_failed": 0,
                             "requests_not_sent": 0, "first_error": None, "duration_s": 20.0,
                             "request_throughput": 2.0, "ttft_ms_mean": 12.0}


@pytest.mark.parametrize(("run", "message"), [
    # exit 0 as an older bench gave with failures: the result's counts still fail it
    (h.BenchRun(0, "", result(39, failed=1)),
     "1 of 40 requests failed (2.5%); first error: HTTP 400: prompt too long"),
    (h.BenchRun(1, "kvpilot bench serve: error: ...", result(39, failed=1)),
     "kvpilot bench serve exited 1: kvpilot bench serve: error: ..."),
    (h.BenchRun(0, "", result(36, failed=1, not_sent=3)), "and 3 were not sent"),
    (h.BenchRun(1, "error: cannot list models", None),
     "wrote no result (exit 1): error: cannot list models"),
    (h.BenchRun(1, "", result(40)), "exited 1"),
])
def test_a_failed_request_or_run_fails_the_check(run, message):
    assert message in run.problem()
    with pytest.raises(AssertionError, match=re.escape(message)):
        run.checked()


def test_a_result_without_the_counts_fails_instead_of_passing():
    """The old check read ``result.get("failed")``, a key the result never has."""
    for shape in ({"failed": 0, "num_failed": 0}, {"summary": {"requests_completed": 40}}):
        with pytest.raises(KeyError):
            h.BenchRun(0, "", shape).checked()


@pytest.fixture
def stand_in_cluster(monkeypatch, tmp_path):
    """The scenario's cluster reads answered locally; the bench goes to ``server``."""
    state = SimpleNamespace(server=None)
    monkeypatch.setattr(routing.h, "wait_service",
                        lambda cluster, ns, service: ("127.0.0.1", state.server.port))
    monkeypatch.setattr(routing, "fleet_counters",
                        lambda cluster, name: SINGLE if name == "single" else FLEET)
    cluster = SimpleNamespace(workdir=tmp_path / "workdir", state=state)
    cluster.workdir.mkdir()
    return cluster


def test_the_scenario_passes_when_no_request_fails(stand_in_cluster, tmp_path):
    with FakeServer() as server:
        stand_in_cluster.state.server = server
        routing.test_fleet_keeps_the_cache_and_spreads(stand_in_cluster, None, tmp_path)
    kept = json.loads((stand_in_cluster.workdir / routing.RESULTS).read_text())
    figures = kept["fleet_keeps_the_cache"]
    assert figures["ceiling_hit_rate"] == pytest.approx(0.8)
    assert figures["largest_share"] == pytest.approx(14 / 40)
    for run in figures["runs"].values():
        assert (run["exit_status"], run["requests_completed"], run["requests_failed"]) == (0, 40, 0)


def test_one_failed_request_fails_the_scenario_and_is_kept(stand_in_cluster, tmp_path):
    # 40 requests per run: request 50 is in the fleet's run, the only one that fails
    with FakeServer(Behaviour(fail_every=50)) as server:
        stand_in_cluster.state.server = server
        with pytest.raises(AssertionError, match="1 of 40 requests failed"):
            routing.test_fleet_keeps_the_cache_and_spreads(stand_in_cluster, None, tmp_path)
    runs = json.loads((stand_in_cluster.workdir / routing.RESULTS).read_text())[
        "fleet_keeps_the_cache"]["runs"]
    assert runs["single"]["requests_failed"] == 0
    assert runs["fleet"]["requests_failed"] == 1 and runs["fleet"]["exit_status"] == 1
    assert runs["fleet"]["first_error"] == "HTTP 500: injected failure 50"


def test_a_failed_request_while_the_new_pod_joins_fails_the_scenario(stand_in_cluster,
                                                                      monkeypatch, tmp_path):
    """The poll retries past an exception, so each run is kept and checked afterwards."""
    new_pod = {"metadata": {"name": "fleet-new"}, "status": {"podIP": "10.0.0.9"}}
    for name in ("apply", "wait_ready"):
        monkeypatch.setattr(routing.h, name, lambda *a, **k: None)
    monkeypatch.setattr(routing.h, "ready_pods", lambda cluster, ns, name: [
        *({"metadata": {"name": pod}} for pod in FLEET), new_pod])
    served = iter([{}, {"kvpilot:request_success_total": 3.0}])  # served on the second run
    monkeypatch.setattr(routing.h, "scrape", lambda ip: next(served))
    stand_in_cluster.wait_for = lambda predicate, timeout, what, interval: procs.wait_until(
        predicate, 30, what, interval=0.01)
    with FakeServer(Behaviour(fail_every=39)) as server:  # the first run's 39th request
        stand_in_cluster.state.server = server
        with pytest.raises(AssertionError, match="1 of 40 requests failed"):
            routing.test_new_pod_takes_traffic_when_ready(stand_in_cluster, None, tmp_path)
    kept = json.loads((stand_in_cluster.workdir / routing.RESULTS).read_text())
    runs = kept["new_pod_takes_traffic"]["runs"]
    assert len(runs) == 2 and runs[0]["requests_failed"] == 1
