"""``kvpilot simulate``: run the fleet simulator on a trace and compare scaling policies.

    kvpilot simulate                          # all traces, all five policies, 8-replica peak
    kvpilot simulate --trace burst --replicas 50 --json out.json --plot out.png
    kvpilot simulate --replica-model cpu-smollm2-135m   # our engine as measured on CPU
    kvpilot simulate --calibration my-gpu.json          # ReplicaModel fields from a file
    kvpilot simulate --trace agentic --routing kv_aware,session_affine,random
    kvpilot simulate --trace steady_high_concurrency --replica-model h200-llama3-8b \
        --slo-profile preset --replicas 4 --duration 3600 --seed 1 --max-factor 2.5 \
        --policies kvpilot,hpa,kpa_concurrency,saturation --json out.json

The replica model is a preset (``--replica-model``, default the GPU-class
``h100-llama3-8b``), then a ``--calibration`` file, then any single-parameter flag, each
overriding the one before.

Each trace is generated once per seed and replayed for every routing and policy, so the
rows of the table differ only by those. ``--routing`` says where requests land (default
``kv_aware``, the router the operator deploys); with several, every policy runs behind
each, and the table's ``hit %`` (the fleet's prefix hit rate) and ``max share`` (the
busiest replica's share of the requests) compare them. See docs/autoscaling.md for how to
read it.

SLO: a request meets it when its TTFT is at most ``--slo-ttft`` and its mean inter-token
latency at most ``--slo-itl`` (seconds; defaults by the preset's hardware profile: GPU 1 s
and 0.05 s, CPU 10 s and 0.5 s). Those targets only score requests unless
``--slo-profile`` is given: then our policy (``kvpilot``) is also given them as
``spec.autoscaling.slo``, its latency model starting from that profile's prior (``preset``:
the preset's profile), as a user who states an SLO would; the baselines never read it.
A run that judged no request, or rejected every one, is warned about on stderr: its SLO
and latency columns mean nothing. ``--json`` writes per policy ``slo_attainment``,
``starvation_seconds`` and ``replica_hours`` (under ``summary``), every result in full,
and the calibration used (preset, file, profile, the replica model's fields).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import fields, replace

from kvpilot.autoscaler.sim import ReplicaModel, Scenario, compare
from kvpilot.autoscaler.sim.calibration import (
    DEFAULT_PRESET,
    PRESETS,
    PROFILES,
    load_calibration,
    preset,
)
from kvpilot.autoscaler.sim.controllers import POLICIES
from kvpilot.autoscaler.sim.model import DEFAULT_ROUTING, ROUTINGS, SLO_PROFILES
from kvpilot.autoscaler.sim.report import SimResult, comparison_table
from kvpilot.autoscaler.sim.traces import TRACES
from kvpilot.autoscaler.spec import LATENCY_PROFILES, MAX_SLO_SECONDS, STARVATION_USAGE

_MODEL = ReplicaModel()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags. Those of the scenario store under its field names (``dest``), so
    :func:`scenario_from_args` needs no mapping; their defaults are :class:`Scenario`'s."""
    d = Scenario()
    parser.add_argument(
        "--trace", default="all", choices=[*TRACES, "all"], help="which trace (default: all)"
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, from {', '.join(POLICIES)} (default: all)",
    )
    parser.add_argument(
        "--routing",
        default=DEFAULT_ROUTING,
        help=f"where requests land, comma-separated, from {', '.join(ROUTINGS)}, or all"
        f" (default {DEFAULT_ROUTING}: the deployed router)",
    )
    parser.add_argument(
        "--replicas",
        dest="peak_replicas",
        metavar="REPLICAS",
        type=float,
        default=d.peak_replicas,
        help=f"replicas the trace's peak needs at the target KV usage, in (0, 100000]"
        f" (default {d.peak_replicas:g})",
    )
    parser.add_argument(
        "--max-factor",
        type=float,
        default=d.max_factor,
        help=f"maxReplicas = ceil(factor x --replicas) + 1, factor in [1, 100] (default"
        f" {d.max_factor:g})",
    )
    parser.add_argument(
        "--duration",
        dest="duration_seconds",
        metavar="DURATION",
        type=float,
        default=d.duration_seconds,
        help=f"seconds simulated, in (0, {MAX_DURATION_SECONDS:,.0f}] (default"
        f" {d.duration_seconds:g})",
    )
    parser.add_argument(
        "--warmup",
        dest="warmup_seconds",
        metavar="WARMUP",
        type=float,
        default=d.warmup_seconds,
        help=f"seconds not counted while the fleet fills, in [0, --duration) (default"
        f" {d.warmup_seconds:g})",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="trace and routing seed")
    parser.add_argument(
        "--slo-seconds",
        dest="slo_wait_seconds",
        metavar="SLO_SECONDS",
        type=float,
        default=d.slo_wait_seconds,
        help=f"seconds of queueing a request tolerates before it counts as starving, > 0"
        f" (default {d.slo_wait_seconds:g})",
    )
    parser.add_argument(
        "--slo-ttft",
        dest="slo_ttft_seconds",
        metavar="SECONDS",
        type=float,
        help="scoring: a request meets the SLO only with a TTFT at most this, in (0, 86400]"
        " (default by the preset's profile: GPU 1, CPU 10); with --slo-profile also our"
        " policy's TTFT target",
    )
    parser.add_argument(
        "--slo-itl",
        dest="slo_itl_seconds",
        metavar="SECONDS",
        type=float,
        help="scoring: a request meets the SLO only with a mean inter-token latency at most"
        " this, in (0, 86400] (default by the preset's profile: GPU 0.05, CPU 0.5); with"
        " --slo-profile also our policy's ITL target",
    )
    parser.add_argument(
        "--slo-profile",
        choices=[*LATENCY_PROFILES, "preset"],
        help="give our policy (kvpilot) spec.autoscaling.slo with the --slo-ttft and --slo-itl"
        " targets, its latency model starting from this profile's prior (preset: the"
        " --replica-model preset's profile); default: no SLO for our policy, the targets"
        " only score requests. The baselines never read it",
    )
    parser.add_argument(
        "--target-cache-usage",
        type=float,
        default=d.target_cache_usage,
        help=f"mean KV usage HPA and our policy aim at, in (0, {STARVATION_USAGE:g})"
        f" (default {d.target_cache_usage:g})",
    )
    parser.add_argument(
        "--target-queue-depth",
        type=float,
        default=d.target_queue_depth,
        help=f"requests waiting per replica KPA and our policy aim at, > 0"
        f" (default {d.target_queue_depth:g})",
    )
    parser.add_argument(
        "--replica-model",
        default=DEFAULT_PRESET,
        choices=list(PRESETS),
        help=f"replica model preset (default {DEFAULT_PRESET}; see docs/autoscaling.md)",
    )
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="JSON object of ReplicaModel fields overriding the preset",
    )
    parser.add_argument(
        "--startup-seconds",
        type=float,
        help=f"pod start-up delay (preset default {_MODEL.startup_seconds:g})",
    )
    parser.add_argument("--kv-capacity-tokens", type=int, help="KV tokens per replica")
    parser.add_argument("--prefill-tokens-per-second", type=float)
    parser.add_argument("--decode-step-base-ms", type=float)
    parser.add_argument("--decode-step-per-seq-ms", type=float)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    parser.add_argument("--json", metavar="PATH", help="write results (with timelines) as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write a timeline plot (needs matplotlib)")


