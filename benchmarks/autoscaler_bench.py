"""Autoscaler benchmark: our policy vs HPA-style and KPA-style on the same simulated traces,
and the simulator's own speed at 1,000 replicas.

    .venv/bin/python benchmarks/autoscaler_bench.py            # full run (~10 min, one core)
    .venv/bin/python benchmarks/autoscaler_bench.py --quick    # smaller fleet, one seed
    .venv/bin/python benchmarks/autoscaler_bench.py --replica-model cpu-smollm2-135m
    .venv/bin/python benchmarks/autoscaler_bench.py --calibration my-gpu.json
    .venv/bin/python benchmarks/autoscaler_bench.py --traces agentic --routing random

The goal is stated for the default GPU-class replica (``h100-llama3-8b``: pods that take
minutes to start and hold hundreds of thousands of KV tokens); ``cpu-smollm2-135m`` is our
engine as measured on CPU (see docs/autoscaling.md, "Replica models"). ``--routing`` is
the simulated router (default ``kv_aware``, the one the operator deploys; ``p2c_kv`` is the
simulator's routing before prefix caches were modelled per replica).

Goal: on the burst and ramp traces with a 120 s start-up, our starvation seconds at
most 0.5x the HPA-style policy's, at no more than 1.1x its replica-hours. Every policy sees
the same requests (same trace seed); results are summed over the seeds. Results are in
benchmarks/README-autoscaler.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict

from kvpilot.autoscaler.sim import (
    ReplicaModel,
    Scenario,
    compare,
    make_policy,
    make_trace,
    simulate,
)
from kvpilot.autoscaler.sim.calibration import DEFAULT_PRESET, PRESETS, load_calibration
from kvpilot.autoscaler.sim.model import DEFAULT_ROUTING, ROUTINGS
from kvpilot.autoscaler.sim.report import comparison_table

GOAL_STARVATION = 0.5
GOAL_REPLICA_HOURS = 1.1


def machine() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores visible, one used | Python {platform.python_version()}"
        f" ({platform.python_implementation()}) on {platform.system()} {platform.release()}"
        f" | kvpilot {commit}"
    )


def policy_comparison(args: argparse.Namespace, model: ReplicaModel) -> dict:
    print(
        f"\n== Policies: peak {args.peak:g} replicas, start-up {model.startup_seconds:g} s,"
        f" {args.duration:g} s per trace, seeds {args.seeds}, routing {args.routing}\n"
    )
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0, 0.0,
                                                                      0.0, 0.0])
    per_seed = []
    for seed in args.seeds:
        scenario = Scenario(peak_replicas=args.peak, duration_seconds=args.duration, seed=seed)
        results = compare(args.traces, ["kvpilot", "hpa", "kpa"], scenario, model,
                          routings=[args.routing])
        print(f"seed {seed}")
        print(comparison_table(results))
        print()
        for r in results:
            t = totals[(r.trace, r.policy)]
            t[0] += r.starvation_seconds
            t[1] += r.replica_hours
            t[2] += r.preemptions
            t[3] = max(t[3], r.p99_queue_seconds)
            t[4] += r.hit_tokens
            t[5] += r.prompt_tokens
            t[6] = max(t[6], r.max_replica_share)
        per_seed.append([r.to_dict() for r in results])
    print("Summed over seeds (ratios against hpa):")
    print(
        f"{'trace':8} {'policy':8} {'starvation s':>14} {'x hpa':>7} {'replica-h':>10}"
        f" {'x hpa':>7} {'worst p99 wait s':>17} {'hit %':>6} {'max share':>9}"
    )
    verdicts = {}
    for trace in args.traces:
        base = totals[(trace, "hpa")]
        for policy in ("kvpilot", "hpa", "kpa"):
            s, rh, _, p99, hits, prompts, share = totals[(trace, policy)]
            sr = s / base[0] if base[0] else float("inf")
            rr = rh / base[1]
            hit = 100 * hits / prompts if prompts else 0.0
            print(
                f"{trace:8} {policy:8} {s:>14,.0f} {sr:>7.3f} {rh:>10.2f} {rr:>7.3f} {p99:>17.1f}"
                f" {hit:>6.1f} {share:>9.3f}"
            )
            if policy == "kvpilot":
                verdicts[trace] = {
                    "starvation_ratio": sr,
                    "replica_hours_ratio": rr,
                    "met": sr <= GOAL_STARVATION and rr <= GOAL_REPLICA_HOURS,
                }
    print()
    for trace, v in verdicts.items():
        goal = trace in ("burst", "ramp")
        word = ("MET" if v["met"] else "MISSED") if goal else "(no goal)"
        print(
            f"goal on {trace}: starvation {v['starvation_ratio']:.3f}x (<= {GOAL_STARVATION}),"
            f" replica-hours {v['replica_hours_ratio']:.3f}x (<= {GOAL_REPLICA_HOURS}): {word}"
        )
    return {
        "totals": {f"{t}/{p}": v for (t, p), v in totals.items()},
        "verdicts": verdicts,
        "per_seed": per_seed,
    }


def speed(args: argparse.Namespace, model: ReplicaModel) -> dict:
    print(
        f"\n== Simulator speed: a {args.speed_peak:g}-replica peak, burst trace,"
        f" {args.speed_duration:g} s, one core\n"
    )
    scenario = Scenario(
        peak_replicas=args.speed_peak,
        duration_seconds=args.speed_duration,
        warmup_seconds=60.0,
        seed=1,
    )
    trace = make_trace("burst", scenario.peak_replicas, scenario.duration_seconds, 1, model)
    out = {}
    for policy in args.speed_policies:
        start = time.perf_counter()
        r = simulate(
            trace, make_policy(policy, scenario.spec(trace, model)), model,
            scenario.config(trace, args.routing),
        )
        wall = time.perf_counter() - start
        arrived = sum(1 for _ in trace.requests())
        print(
            f"{policy:8} {arrived:>10,} requests  peak {r.peak_replicas:>5,} replicas"
            f"  {r.events:>11,} events  {wall:7.1f} s  ({r.events / wall:,.0f} events/s,"
            f" {arrived / wall:,.0f} requests/s)"
        )
        out[policy] = {
            "requests": arrived,
            "peak_replicas": r.peak_replicas,
            "events": r.events,
            "wall_seconds": wall,
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="peak 8, one seed, small speed run")
    parser.add_argument("--peak", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--traces", nargs="+", default=["burst", "ramp", "agentic"])
    parser.add_argument("--speed-peak", type=float, default=1000.0)
    parser.add_argument("--speed-duration", type=float, default=330.0)
    parser.add_argument("--speed-policies", nargs="+", default=["kvpilot", "hpa"])
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--routing", default=DEFAULT_ROUTING, choices=list(ROUTINGS),
                        help=f"the simulated router (default {DEFAULT_ROUTING})")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--replica-model", default=DEFAULT_PRESET, choices=list(PRESETS),
                        help=f"replica model preset (default {DEFAULT_PRESET})")
    parser.add_argument("--calibration", metavar="FILE",
                        help="JSON object of ReplicaModel fields overriding the preset")
    args = parser.parse_args()
    if args.quick:
        args.peak, args.seeds, args.speed_peak, args.speed_duration = 8.0, [1], 100.0, 300.0
    model = PRESETS[args.replica_model]
    if args.calibration:
        model = load_calibration(args.calibration, model)
    print(machine())
    print(f"replica model: {model}")
    print(f"routing: {args.routing}")
    report = {"machine": machine(), "policies": policy_comparison(args, model)}
    if not args.skip_speed:
        report["speed"] = speed(args, model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
