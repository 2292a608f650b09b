"""Summary statistics of a run: throughput and latency distributions per request class.

Latencies are reported in milliseconds as ``{"mean", "p<q>"..., "count"}``; percentiles
are :func:`kvpilot.stats.percentile` (linear interpolation between order statistics,
numpy's default ``linear`` method), so p50 of ``[1, 2, 3, 4]`` is 2.5. A distribution with no samples is ``None``.

Which records feed which figure:

- requests counted as completed, and E2E and TPOT: status ``ok`` only;
- TTFT, ITL and token totals: ``ok`` and ``cancelled`` (a background stream stopped at the
  end of the run still measured real gaps and produced real tokens);
- input tokens: ``usage.prompt_tokens``, else (no usage, e.g. a cancelled stream) the
  dataset's approximate target; ``input_tokens_from_usage`` says whether all were exact;
- throughputs divide by the run's duration (first arrival to last dataset completion).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvpilot.bench.client import CANCELLED, FAILED, OK, RequestRecord
from kvpilot.stats import percentile


def percentile_key(pct: float) -> str:
    """``99.0`` -> ``"p99"``, ``99.9`` -> ``"p99.9"``."""
    return f"p{pct:g}"


def distribution_ms(values_s: Iterable[float], percentiles: Sequence[float]
                    ) -> dict[str, float] | None:
    """Mean and percentiles, in ms, of samples given in seconds; None without samples."""
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        return None
    out: dict[str, float] = {"mean": sum(ms) / len(ms)}
    for p in percentiles:
        out[percentile_key(p)] = percentile(ms, p)
    out["count"] = len(ms)
    return out


def summarize_class(records: Sequence[RequestRecord], duration_s: float,
                    percentiles: Sequence[float]) -> dict[str, Any]:
    """Counts, token totals, throughputs and latency distributions of one request class."""
    ok = [r for r in records if r.status == OK]
    measured = [r for r in records if r.status in (OK, CANCELLED)]
    # usage.prompt_tokens where the server sent it, else the dataset's target length
    input_tokens = sum(r.target_input_tokens if r.prompt_tokens is None else r.prompt_tokens
                       for r in measured)
    output_tokens = sum(r.output_tokens for r in measured)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return {
        "requests_completed": len(ok),
        "requests_failed": sum(r.status == FAILED for r in records),
        "requests_cancelled": sum(r.status == CANCELLED for r in records),
        "total_input_tokens": input_tokens,
        "total_target_input_tokens": sum(r.target_input_tokens for r in measured),
        "input_tokens_from_usage": all(r.prompt_tokens is not None for r in measured),
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": distribution_ms((r.ttft_s for r in measured if r.ttft_s is not None),
                                   percentiles),
        "tpot_ms": distribution_ms((t for r in ok if (t := r.tpot_s) is not None),
                                   percentiles),
        "itl_ms": distribution_ms((g for r in measured for g in r.itl_s), percentiles),
        "e2e_ms": distribution_ms((r.e2e_s for r in ok if r.e2e_s is not None), percentiles),
    }


def summarize(records: Sequence[RequestRecord], duration_s: float,
              percentiles: Sequence[float]) -> dict[str, dict[str, Any]]:
    """``summarize_class`` for each request class, in order of first appearance."""
    classes: dict[str, list[RequestRecord]] = {}
    for r in records:
        classes.setdefault(r.request_class, []).append(r)
    return {name: summarize_class(rs, duration_s, percentiles) for name, rs in classes.items()}


def error_counts(records: Iterable[RequestRecord], limit: int = 5) -> list[dict[str, Any]]:
    """The first ``limit`` distinct error messages, in order of first occurrence, with
    how many failed requests had each."""
    counts: dict[str, int] = {}
    for r in records:
        if r.status == FAILED and r.error:
            counts[r.error] = counts.get(r.error, 0) + 1
    return [{"error": e, "count": n} for e, n in list(counts.items())[:limit]]