# The longest run ``--duration`` accepts: 30 days, in seconds. A longer one would run for
# hours and hold every request's record in memory; nothing the simulator models changes
# over a month.
MAX_DURATION_SECONDS = 30 * 86400.0


def _check_scenario_flags(args: argparse.Namespace) -> None:
    """Refuse a bad scenario flag before any :class:`Scenario` is built, naming the flag
    as typed (the dataclasses' own errors name their fields: ``peak_replicas``,
    ``targetCacheUsage``, ...). A flag absent from ``args`` is not checked. Raises
    ValueError: ``"<flag> must be finite and <allowed>; got <value>"``."""
    duration = getattr(args, "duration_seconds", None)
    checks: list[tuple[str, str, Callable[[float], bool], str]] = [
        ("--replicas", "peak_replicas", lambda v: 0 < v <= 100_000, "in (0, 100000]"),
        ("--max-factor", "max_factor", lambda v: 1 <= v <= 100, "in [1, 100]"),
        ("--duration", "duration_seconds", lambda v: 0 < v <= MAX_DURATION_SECONDS,
         f"in (0, {MAX_DURATION_SECONDS:.0f}] seconds (30 days)"),
        ("--slo-seconds", "slo_wait_seconds", lambda v: v > 0, "> 0 seconds"),
        ("--slo-ttft", "slo_ttft_seconds", lambda v: 0 < v <= MAX_SLO_SECONDS,
         f"in (0, {MAX_SLO_SECONDS:g}] seconds"),
        ("--slo-itl", "slo_itl_seconds", lambda v: 0 < v <= MAX_SLO_SECONDS,
         f"in (0, {MAX_SLO_SECONDS:g}] seconds"),
        ("--target-cache-usage", "target_cache_usage", lambda v: 0 < v < STARVATION_USAGE,
         f"in (0, {STARVATION_USAGE:g}) (below the starvation alarm's usage)"),
        ("--target-queue-depth", "target_queue_depth", lambda v: v > 0, "> 0"),
    ]
    if duration is not None and math.isfinite(duration):
        end: float = duration
        checks.append(("--warmup", "warmup_seconds", lambda v: 0 <= v < end,
                       f"in [0, --duration {end:g}) seconds"))
    for flag, name, ok, allowed in checks:
        value = getattr(args, name, None)
        # NaN fails every comparison, so it is refused too; inf by the finite test.
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise ValueError(f"{flag} must be finite and {allowed}; got {value!r}")


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The :class:`Scenario` of the parsed flags. The SLO targets (seconds) default to the
    replica model preset's profile; ``--slo-profile preset`` is that profile too. Raises
    ValueError on a bad value, naming the flag."""
    _check_scenario_flags(args)
    preset_profile = PROFILES.get(getattr(args, "replica_model", DEFAULT_PRESET), "gpu")
    ttft, itl = SLO_PROFILES[preset_profile]
    values = {f.name: getattr(args, f.name, None) for f in fields(Scenario)}
    values["slo_ttft_seconds"] = ttft if values["slo_ttft_seconds"] is None else values["slo_ttft_seconds"]
    values["slo_itl_seconds"] = itl if values["slo_itl_seconds"] is None else values["slo_itl_seconds"]
    if values["slo_profile"] == "preset":
        values["slo_profile"] = preset_profile
    return Scenario(**{k: v for k, v in values.items() if v is not None})


def _check_output(flag: str, path: str | None) -> None:
    """Refuse ``--json``/``--plot`` before the run when the file could not be written
    (its directory missing or not writable, or the path a directory): the run may take
    minutes. Raises ValueError naming the flag and the path."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} must name a file, not a directory; got {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} must be a path in an existing directory; got {path!r}"
                         f" (no directory {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} must be a path in a writable directory; got {path!r}"
                         f" ({parent} is not writable)")


