"""Node headroom: our policy with and without placeholder pods, when every engine pod
needs a GPU node and a node takes ``--node-startup`` seconds to arrive.

Both runs use our pod policy (``kvpilot``) on the same traces and seeds, in the fleet
simulator with a node pool (:mod:`kvpilot.autoscaler.sim.nodes`: one engine pod per node
by default, a cluster autoscaler that asks for a node per pending pod, empty nodes removed
after 10 minutes). ``pods-only`` is the operator without node headroom (engine pods wait
for their node); ``headroom`` adds the placeholder pods of
:func:`kvpilot.autoscaler.headroom.headroom`.

    .venv/bin/python benchmarks/node_headroom.py                     # peak 20, seeds 1-3
    .venv/bin/python benchmarks/node_headroom.py --quick             # peak 8, one seed

Goal (with a 300 s node start-up): starvation with headroom at most 0.5x the pods-only
policy's, at no more than 1.15x its GPU-node hours. Summed over seeds; results in
benchmarks/README-autoscaler.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from autoscaler_bench import machine

from kvpilot.autoscaler.sim import Scenario, make_trace, simulate
from kvpilot.autoscaler.sim.calibration import DEFAULT_PRESET, PRESETS
from kvpilot.autoscaler.sim.controllers import HeadroomPolicy, KvPilotPolicy
from kvpilot.autoscaler.sim.nodes import NodeModel

GOAL_STARVATION = 0.5
GOAL_NODE_HOURS = 1.15


def run(args: argparse.Namespace) -> dict:
    model = PRESETS[args.replica_model]
    nodes = NodeModel(args.node_startup, args.pods_per_node, args.node_scale_down)
    print(machine())
    print(f"replica model: {model}")
    print(f"nodes: {nodes}\n")
    totals: dict[tuple[str, str], list[float]] = {}
    per_seed = []
    for seed in args.seeds:
        scenario = Scenario(peak_replicas=args.peak, duration_seconds=args.duration, seed=seed)
        for name in args.traces:
            trace = make_trace(name, scenario.peak_replicas, scenario.duration_seconds, seed, model,
                               scenario.target_cache_usage)
            config = replace(scenario.config(trace), nodes=nodes)
            spec = scenario.spec(trace, model)
            for label, policy in (("pods-only", KvPilotPolicy(spec)),
                                  ("headroom", HeadroomPolicy(spec, nodes.startup_seconds))):
                r = simulate(trace, policy, model, config)
                t = totals.setdefault((name, label), [0.0, 0.0, 0.0, 0.0, 0.0])
                t[0] += r.starvation_seconds
                t[1] += r.node_hours
                t[2] += r.replica_hours
                t[3] += r.placeholder_hours
                t[4] = max(t[4], r.p99_queue_seconds)
                per_seed.append({"seed": seed, "trace": name, "policy": label, **r.to_dict()})
                print(f"seed {seed} {name:6} {label:9} starvation {r.starvation_seconds:>13,.0f} s  "
                      f"node-h {r.node_hours:7.2f}  replica-h {r.replica_hours:7.2f}  "
                      f"placeholder-h {r.placeholder_hours:6.2f}  p99 wait {r.p99_queue_seconds:7.1f} s  "
                      f"nodes asked {r.nodes_requested}", flush=True)
    print("\nSummed over seeds (ratios: headroom / pods-only):")
    verdicts = {}
    for name in args.traces:
        base, ours = totals[(name, "pods-only")], totals[(name, "headroom")]
        sr = ours[0] / base[0] if base[0] else float("inf")
        nr = ours[1] / base[1]
        verdicts[name] = {"starvation_ratio": sr, "node_hours_ratio": nr,
                          "met": sr <= GOAL_STARVATION and nr <= GOAL_NODE_HOURS}
        for label, t in (("pods-only", base), ("headroom", ours)):
            print(f"{name:6} {label:9} starvation {t[0]:>14,.0f} s  node-h {t[1]:8.2f}  replica-h {t[2]:8.2f}"
                  f"  placeholder-h {t[3]:7.2f}  worst p99 wait {t[4]:7.1f} s")
        word = "MET" if verdicts[name]["met"] else "MISSED"
        print(f"goal on {name}: starvation {sr:.3f}x (<= {GOAL_STARVATION}), node-hours {nr:.3f}x "
              f"(<= {GOAL_NODE_HOURS}): {word}\n")
    return {"machine": machine(), "nodes": nodes.__dict__, "totals": {f"{t}/{p}": v for (t, p), v in totals.items()},
            "verdicts": verdicts, "per_seed": per_seed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="peak 8, one seed")
    parser.add_argument("--peak", type=float, default=20.0)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--traces", nargs="+", default=["burst", "ramp"])
    parser.add_argument("--node-startup", type=float, default=300.0, help="seconds for a new node")
    parser.add_argument("--pods-per-node", type=int, default=1)
    parser.add_argument("--node-scale-down", type=float, default=600.0,
                        help="seconds an empty node is kept (cluster autoscaler's scale-down-unneeded-time)")
    parser.add_argument("--replica-model", default=DEFAULT_PRESET, choices=list(PRESETS))
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    if args.quick:
        args.peak, args.seeds = 8.0, [1]
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
