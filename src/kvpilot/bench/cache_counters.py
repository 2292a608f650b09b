"""Prefix-cache hit rate from Prometheus counter deltas.

The server's ``/metrics`` is scraped before and after the run; the hit rate of the run is
``delta(hits) / delta(queries)``, both counted in prompt tokens. kvpilot's own counters
are used when present, else vLLM's (which kvpilot also exports as aliases):

    kvpilot:prefix_cache_hits_total / kvpilot:prefix_cache_queries_total
    vllm:prefix_cache_hits_total    / vllm:prefix_cache_queries_total

Samples are summed over label sets (one per model or engine). A server exporting neither
pair, a failed scrape, a counter reset or a run with no queried tokens gives a hit rate
of ``None`` (unknown), never 0.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.bench.client import LOOKUP_TIMEOUT_S

# (source, hits counter, queries counter), in order of preference.
COUNTER_PAIRS = (
    ("kvpilot", "kvpilot:prefix_cache_hits_total", "kvpilot:prefix_cache_queries_total"),
    ("vllm", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
)
WANTED = {name for _, hits, queries in COUNTER_PAIRS for name in (hits, queries)}


def parse_counters(text: str) -> dict[str, float]:
    """The prefix-cache counters found in a Prometheus text exposition, each summed over
    its label sets. Raises ``ValueError`` on text the parser cannot read."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WANTED:
                found[sample.name] = found.get(sample.name, 0.0) + float(sample.value)
    return found


async def scrape_counters(http: httpx.AsyncClient, url: str) -> tuple[dict[str, float] | None,
                                                                      str | None]:
    """``(counters, None)`` from ``GET url``, or ``(None, why)`` if that failed."""
    try:
        response = await http.get(url, timeout=LOOKUP_TIMEOUT_S)
        if response.status_code != 200:
            return None, f"GET {url}: HTTP {response.status_code}"
        return parse_counters(response.text), None
    except (httpx.HTTPError, ValueError) as e:
        return None, f"GET {url}: {type(e).__name__}: {e}"


def hit_rate(before: dict[str, float] | None, after: dict[str, float] | None
             ) -> dict[str, Any]:
    """The run's hit rate from two scrapes: ``{"hit_rate", "source", "hits_delta",
    "queries_delta", "note"}``; ``hit_rate`` is a float in [0, 1] or None."""
    out: dict[str, Any] = {"hit_rate": None, "source": None, "hits_delta": None,
                           "queries_delta": None, "note": None}
    if before is None or after is None:
        out["note"] = "metrics endpoint not readable"
        return out
    for source, hits, queries in COUNTER_PAIRS:
        if all(name in before and name in after for name in (hits, queries)):
            d_hits, d_queries = after[hits] - before[hits], after[queries] - before[queries]
            out.update(source=source, hits_delta=d_hits, queries_delta=d_queries)
            if d_hits < 0 or d_queries < 0:
                out["note"] = "counters went down (server restarted?)"
            elif d_queries == 0:
                out["note"] = "no prompt tokens were queried during the run"
            else:
                out["hit_rate"] = d_hits / d_queries
            return out
    out["note"] = "no prefix-cache counters at the metrics endpoint"
    return out
