"""The PromQL the ``prometheus`` metric source sends, built in one place (pure).

Series are selected by the labels the PodMonitor (or the relabelling in
docs/operations.md) puts on every engine series: ``namespace`` and
``inference_deployment``; ``pod`` tells the pods apart. With S =
``{namespace="NS",inference_deployment="NAME"}`` and W the rate window (``1m``):

=====================  ==========================================================
signal                 query (one sample per pod)
=====================  ==========================================================
kv_usage               ``max by (pod) (kvpilot:gpu_cache_usage_factor{S})``
num_waiting            ``max by (pod) (kvpilot:num_requests_waiting{S})``
waiting_tokens         ``max by (pod) (kvpilot:num_waiting_tokens{S})``
num_running            ``max by (pod) (kvpilot:num_requests_running{S})``
preemption_rate        ``max by (pod) (rate(kvpilot:num_preemptions_total{S}[W]))``
kv_capacity            ``max by (pod) (kvpilot:kv_cache_capacity_tokens{S})``
cache_config           ``max by (pod, num_gpu_blocks, block_size, sliding_window)
                       (kvpilot:cache_config_info{S})`` (capacity fallback; KV window)
generation_rate        ``max by (pod) (rate(kvpilot:generation_tokens_total{S}[W]))``
prompt_tokens          ``max by (pod) (kvpilot:prompt_tokens_total{S})``
generation_tokens      ``max by (pod) (kvpilot:generation_tokens_total{S})``
requests_finished      ``sum by (pod) (max by (pod, finished_reason)
                       (kvpilot:request_success_total{S}))``
itl_buckets            ``max by (pod, le) (increase(
                       kvpilot:inter_token_latency_seconds_bucket{S}[W]))``
itl_sum                ``max by (pod) (increase(
                       kvpilot:inter_token_latency_seconds_sum{S}[W]))``
ttft_buckets           the same on ``kvpilot:time_to_first_token_seconds_bucket``
ttft_sum               the same on ``kvpilot:time_to_first_token_seconds_sum``
step_tokens            ``max by (pod) (increase(kvpilot:iteration_tokens_total_sum{S}[W]))
                       / max by (pod) (increase(kvpilot:iteration_tokens_total_count{S}[W]))``
prompt_token_rate      ``max by (pod) (rate(kvpilot:prefix_cache_queries_total{S}[W]))``
cached_token_rate      ``max by (pod) (rate(kvpilot:prefix_cache_hits_total{S}[W]))``
=====================  ==========================================================

The last seven are the SLO's (:mod:`kvpilot.autoscaler.latency`): each pod's latency
histograms over the window W, read like ``histogram_quantile`` reads them, its mean
tokens per engine step, and its prefix cache's looked-up and held prompt tokens per
second. They are optional: an engine older than these series answers
nothing, which is not reported as a problem (the policy falls back to saturation).

``max by (pod)`` keeps one sample per pod even when two scrape jobs collect the same
target (duplicates are equal; a sum would double them). An empty vector for a pod is
missing data, never zero (case C17). ``sliding_window`` in the cache-config grouping is
the window behind which the engine frees KV blocks (``None`` without one); an engine that
does not export the label yields samples without it, which read as no window.

The router pods' series carry the same ``namespace`` and ``inference_deployment`` labels
(``pod`` is then the router pod), and one sample per engine (label ``worker``, its URL);
:func:`router_query` adds the routers up per engine::

    sum by (worker) (max by (pod, worker) (vllm_router_running_requests{S}))

``max by (pod, worker)`` drops duplicate scrapes of one router, ``sum by (worker)`` adds
the routers. An empty answer means no router series (no router, or a routing policy that
tracks no load): the held demand is then unknown and counted as 0, not reported as missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpilot.operator.autoscaling.metrics_source.names import EngineMetricNames, RouterMetricNames
from kvpilot.operator.constants import SERIES_LABEL

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DURATION = re.compile(r"^[1-9][0-9]*(ms|s|m|h)$")
DEFAULT_RATE_WINDOW = "1m"


def _quote(value: str) -> str:
    """A PromQL string literal: backslashes, quotes and newlines escaped."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


