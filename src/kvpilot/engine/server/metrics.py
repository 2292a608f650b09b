"""Prometheus metrics of the engine, with the names fixed in docs/metrics.md.

Gauges are set from the engine thread after every step (and while idle); counters and
histograms take each step's :class:`IterationStats` deltas. Every series carries a
``model_name`` label, as vLLM's do, and the vLLM names of the signals that gateways
and dashboards read are exported as aliases.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from kvpilot.engine.llm_engine import LLMEngine

# The *_created series double the payload and no dashboard uses them.
disable_created_metrics()

# Inter-token latency: from 1 ms. Request-level latencies: finite buckets up to an hour,
# so a p99 above 60 s is visible (a 60 s top bucket hides it).
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 3600.0)


class EngineMetrics:
    """All engine metrics in their own registry.

    Args:
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.cache_usage = gauge(
            "kvpilot:gpu_cache_usage_factor",
            "Share of KV blocks held by running or waiting requests (0..1); idle cached blocks count as free.",
        )
        self.hit_rate = gauge(
            "kvpilot:prefix_cache_hit_rate", "Prefix-cache hit tokens / queried prompt tokens over the last 1000 requests."
        )
        self.prefix_queries = counter("kvpilot:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter(
            "kvpilot:prefix_cache_hits", "Prompt tokens found in the prefix cache (recomputation after preemption excluded)."
        )
        self.running = gauge("kvpilot:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("kvpilot:num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).")
        self.waiting_tokens = gauge("kvpilot:num_waiting_tokens", "Tokens not yet prefilled (prompts, and the output a preempted request recomputes).")
        self.preemptions = counter("kvpilot:num_preemptions", "Requests preempted (by recompute).")
        self.prompt_tokens = counter("kvpilot:prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("kvpilot:generation_tokens", "Generated tokens.")
        self.ttft = histogram("kvpilot:time_to_first_token_seconds", "Arrival to first token.", REQUEST_BUCKETS)
        self.itl = histogram("kvpilot:inter_token_latency_seconds", "Time between consecutive tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("kvpilot:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("kvpilot:request_queue_time_seconds", "Arrival to first scheduling.", REQUEST_BUCKETS)
        self.capacity = gauge("kvpilot:kv_cache_capacity_tokens", "KV cache capacity: blocks x block size.")
        self.integrity_checks = counter(
            "kvpilot:kv_cache_integrity_checks",
            "KV cache integrity checks run (block pool and radix cache accounting, each time the engine goes idle).",
        )
        self.integrity_failures = counter(
            "kvpilot:kv_cache_integrity_failures",
            "KV cache integrity checks that failed (the first failure makes /health fail, so the pod restarts).",
        )
        self.success = Counter(
            "kvpilot:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"], registry=r
        )
        self.config_info = Gauge(
            "kvpilot:cache_config_info",
            "KV cache configuration (value 1).",
            ["model_name", "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"],
            registry=r,
        )
        # vLLM-compatible aliases (Gateway API inference extension, existing dashboards).
        self.v_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (0..1); alias of kvpilot:gpu_cache_usage_factor.")
        self.v_running = gauge("vllm:num_requests_running", "Alias of kvpilot:num_requests_running.")
        self.v_waiting = gauge("vllm:num_requests_waiting", "Alias of kvpilot:num_requests_waiting.")
        self.v_queries = counter("vllm:prefix_cache_queries", "Alias of kvpilot:prefix_cache_queries_total.")
        self.v_hits = counter("vllm:prefix_cache_hits", "Alias of kvpilot:prefix_cache_hits_total.")

    def set_config(self, engine: LLMEngine) -> None:
        cfg = engine.config
        self.capacity.set(cfg.num_blocks * cfg.block_size)
        self.config_info.labels(
            self.model_name,
            str(cfg.block_size),
            str(cfg.num_blocks),
            cfg.kv_cache_dtype_name,
            str(engine.args.enable_prefix_caching).lower(),
        ).set(1)

    def observe_integrity_check(self, passed: bool) -> None:
        """Count one integrity check and whether it failed (engine thread)."""
        self.integrity_checks.inc()
        if not passed:
            self.integrity_failures.inc()

    def observe(self, engine: LLMEngine) -> None:
        """Set the gauges and add the statistics accumulated since the last call (call
        from the engine thread, after each step and while idle)."""
        s = engine.scheduler_stats()
        for g in (self.cache_usage, self.v_usage):
            g.set(s.kv_cache_usage)
        self.hit_rate.set(s.prefix_cache_hit_rate)
        for g in (self.running, self.v_running):
            g.set(s.num_running)
        for g in (self.waiting, self.v_waiting):
            g.set(s.num_waiting)
        self.waiting_tokens.set(s.num_waiting_tokens)
        it = engine.take_stats()
        if it.prefix_queries:
            self.prefix_queries.inc(it.prefix_queries)
            self.v_queries.inc(it.prefix_queries)
        if it.prefix_hits:
            self.prefix_hits.inc(it.prefix_hits)
            self.v_hits.inc(it.prefix_hits)
        if it.num_preemptions:
            self.preemptions.inc(it.num_preemptions)
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for v in it.time_to_first_token:
            self.ttft.observe(v)
        for v in it.inter_token_latency:
            self.itl.observe(v)
        for f in it.finished:
            self.e2e.observe(f.e2e_latency)
            self.queue_time.observe(f.queue_time)
            self.success.labels(self.model_name, f.finish_reason).inc()