def _degenerate(results: list[SimResult]) -> list[str]:
    """Warnings for runs whose SLO and latency columns mean nothing: no request judged
    (``slo_judged`` 0: SLO shows 100%, TTFT and ITL 0), or every request rejected (no
    prompt fit a replica's KV: SLO 0%, TTFT and ITL 0). One per trace and routing, naming
    the policies when not all of them."""
    warnings = []
    runs: dict[tuple[str, str], list[SimResult]] = {}
    for r in results:
        runs.setdefault((r.trace, r.routing), []).append(r)
    for (trace, routing), rows in runs.items():
        for bad, what in (
            ([r for r in rows if r.slo_judged == 0],
             "no request was judged after the warm-up (SLO 100% and TTFT/ITL 0 mean"
             " nothing): raise --replicas or --duration, or lower --warmup"),
            ([r for r in rows if r.requests > 0 and r.rejected == r.requests],
             "every request was rejected, none fitting a replica's KV cache (SLO 0%, and"
             " TTFT/ITL 0 are not measurements): raise --kv-capacity-tokens"),
        ):
            if bad:
                who = "" if len(bad) == len(rows) else " (" + ", ".join(r.policy for r in bad) + ")"
                warnings.append(f"kvpilot simulate: warning: {trace} {routing}{who}: {what}")
    return warnings


