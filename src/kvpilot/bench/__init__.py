"""``kvpilot bench``: a load generator for OpenAI-compatible servers (a client only).

It never imports the engine, kernels or torch, so it benchmarks kvpilot and vLLM alike.
Module map:

- ``config``: ``BenchConfig``, the validated settings of one run;
- ``text``, ``datasets``: prompts and workloads (``RequestSpec``, ``SessionSpec``);
- ``arrivals``: Poisson arrival times;
- ``client``: one timed streaming request -> ``RequestRecord``;
- ``cache_counters``: prefix-cache hit rate from ``/metrics`` counter deltas;
- ``metrics``: percentiles and per-class summaries;
- ``runner``: ``run_benchmark`` drives a workload -> ``BenchResult``;
- ``failures``: ``count_failures`` of a result JSON (the exit status's rule);
- ``report``, ``cli``: the ``kvpilot bench serve`` command.

Python use::

    from kvpilot.bench import BenchConfig, run_benchmark
    result = run_benchmark(BenchConfig(base_url="http://127.0.0.1:8000",
                                       dataset="multi-turn", num_sessions=8))
    result.summary["ttft_ms"]["mean"], result.prefix_cache["hit_rate"]
"""

from kvpilot.bench.client import BenchError, RequestRecord
from kvpilot.bench.config import BenchConfig
from kvpilot.bench.datasets import BACKGROUND, MAIN, RequestSpec, SessionSpec, build_workload
from kvpilot.bench.failures import Failures, count_failures
from kvpilot.bench.report import format_report
from kvpilot.bench.runner import BenchResult, run_benchmark, run_benchmark_async
from kvpilot.bench.text import random_text

__all__ = [
    "BACKGROUND",
    "MAIN",
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "Failures",
    "RequestRecord",
    "RequestSpec",
    "SessionSpec",
    "build_workload",
    "count_failures",
    "format_report",
    "random_text",
    "run_benchmark",
    "run_benchmark_async",
]
