"""The engine and router series the autoscaler reads, by name, in frozen objects shared by
both metric sources (docs/architecture.md, "Metrics"; docs/metrics.md; docs/autoscaling.md,
"Demand held at the router").

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
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class EngineMetricNames:
    """Attributes (all Prometheus sample names):
        kv_usage: gauge 0..1, non-evictable KV share.
        num_waiting / num_running: gauges, requests.
        waiting_tokens: gauge, prompt tokens not yet prefilled.
        preemptions: counter, preemptions since the engine started.
        kv_capacity: gauge, KV pool in tokens.
        cache_config: info gauge with ``num_gpu_blocks`` and ``block_size`` labels (the
            capacity when ``kv_capacity`` is absent) and, from engines that export it,
            ``sliding_window`` (the KV window that caps a request's tokens; ``None`` or
            absent: no window).
        generation_tokens / prompt_tokens: counters, tokens.
        requests_finished: counter, finished requests (label ``finished_reason``; summed).
        itl / ttft: histograms (the base name: the samples are ``_bucket`` with ``le``,
            ``_sum`` and ``_count``), inter-token latency and time to first token in
            seconds; absent on engines older than them (the SLO then falls back to
            saturation).
        iteration_tokens: histogram of the tokens scheduled per engine step (its ``_sum``
            and ``_count`` give the mean per step).
        prefix_queries / prefix_hits: counters, prompt tokens looked up in the prefix
            cache and those it held (their rates feed the prefix-cache handover check;
            absent on older engines, which skips that check).
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
    itl: str = "kvpilot:inter_token_latency_seconds"
    ttft: str = "kvpilot:time_to_first_token_seconds"
    iteration_tokens: str = "kvpilot:iteration_tokens_total"
    prefix_queries: str = "kvpilot:prefix_cache_queries_total"
    prefix_hits: str = "kvpilot:prefix_cache_hits_total"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str) or not _METRIC_NAME.match(value):
                raise ValueError(
                    f"metric name for {f.name} must match [a-zA-Z_:][a-zA-Z0-9_:]*; got {value!r}"
                )


@dataclass(frozen=True)
class RouterMetricNames:
    """The request router's series (vllm-router 0.1.17, ``--prometheus-port``).

    Attributes:
        in_flight: gauge, one series per engine (label ``worker``, the engine's URL such as
            ``http://10.0.0.7:8000``): requests this router has assigned to that engine and
            not seen finish. vllm-router sets it from the moment its policy picks the engine
            to the end of the response, and only under the policies that track load
            (``kv_aware``, ``cache_aware``, ``power_of_two``); under ``random``,
            ``round_robin`` and ``consistent_hash`` it is absent. The router exports no gauge
            of requests waiting in its own admission queue (``--max-concurrent-requests`` /
            ``--queue-size``): that queue is invisible to every source.
        worker_label: the label naming the engine in ``in_flight``.
        errors: counter of failed attempts, labelled ``route`` and ``error_type``; created
            on the first failure (absent = none yet).
        error_type_label / no_engine_error: the label and its value for an attempt that
            found no engine to send the request to (``no_available_workers``): while the
            fleet is at zero, every retry of a held request adds one (scale to zero).
    """

    in_flight: str = "vllm_router_running_requests"
    worker_label: str = "worker"
    errors: str = "vllm_router_request_errors_total"
    error_type_label: str = "error_type"
    no_engine_error: str = "no_available_workers"

    def __post_init__(self) -> None:
        for name in ("in_flight", "errors"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _METRIC_NAME.match(value):
                raise ValueError(f"metric name for {name} must match [a-zA-Z_:][a-zA-Z0-9_:]*;"
                                 f" got {value!r}")
        for name in ("worker_label", "error_type_label"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _LABEL_NAME.match(value):
                raise ValueError(f"{name} must be a Prometheus label name"
                                 f" ([a-zA-Z_][a-zA-Z0-9_]*); got {value!r}")
