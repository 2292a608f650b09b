"""Fleet prefix-cache hit rate by front: one replica alone against three replicas behind
vllm-router with each policy, on the same multi-turn agentic workload, in one run.

    .venv/bin/python benchmarks/fleet_routing.py                 # all fronts
    .venv/bin/python benchmarks/fleet_routing.py --fronts single kv_aware

Each front starts fresh engines (`kvpilot serve` on the embedded SmolLM2, a 4,096-token
KV cache each, KV events on), puts the front in front of them, runs
`kvpilot bench serve --dataset multi-turn` (``--sessions`` sessions x ``--turns`` turns
sharing one ``--system-prompt-len``-token system prompt, all sessions at once), then reads
every engine's ``/metrics``:

- fleet prefix hit rate = sum of ``kvpilot:prefix_cache_hits_total`` over sum of
  ``kvpilot:prefix_cache_queries_total`` across the engines;
- requests per replica from ``kvpilot:request_success_total``;
- failed and unsent requests from the bench result (``summary.requests_failed`` and
  ``requests_not_sent`` of every class, ``kvpilot.bench.count_failures``).

Fronts: ``single`` (one replica, no router: the ceiling), ``round_robin``,
``cache_aware`` (text prefix tree, default thresholds) and ``kv_aware`` (the engines' KV
events plus load), all vllm-router 0.1.17. The goal (docs/operator.md, "Routing"):
``kv_aware`` keeps at least 90% of the single-replica hit rate with no replica taking more
than half of the requests. Everything binds 127.0.0.1 on free ports and is stopped at the
end. A front whose load had a failed or unsent request is still measured and written, with
its counts; the script then exits 1 (its hit rates are not comparable). Cost: 20-26 s of
load per front in the recorded run, plus each front's engine starts (three at once for a
routed front); on two cores busy with other work those starts can exceed their 300 s bound.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_result

from kvpilot.bench import count_failures

BIN = Path(sys.executable).parent
MODEL = "smollm2-135m-instruct"
FRONTS = ("single", "round_robin", "cache_aware", "kv_aware")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process with its log in a temporary file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, argv: list[str], name: str) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"fleet-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: {url} not ready after {timeout}s:\n{self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def start_engine(args) -> tuple[Proc, str]:
    port = free_port()
    # Port 0: bound on loopback, the port the OS picks reported by /kv_event_sources (where
    # the router looks). An explicit tcp://127.0.0.1:PORT would be connected to, as vLLM
    # connects to any endpoint that is not a wildcard.
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0",
              "topic": "kv-events"}
    argv = [str(BIN / "kvpilot"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--num-gpu-blocks-override", str(args.cache_tokens // 16), "--block-size", "16",
            "--served-model-name", MODEL, "--kv-events-config", json.dumps(events)]
    return Proc(argv, f"engine-{port}"), f"http://127.0.0.1:{port}"


def start_router(policy: str, workers: list[str]) -> tuple[Proc, str]:
    port, metrics = free_port(), free_port()
    argv = [str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--policy", policy, "--worker-urls", *workers,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            "--log-level", "warning"]
    return Proc(argv, f"router-{policy}"), f"http://127.0.0.1:{port}"


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def failure_counts(bench_result: dict) -> dict:
    """A front's failed and unsent requests, from ``kvpilot bench serve``'s result JSON
    (``KeyError`` if it lacks the counts: never read as "none failed")."""
    f = count_failures(bench_result)
    return {"failed": f.failed, "not_sent": f.not_sent, "first_error": f.first_error}


def run_load(front: str, base: str, args, result: Path) -> dict:
    """The multi-turn load through ``base``: its seconds and failure counts. The bench may
    report failed requests (``--max-failed-ratio 1``: the counts are recorded, ``main``
    fails the run); a bench that completed nothing or could not start raises."""
    bench = [str(BIN / "kvpilot"), "bench", "serve", "--base-url", base, "--model", MODEL,
             "--dataset", "multi-turn", "--num-sessions", str(args.sessions),
             "--num-turns", str(args.turns), "--system-prompt-len", str(args.system_prompt_len),
             "--num-system-prompts", "1", "--turn-input-len", str(args.turn_input_len),
             "--output-len", str(args.output_len), "--seed", str(args.seed),
             "--temperature", "0", "--max-failed-ratio", "1", "--result-json", str(result)]
    result.unlink(missing_ok=True)
    t0 = time.monotonic()
    done = subprocess.run(bench, capture_output=True, text=True, timeout=args.timeout)
    elapsed = time.monotonic() - t0
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"{front}: the load failed (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return {"seconds": round(elapsed, 1), **failure_counts(json.loads(result.read_text()))}


def run_front(front: str, args) -> dict:
    replicas = 1 if front == "single" else args.replicas
    procs: list[Proc] = []
    try:
        engines = [start_engine(args) for _ in range(replicas)]
        procs += [p for p, _ in engines]
        urls = [u for _, u in engines]
        for p, u in engines:
            p.wait_http(f"{u}/ready", 300)
        base = urls[0]
        if front != "single":
            router, base = start_router(front, urls)
            procs.append(router)
            router.wait_http(f"{base}/health", 60)
            time.sleep(2)  # the router's first health round and, for kv_aware, its subscriptions
        load = run_load(front, base, args, Path(tempfile.mkdtemp()) / "bench.json")
        hits = queries = 0.0
        per_replica = []
        for u in urls:
            text = httpx.get(f"{u}/metrics", timeout=10).text
            hits += metric_sum(text, "kvpilot:prefix_cache_hits_total")
            queries += metric_sum(text, "kvpilot:prefix_cache_queries_total")
            per_replica.append(int(metric_sum(text, "kvpilot:request_success_total")))
        return {"front": front, "replicas": replicas, "hit_rate": hits / queries if queries else 0.0,
                "requests_per_replica": per_replica, **load}
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fronts", nargs="+", choices=FRONTS, default=list(FRONTS))
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-prompt-len", type=int, default=128)
    ap.add_argument("--turn-input-len", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--cache-tokens", type=int, default=4096, help="KV cache per engine, tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per front's load")
    args = ap.parse_args()
    if "single" not in args.fronts:
        args.fronts.insert(0, "single")  # the ceiling every ratio is against
    rows = [run_front(f, args) for f in args.fronts]
    ceiling = rows[0]["hit_rate"]
    print(f"{'front':<12} {'hit rate':>8} {'x ceiling':>9}  requests per replica  seconds"
          "  failed/not sent")
    for r in rows:
        r["ratio_to_single"] = r["hit_rate"] / ceiling if ceiling else 0.0
        share = max(r["requests_per_replica"]) / max(1, sum(r["requests_per_replica"]))
        r["largest_share"] = share
        print(f"{r['front']:<12} {r['hit_rate']:>8.3f} {r['ratio_to_single']:>9.2f}  "
              f"{'/'.join(map(str, r['requests_per_replica'])):<20}  {r['seconds']:>7}"
              f"  {r['failed']}/{r['not_sent']}")
    path = write_result("fleet_routing", {"args": vars(args), "rows": rows})
    failing = failed_fronts(rows)
    if failing:
        sys.exit(f"fleet_routing: requests failed ({'; '.join(failing)}): the hit rates are "
                 f"not comparable (counts written to {path})")


def failed_fronts(rows: list[dict]) -> list[str]:
    """``"front: N failed, M not sent, first error: ..."`` for each row that lost requests."""
    return [f"{r['front']}: {r['failed']} failed, {r['not_sent']} not sent, first error: "
            f"{r['first_error']}" for r in rows if r["failed"] or r["not_sent"]]


if __name__ == "__main__":
    main()