def _model(args: argparse.Namespace) -> ReplicaModel:
    """Preset, then calibration file, then single flags (raises ValueError on bad input)."""
    model = preset(args.replica_model)
    if args.calibration:
        model = load_calibration(args.calibration, model)
    flags = {
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "prefill_tokens_per_second": args.prefill_tokens_per_second,
        "decode_step_base_seconds": None if args.decode_step_base_ms is None
        else args.decode_step_base_ms / 1e3,
        "decode_step_per_seq_seconds": None if args.decode_step_per_seq_ms is None
        else args.decode_step_per_seq_ms / 1e3,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "startup_seconds": args.startup_seconds,
    }
    # Counts must be >= 1, rates and step costs > 0 (per-row cost and start-up >= 0).
    for flag, value, allow_zero in (
        ("--kv-capacity-tokens", args.kv_capacity_tokens, False),
        ("--prefill-tokens-per-second", args.prefill_tokens_per_second, False),
        ("--decode-step-base-ms", args.decode_step_base_ms, False),
        ("--decode-step-per-seq-ms", args.decode_step_per_seq_ms, True),
        ("--max-num-seqs", args.max_num_seqs, False),
        ("--max-num-batched-tokens", args.max_num_batched_tokens, False),
        ("--startup-seconds", args.startup_seconds, True),
    ):
        if value is not None and not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
            allowed = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{flag} must be finite and {allowed}; got {value!r}")
    return replace(model, **{k: v for k, v in flags.items() if v is not None})


def _progress(result: SimResult) -> None:
    print(
        f"  {result.trace:8} {result.routing:14} {result.policy:8} {result.requests:>9,}"
        f" requests  SLO {100 * result.slo_attainment:6.2f}%"
        f"  {result.events:>10,} events in {result.wall_seconds:6.1f} s",
        file=sys.stderr,
    )


def _routings(value: str) -> list[str]:
    """``--routing``: names from ROUTINGS, comma-separated, or ``all``."""
    if value.strip() == "all":
        return list(ROUTINGS)
    names = [r.strip() for r in value.split(",") if r.strip()]
    if not names:
        raise ValueError(f"--routing must name at least one of {', '.join(ROUTINGS)}")
    for name in names:
        if name not in ROUTINGS:
            raise ValueError(f"--routing must name {', '.join(ROUTINGS)} or all; got {name!r}")
    return names


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    traces = list(TRACES) if args.trace == "all" else [args.trace]
    try:
        if not policies:
            raise ValueError(f"--policies must name at least one of {', '.join(POLICIES)}")
        for p in policies:
            if p not in POLICIES:
                raise ValueError(f"--policies must name {', '.join(POLICIES)}; got {p!r}")
        routings = _routings(args.routing)
        _check_output("--json", args.json)
        _check_output("--plot", args.plot)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'kvpilot[dev]'")
        model = _model(args)
        scenario = scenario_from_args(args)
        results = compare(traces, policies, scenario, model, progress=_progress,
                          routings=routings)
    except ValueError as exc:
        print(f"kvpilot simulate: error: {exc}", file=sys.stderr)
        return 2
    print(comparison_table(results, baseline="hpa" if "hpa" in policies else policies[0]))
    for r in results:
        if r.rules:
            moves = ", ".join(f"{k} {v}" for k, v in sorted(r.rules.items()))
            print(f"{r.trace} {r.routing} {r.policy} decisions that moved the count: {moves}")
    for warning in _degenerate(results):
        print(warning, file=sys.stderr)
    if args.json:
        payload = {
            "scenario": vars(scenario),
            "routings": routings,
            "model": vars(model),
            "calibration": {
                "preset": args.replica_model,
                "file": args.calibration,
                "profile": PROFILES.get(args.replica_model, "gpu"),
                "replica_model": vars(model),
            },
            "summary": [
                {"trace": r.trace, "routing": r.routing, "policy": r.policy,
                 "slo_attainment": r.slo_attainment, "starvation_seconds": r.starvation_seconds,
                 "replica_hours": r.replica_hours}
                for r in results
            ],
            "results": [r.to_dict(timeline=True) for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        from kvpilot.simulation.plot import plot_timelines

        plot_timelines(results, args.plot)
        print(f"wrote {args.plot}")
    return 0
