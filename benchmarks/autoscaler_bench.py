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

``--slo`` instead runs every trace (``TRACES``, the two compute-bound ones
included) under our policy and the baselines (HPA on KV, KPA on concurrency, llm-d WVA's
saturation analyzer; ``--slo-policies``), with the replica model ``--replica-model``
(default here ``h200-llama3-8b``) and the SLO targets of its profile, and writes
``benchmarks/results/autoscaler_slo.json``: per trace and policy the SLO attainment,
starvation and replica-hours summed over the seeds, and per trace the ratio of our
replica-hours to the cheapest baseline reaching ``--slo-goal`` (0.99) attainment::

    .venv/bin/python benchmarks/autoscaler_bench.py --slo --peak 4 --duration 1800 --seeds 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
from kvpilot.autoscaler.sim.traces import BURST_END, BURST_START

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


SLO_POLICIES = ["kvpilot", "hpa", "kpa_concurrency", "saturation"]


class Static:
    """A reference, not a policy: ``n`` replicas all along (is the SLO reachable, and at
    what cost, with the fleet never resized)."""

    interval_seconds = 15.0

    def __init__(self, n: int) -> None:
        self.n = n
        self.name = f"static-{n}"

    def decide(self, now: float, ready: object, pending: int) -> int:
        return self.n


class Onset:
    """A reference, not a policy: ``before`` replicas, then ``during`` ordered ``lead``
    seconds before the burst trace's step (lead 0: the instant it arrives, the best any
    policy without foreknowledge can do), kept until its end plus a scale-down window."""

    interval_seconds = 15.0

    def __init__(self, before: int, during: int, start: float, end: float) -> None:
        self.before, self.during, self.start, self.end = before, during, start, end
        self.name = f"onset-{during}"

    def decide(self, now: float, ready: object, pending: int) -> int:
        return self.during if self.start <= now < self.end else self.before


