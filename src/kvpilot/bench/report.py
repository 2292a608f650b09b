"""The human-readable report of a run: one column per request class.

Example (one class)::

    ============== kvpilot bench serve ==============
    base url                   http://127.0.0.1:8000
    ...
                                                main
    requests completed                            48
    TTFT mean (ms)                             41.20
"""

from __future__ import annotations

import math
from typing import Any

from kvpilot.bench.metrics import percentile_key
from kvpilot.bench.runner import BenchResult

WIDTH = 64
LABEL_WIDTH = 32


def describe_load(result: BenchResult) -> list[tuple[str, str]]:
    """(label, value) lines describing what was run."""
    c = result.config
    if result.custom_workload:
        dataset = "custom workload (classes: " + ", ".join(result.by_class) + ")"
    elif c.dataset == "random":
        dataset = (f"random ({c.num_prompts} prompts, ~{c.random_input_len} in / "
                   f"{c.output_len} out tokens, range ratio {c.random_range_ratio:g})")
    elif c.dataset == "shared-prefix":
        dataset = (f"shared-prefix ({c.num_prompts} prompts in {c.num_groups} groups, "
                   f"~{c.shared_prefix_len} + {c.question_len} in / {c.output_len} out)")
    else:
        dataset = (f"multi-turn ({c.num_sessions} sessions x {c.num_turns} turns, system "
                   f"~{c.system_prompt_len}, turn ~{c.turn_input_len} in / {c.output_len} out)")
    lines = [("base url", c.base_url), ("model", result.model), ("dataset", dataset),
             ("request rate (req/s)", "inf" if math.isinf(c.request_rate)
              else f"{c.request_rate:g}"),
             ("max concurrency", str(c.max_concurrency or "unlimited"))]
    if c.background_streams:
        lines.append(("background streams", f"{c.background_streams} x (~"
                      f"{c.background_input_len} in / {c.background_output_len} out)"))
    if c.label:
        lines.insert(0, ("label", c.label))
    lines.append(("duration (s)", f"{result.duration_s:.2f}"
                  + ("  (stopped by --timeout)" if result.timed_out else "")))
    return lines


def metric_rows(percentiles: tuple[float, ...]) -> list[tuple[str, str, str | None]]:
    """(row label, summary key, distribution key or None) in display order."""
    rows: list[tuple[str, str, str | None]] = [
        ("requests completed", "requests_completed", None),
        ("requests failed", "requests_failed", None),
        ("requests not sent", "requests_not_sent", None),
        ("requests cancelled at the end", "requests_cancelled", None),
        ("input tokens", "total_input_tokens", None),
        ("output tokens", "total_output_tokens", None),
        ("request throughput (req/s)", "request_throughput", None),
        ("output throughput (tok/s)", "output_throughput", None),
        ("total throughput (tok/s)", "total_token_throughput", None),
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                      ("E2E", "e2e_ms")):
        rows.append((f"{name} mean (ms)", key, "mean"))
        rows.extend((f"{name} {percentile_key(p)} (ms)", key, percentile_key(p))
                    for p in percentiles)
    return rows


def _cell(summary: dict[str, Any], key: str, sub: str | None) -> str:
    value = summary.get(key)
    if sub is not None:
        value = None if value is None else value.get(sub)
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_report(result: BenchResult) -> str:
    """The whole report as text (no trailing newline)."""
    out = [" kvpilot bench serve ".center(WIDTH, "=")]
    out += [f"{label:<{LABEL_WIDTH}}{value}" for label, value in describe_load(result)]
    classes = list(result.by_class)
    col = max(12, *(len(c) + 2 for c in classes)) if classes else 12
    out.append("-" * WIDTH)
    out.append(" " * LABEL_WIDTH + "".join(f"{c:>{col}}" for c in classes))
    for label, key, sub in metric_rows(result.config.percentiles):
        cells = [_cell(result.by_class[c], key, sub) for c in classes]
        if key == "requests_cancelled" and all(x in ("0", "-") for x in cells):
            continue  # only background streams get cancelled
        out.append(f"{label:<{LABEL_WIDTH}}" + "".join(f"{x:>{col}}" for x in cells))
    out.append("-" * WIDTH)
    cache = result.prefix_cache
    if cache["hit_rate"] is not None:
        hit = (f"{100 * cache['hit_rate']:.1f}% ({cache['source']} counters: "
               f"{cache['hits_delta']:g} of {cache['queries_delta']:g} prompt tokens)")
    else:
        hit = f"n/a ({cache['note']})"
    out.append(f"{'prefix cache hit rate':<{LABEL_WIDTH}}{hit}")
    for e in result.errors:
        out.append(f"error x{e['count']}: {e['error']}")
    out.append("=" * WIDTH)
    return "\n".join(out)