@dataclass(frozen=True)
class SeriesSelector:
    """Which series belong to one InferenceDeployment.

    Attributes:
        namespace / name: the InferenceDeployment.
        namespace_label / owner_label / pod_label: the series label names.
    """

    namespace: str
    name: str
    namespace_label: str = "namespace"
    owner_label: str = SERIES_LABEL
    pod_label: str = "pod"

    def __post_init__(self) -> None:
        for field_name in ("namespace_label", "owner_label", "pod_label"):
            value = getattr(self, field_name)
            if not _LABEL_NAME.match(value):
                raise ValueError(
                    f"{field_name} must be a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*);"
                    f" got {value!r}"
                )

    def matchers(self) -> str:
        """``{namespace="NS",inference_deployment="NAME"}``."""
        return (f"{{{self.namespace_label}={_quote(self.namespace)},"
                f"{self.owner_label}={_quote(self.name)}}}")


def signal_queries(names: EngineMetricNames, selector: SeriesSelector,
                   rate_window: str = DEFAULT_RATE_WINDOW) -> dict[str, str]:
    """Every query of the table above, by signal name.

    Raises:
        ValueError: ``rate_window`` is not a PromQL duration such as ``1m`` or ``30s``.
    """
    if not _DURATION.match(rate_window):
        raise ValueError(
            f"rate_window must be a PromQL duration like 30s or 1m; got {rate_window!r}")
    s, pod = selector.matchers(), selector.pod_label

    def per_pod(expr: str) -> str:
        return f"max by ({pod}) ({expr})"

    return {
        "kv_usage": per_pod(f"{names.kv_usage}{s}"),
        "num_waiting": per_pod(f"{names.num_waiting}{s}"),
        "waiting_tokens": per_pod(f"{names.waiting_tokens}{s}"),
        "num_running": per_pod(f"{names.num_running}{s}"),
        "preemption_rate": per_pod(f"rate({names.preemptions}{s}[{rate_window}])"),
        "kv_capacity": per_pod(f"{names.kv_capacity}{s}"),
        "cache_config": (f"max by ({pod}, num_gpu_blocks, block_size, sliding_window)"
                         f" ({names.cache_config}{s})"),
        "generation_rate": per_pod(f"rate({names.generation_tokens}{s}[{rate_window}])"),
        "prompt_tokens": per_pod(f"{names.prompt_tokens}{s}"),
        "generation_tokens": per_pod(f"{names.generation_tokens}{s}"),
        "requests_finished": (f"sum by ({pod}) (max by ({pod}, finished_reason)"
                              f" ({names.requests_finished}{s}))"),
        "itl_buckets": f"max by ({pod}, le) (increase({names.itl}_bucket{s}[{rate_window}]))",
        "itl_sum": per_pod(f"increase({names.itl}_sum{s}[{rate_window}])"),
        "ttft_buckets": f"max by ({pod}, le) (increase({names.ttft}_bucket{s}[{rate_window}]))",
        "ttft_sum": per_pod(f"increase({names.ttft}_sum{s}[{rate_window}])"),
        "step_tokens": (per_pod(f"increase({names.iteration_tokens}_sum{s}[{rate_window}])")
                        + " / "
                        + per_pod(f"increase({names.iteration_tokens}_count{s}[{rate_window}])")),
        "prompt_token_rate": per_pod(f"rate({names.prefix_queries}{s}[{rate_window}])"),
        "cached_token_rate": per_pod(f"rate({names.prefix_hits}{s}[{rate_window}])"),
    }


# The SLO's signals: an empty answer is an engine without them, not a problem to report.
OPTIONAL_SIGNALS = frozenset({"itl_buckets", "itl_sum", "ttft_buckets", "ttft_sum",
                              "step_tokens", "prompt_token_rate", "cached_token_rate"})
# Signals answered per (pod, le): histogram buckets.
BUCKET_SIGNALS = frozenset({"itl_buckets", "ttft_buckets"})


def router_query(names: RouterMetricNames, selector: SeriesSelector) -> str:
    """The routers' in-flight requests per engine (worker URL), summed over router pods."""
    return (f"sum by ({names.worker_label}) (max by ({selector.pod_label},"
            f" {names.worker_label}) ({names.in_flight}{selector.matchers()}))")