def slo_comparison(args: argparse.Namespace, model: ReplicaModel, profile: str) -> dict:
    """Every trace x policy under the SLO targets of ``profile``; see the module doc."""
    from kvpilot.autoscaler.sim.model import SLO_PROFILES
    from kvpilot.autoscaler.sim.traces import TRACES

    ttft, itl = SLO_PROFILES[profile]
    ttft = args.slo_ttft if args.slo_ttft is not None else ttft
    itl = args.slo_itl if args.slo_itl is not None else itl
    traces = args.traces if args.traces_given else list(TRACES)
    print(f"\n== SLO: TTFT <= {ttft:g} s and mean ITL <= {itl:g} s per request; peak"
          f" {args.peak:g}, {args.duration:g} s, seeds {args.seeds}, policies {args.slo_policies}\n")
    totals: dict[tuple[str, str], dict[str, float]] = {}
    wall = time.perf_counter()
    for seed in args.seeds:
        scenario = Scenario(peak_replicas=args.peak, duration_seconds=args.duration, seed=seed,
                            slo_ttft_seconds=ttft, slo_itl_seconds=itl, max_factor=args.max_factor,
                            slo_profile=profile)
        for r in compare(traces, args.slo_policies, scenario, model, routings=[args.routing]):
            print(f"  seed {seed} {r.trace:24} {r.policy:16} SLO {100 * r.slo_attainment:7.3f}%"
                  f"  replica-h {r.replica_hours:7.2f}  starvation {r.starvation_seconds:12,.0f} s"
                  f"  TTFT p90 {r.ttft_p90_seconds:7.2f} s  ITL p90 {1e3 * r.itl_p90_seconds:7.1f} ms"
                  f"  ({r.wall_seconds:.1f} s)", flush=True)
            t = totals.setdefault((r.trace, r.policy), {"met": 0.0, "judged": 0.0,
                                                       "replica_hours": 0.0, "starvation_seconds": 0.0,
                                                       "ttft_p90_worst": 0.0, "itl_p90_worst": 0.0,
                                                       "peak_replicas": 0.0})
            t["met"] += r.slo_attainment * r.slo_judged
            t["judged"] += r.slo_judged
            t["replica_hours"] += r.replica_hours
            t["starvation_seconds"] += r.starvation_seconds
            t["ttft_p90_worst"] = max(t["ttft_p90_worst"], r.ttft_p90_seconds)
            t["itl_p90_worst"] = max(t["itl_p90_worst"], r.itl_p90_seconds)
            t["peak_replicas"] = max(t["peak_replicas"], r.peak_replicas)
    # Reference: the smallest fleet that, never resized, reaches the goal (first seed).
    static: dict[str, dict[str, float] | None] = {}
    scenario = Scenario(peak_replicas=args.peak, duration_seconds=args.duration, seed=args.seeds[0],
                        slo_ttft_seconds=ttft, slo_itl_seconds=itl, max_factor=args.max_factor,
                            slo_profile=profile)
    for name in traces:
        trace = make_trace(name, args.peak, args.duration, args.seeds[0], model)
        low, high = scenario.bounds(trace)
        static[name] = None
        for n in range(max(1, math.ceil(args.peak)), high + 1):
            config = dataclasses.replace(scenario.config(trace, args.routing), initial_replicas=n,
                                         min_replicas=min(low, n))
            r = simulate(trace, Static(n), model, config)
            print(f"  static {name:24} {n:3d} replicas  SLO {100 * r.slo_attainment:7.3f}%"
                  f"  replica-h {r.replica_hours:7.2f}", flush=True)
            if r.slo_attainment >= args.slo_goal:
                static[name] = {"replicas": n, "slo_attainment": r.slo_attainment,
                                "replica_hours": r.replica_hours}
                break
    # Reference: on burst, the static fleet's peak count ordered the instant the step
    # arrives (lead 0), or one or two minutes ahead (foreknowledge), from minReplicas.
    onset: dict[str, dict[str, float]] = {}
    if "burst" in traces and static.get("burst"):
        during = int(static["burst"]["replicas"])
        for lead in (0, 60, 120):
            met = judged = hours = 0.0
            for seed in args.seeds:
                seeded = dataclasses.replace(scenario, seed=seed)
                trace = make_trace("burst", args.peak, args.duration, seed, model)
                low, _ = seeded.bounds(trace)
                policy = Onset(low, during, BURST_START * args.duration - lead,
                               BURST_END * args.duration + 300)
                r = simulate(trace, policy, model, seeded.config(trace, args.routing))
                met += r.slo_attainment * r.slo_judged
                judged += r.slo_judged
                hours += r.replica_hours
            onset[str(lead)] = {"replicas": during, "slo_attainment": met / judged if judged else 1.0,
                                "replica_hours": hours}
            print(f"  onset  burst {during} replicas ordered {lead:3d} s before the step:"
                  f" SLO {100 * met / judged:7.3f}%  replica-h {hours:7.2f} (all seeds)", flush=True)
    rows, verdicts = [], {}
    print(f"\n{'trace':24} {'policy':16} {'SLO %':>8} {'replica-h':>10} {'starvation s':>13}"
          f" {'TTFT p90':>9} {'ITL p90 ms':>10}")
    for trace in traces:
        best = None
        for policy in args.slo_policies:
            t = totals[(trace, policy)]
            t["slo_attainment"] = t["met"] / t["judged"] if t["judged"] else 1.0
            rows.append({"trace": trace, "policy": policy, **t})
            print(f"{trace:24} {policy:16} {100 * t['slo_attainment']:8.3f} {t['replica_hours']:10.2f}"
                  f" {t['starvation_seconds']:13,.0f} {t['ttft_p90_worst']:9.2f}"
                  f" {1e3 * t['itl_p90_worst']:10.1f}")
            if policy != "kvpilot" and t["slo_attainment"] >= args.slo_goal and (
                    best is None or t["replica_hours"] < totals[(trace, best)]["replica_hours"]):
                best = policy
        ours = totals.get((trace, "kvpilot"))
        ratio = (ours["replica_hours"] / totals[(trace, best)]["replica_hours"]
                 if ours and best else None)
        met = bool(ours and ours["slo_attainment"] >= args.slo_goal
                   and (ratio is None or ratio <= args.slo_ratio))
        verdicts[trace] = {"best_baseline": best, "replica_hours_ratio": ratio,
                           "static_reference": static[trace],
                           **({"onset_reference": onset} if trace == "burst" and onset else {}),
                           "kvpilot_slo_attainment": ours["slo_attainment"] if ours else None,
                           "met": met}
    print()
    for trace, v in verdicts.items():
        ratio = "-" if v["replica_hours_ratio"] is None else f"{v['replica_hours_ratio']:.3f}x"
        att = v["kvpilot_slo_attainment"]
        print(f"{trace:24} kvpilot SLO {100 * att:.3f}% (>= {100 * args.slo_goal:g}%),"
              f" replica-hours {ratio} of the best baseline reaching it ({v['best_baseline']}):"
              f" {'MET' if v['met'] else 'MISSED'}")
    return {"slo_ttft_seconds": ttft, "slo_itl_seconds": itl, "goal_attainment": args.slo_goal,
            "max_factor": args.max_factor,
            "goal_replica_hours_ratio": args.slo_ratio, "peak_replicas": args.peak,
            "duration_seconds": args.duration, "seeds": args.seeds, "routing": args.routing,
            "rows": rows, "verdicts": verdicts, "wall_seconds": time.perf_counter() - wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="peak 8, one seed, small speed run")
    parser.add_argument("--peak", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--traces", nargs="+", default=None,
                        help="default: burst ramp agentic (with --slo: every trace)")
    parser.add_argument("--slo", action="store_true",
                        help="the SLO comparison instead (see the module doc)")
    parser.add_argument("--slo-policies", nargs="+", default=SLO_POLICIES)
    parser.add_argument("--slo-goal", type=float, default=0.99)
    parser.add_argument("--max-factor", type=float, default=2.5,
                        help="with --slo: maxReplicas = ceil(factor x --peak) + 1 (room for a"
                        " latency target: a fleet sized on KV or at 75%% compute is too small)")
    parser.add_argument("--slo-ratio", type=float, default=1.1)
    parser.add_argument("--slo-ttft", type=float, help="seconds (default: the profile's)")
    parser.add_argument("--slo-itl", type=float, help="seconds (default: the profile's)")
    parser.add_argument("--speed-peak", type=float, default=1000.0)
    parser.add_argument("--speed-duration", type=float, default=330.0)
    parser.add_argument("--speed-policies", nargs="+", default=["kvpilot", "hpa"])
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--routing", default=DEFAULT_ROUTING, choices=list(ROUTINGS),
                        help=f"the simulated router (default {DEFAULT_ROUTING})")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--replica-model", default=None, choices=list(PRESETS),
                        help=f"replica model preset (default {DEFAULT_PRESET}; with --slo"
                        " h200-llama3-8b)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="JSON object of ReplicaModel fields overriding the preset")
    args = parser.parse_args()
    args.traces_given = args.traces is not None
    if args.traces is None:
        args.traces = ["burst", "ramp", "agentic"]
    if args.replica_model is None:
        args.replica_model = "h200-llama3-8b" if args.slo else DEFAULT_PRESET
    if args.quick:
        args.peak, args.seeds, args.speed_peak, args.speed_duration = 8.0, [1], 100.0, 300.0
    model = PRESETS[args.replica_model]
    if args.calibration:
        model = load_calibration(args.calibration, model)
    print(machine())
    print(f"replica model: {args.replica_model} {model}")
    print(f"routing: {args.routing}")
    if args.slo:
        from kvpilot.autoscaler.sim.calibration import PROFILES

        profile = PROFILES.get(args.replica_model, "gpu")
        report = {"machine": machine(),
                  "calibration": {"preset": args.replica_model, "file": args.calibration,
                                  "profile": profile, "replica_model": vars(model)},
                  "slo": slo_comparison(args, model, profile)}
        path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         "autoscaler_slo.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {path}")
        return 0
    report = {"machine": machine(), "policies": policy_comparison(args, model)}
    if not args.skip_speed:
        report["speed"] = speed(args, model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
