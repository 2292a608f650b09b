"""benchmarks/fleet_routing.py records each front's real failure counts (from the bench
result's ``requests_failed`` and ``requests_not_sent``, not a key the result lacks) and
exits non-zero when a front lost requests. The load runs against the bench's fake server
(no engine, no router)."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from tests.bench.fake_server import Behaviour, FakeServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fleet_routing

ARGS = Namespace(sessions=2, turns=3, system_prompt_len=8, turn_input_len=4, output_len=2,
                 seed=0, timeout=60.0)


def bench_result(failed: int, not_sent: int = 0) -> dict:
    summary = {"requests_completed": 40 - failed - not_sent, "requests_failed": failed,
               "requests_cancelled": 0, "requests_not_sent": not_sent}
    return {"summary": summary, "by_class": {"main": summary},
            "errors": [{"error": "HTTP 500: boom", "count": failed}] if failed else []}


def test_failure_counts_come_from_the_result_summary():
    assert fleet_routing.failure_counts(bench_result(0)) == {
        "failed": 0, "not_sent": 0, "first_error": None}
    assert fleet_routing.failure_counts(bench_result(1, not_sent=4)) == {
        "failed": 1, "not_sent": 4, "first_error": "HTTP 500: boom"}


def test_a_result_without_the_counts_raises():
    """The script used to read ``failed``/``num_failed`` and record null for every row."""
    with pytest.raises(KeyError):
        fleet_routing.failure_counts({"failed": 0, "num_failed": 0})


@pytest.mark.server
def test_the_load_records_injected_failures(tmp_path):
    with FakeServer() as server:
        clean = fleet_routing.run_load("single", server.url, ARGS, tmp_path / "a.json")
        server.reset(Behaviour(fail_every=2))  # one turn of some session fails
        failing = fleet_routing.run_load("kv_aware", server.url, ARGS, tmp_path / "b.json")
        server.reset(Behaviour(fail_every=1))
        with pytest.raises(RuntimeError, match=r"kv_aware: the load failed \(exit 1\)"):
            fleet_routing.run_load("kv_aware", server.url, ARGS, tmp_path / "c.json")
    assert (clean["failed"], clean["not_sent"], clean["first_error"]) == (0, 0, None)
    assert failing["failed"] >= 1 and failing["failed"] + failing["not_sent"] <= 6
    assert failing["first_error"].startswith("HTTP 500: injected failure")


def test_the_script_writes_the_counts_and_fails(monkeypatch, tmp_path, capsys):
    rows = {"single": {"failed": 0, "not_sent": 0, "first_error": None},
            "kv_aware": {"failed": 1, "not_sent": 3, "first_error": "HTTP 500: boom"}}

    def run_front(front, args):
        return {"front": front, "replicas": 1, "hit_rate": 0.8, "requests_per_replica": [40],
                "seconds": 1.0, **rows[front]}

    written = {}

    def write_result(name, payload):
        written[name] = json.loads(json.dumps(payload))
        return tmp_path / f"{name}.json"

    monkeypatch.setattr(fleet_routing, "run_front", run_front)
    monkeypatch.setattr(fleet_routing, "write_result", write_result)
    monkeypatch.setattr(sys, "argv", ["fleet_routing.py", "--fronts", "single", "kv_aware"])
    with pytest.raises(SystemExit, match="kv_aware: 1 failed, 3 not sent, first error: HTTP 500"):
        fleet_routing.main()
    assert [(r["front"], r["failed"], r["not_sent"]) for r in written["fleet_routing"]["rows"]] \
        == [("single", 0, 0), ("kv_aware", 1, 3)]
    assert "1/3" in capsys.readouterr().out

    rows["kv_aware"] = rows["single"]
    fleet_routing.main()  # no failure: exits normally
