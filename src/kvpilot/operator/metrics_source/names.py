"""The engine series the autoscaler reads, by name, in one frozen object shared by both
metric sources (docs/architecture.md, "Metrics"; docs/metrics.md).

Names are the *sample* names as they appear in ``/metrics`` and in PromQL: counters carry
``_total``. A name that matches nothing (``kvpilot:num_preemptions`` without ``_total``)
is not an error at read time: the value is missing, never zero (case C17). Tests build
misspelled variants with :func:`dataclasses.replace` to prove it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

# Prometheus metric names (colons allowed, as in recording rules and our engine's names).
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@dataclass(frozen=True)
class EngineMetricNames:
    """Attributes (all Prometheus sample names):
        kv_usage: gauge 0..1, non-evictable KV share.
        num_waiting / num_running: gauges, requests.
        waiting_tokens: gauge, prompt tokens not yet prefilled.
        preemptions: counter, preemptions since the engine started.
        kv_capacity: gauge, KV pool in tokens.
        cache_config: info gauge with ``num_gpu_blocks`` and ``block_size`` labels (the
            capacity when ``kv_capacity`` is absent).
        generation_tokens / prompt_tokens: counters, tokens.
        requests_finished: counter, finished requests (label ``finished_reason``; summed).
    """

    kv_usage: str = "kvpilot:gpu_cache_usage_factor"
    num_waiting: str = "kvpilot:num_requests_waiting"
    waiting_tokens: str = "kvpilot:num_waiting_tokens"
    num_running: str = "kvpilot:num_requests_running"
    preemptions: str = "kvpilot:num_preemptions_total"
    kv_capacity: str = "kvpilot:kv_cache_capacity_tokens"
    cache_config: str = "kvpilot:cache_config_info"
    generation_tokens: str = "kvpilot:generation_tokens_total"
    prompt_tokens: str = "kvpilot:prompt_tokens_total"
    requests_finished: str = "kvpilot:request_success_total"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str) or not _METRIC_NAME.match(value):
                raise ValueError(
                    f"metric name for {f.name} must match [a-zA-Z_:][a-zA-Z0-9_:]*; got {value!r}"
                )
