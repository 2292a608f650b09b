"""Read the server's /metrics with prometheus_client's own parser."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    """sample name (with sorted labels except model_name and vLLM's engine index) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + (str(sorted(labels.items())) if labels else "")
            out[key] = s.value
    return out


def wait_metric(url: str, name: str, predicate, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = scrape(url).get(name)
        if value is not None and predicate(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"{name} = {value} did not satisfy the condition within {timeout}s")
