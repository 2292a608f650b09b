"""Prometheus metrics of the engine, with the names fixed in docs/metrics.md.

Two sets of series, fed from the same statistics:

* ``kvpilot:*``: kvpilot's own names, labels (``model_name``) and buckets. Alerts and the
  operator depend on them; they do not change.
* ``vllm:*``: the names, types, labels and bucket boundaries of vLLM's v1 engine
  (``vllm/v1/metrics/loggers.py``) that vLLM's Grafana dashboard and gateways (the
  Gateway API Inference Extension's endpoint picker) read. Labels are vLLM's:
  ``model_name`` and ``engine`` (always ``"0"``: one engine per server), plus
  ``finished_reason`` on ``vllm:request_success_total``; ``vllm:cache_config_info``
  carries vLLM's cache-config labels and ``engine`` only, as vLLM's does. The buckets are
  vLLM's so that ``histogram_quantile(q, sum by (le) (rate(..._bucket[5m])))`` over a
  fleet that mixes vLLM and kvpilot pods adds up matching buckets.

Gauges are set from the engine thread after every step (and while idle); counters and
histograms take each step's :class:`IterationStats` deltas. What kvpilot does not export
under a vLLM name, and why, is listed in docs/metrics.md.

With LoRA on (the scheduler's ``max_loras > 0``), ``vllm:lora_requests_info`` is vLLM's
too: labels ``max_lora``, ``waiting_lora_adapters`` and ``running_lora_adapters`` (the
adapter names, comma-joined) and no others, value the wall-clock time of the update
(``set_to_current_time``), as ``PrometheusStatLogger`` in ``vllm/v1/metrics/loggers.py``
records it. The endpoint picker reads the series with the largest value among those
whose adapter labels are not both empty (``getLatestLoraMetric`` in the Gateway API
Inference Extension's metrics client). vLLM leaves every label combination it ever set
behind; kvpilot keeps only the two that reader can pick (the current one and the last
one that named an adapter), so it picks the same series and the cardinality stays
bounded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from kvpilot.engine.llm_engine import LLMEngine

# The *_created series double the payload and no dashboard uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Inter-token latency: from 1 ms. Request-level latencies: finite buckets up to an hour,
# so a p99 above 60 s is visible (a 60 s top bucket hides it).
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 3600.0)

# vLLM's label value for its only engine (data parallelism would number them).
VLLM_ENGINE = "0"
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), in seconds or tokens.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                              2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM creates the request_success series of every finish reason up front (value 0).
VLLM_FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``
    (``build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)``)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class EngineMetrics:
    """All engine metrics in their own registry.

    The ``vllm:`` token-count histograms take their buckets from ``max_model_len``, so
    they, and ``vllm:cache_config_info``, appear once :meth:`set_config` has seen the
    engine (before the first request can arrive).

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
        # One observation per engine step: the operator's autoscaler reads _sum / _count
        # over its window as the mean tokens scheduled per step (the SLO's TTFT model).
        self.iteration_tokens = histogram(
            "kvpilot:iteration_tokens_total",
            "Tokens scheduled in one engine step (prefill chunks plus one per decoding request), one observation per step.",
            VLLM_ITERATION_TOKEN_BUCKETS,
        )
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
        # Every finish reason from the start (value 0), as vLLM does: "no request finished
        # yet" reads as 0, not as a missing series (the operator's scale to zero needs it).
        for reason in VLLM_FINISH_REASONS:
            self.success.labels(self.model_name, reason)
        # sliding_window: W (tokens) when every layer slides and the engine frees the
        # blocks behind the window (a sequence then holds at most (cdiv(W, block_size) + 1)
        # x block_size tokens of KV), else "None".
        self.config_info = Gauge(
            "kvpilot:cache_config_info",
            "KV cache configuration (value 1).",
            ["model_name", "block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "sliding_window"],
            registry=r,
        )
        self._init_vllm()

    # ------------------------------------------------------------------ vLLM
    def _init_vllm(self) -> None:
        """The ``vllm:`` series that need no engine configuration."""
        r = self.registry
        vl = ["model_name", "engine"]
        values = (self.model_name, VLLM_ENGINE)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, vl, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, vl, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, vl, buckets=buckets, registry=r).labels(*values)

        self.v_running = gauge("vllm:num_requests_running", "Requests in the running batch (kvpilot:num_requests_running).")
        self.v_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled, preempted ones included (kvpilot:num_requests_waiting)."
        )
        self.v_usage = gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache usage, 0..1 (1 = every block held by a running or waiting request; kvpilot:gpu_cache_usage_factor).",
        )
        self.v_gpu_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "KV cache usage, 0..1. vLLM's name before 0.9, still read by its dashboard and older gateways; "
            "same value as vllm:kv_cache_usage_perc.",
        )
        self.v_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache, once per request.")
        self.v_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (recomputation after preemption excluded)."
        )
        self.v_preemptions = counter("vllm:num_preemptions", "Requests preempted (by recompute).")
        self.v_prompt_tokens = counter(
            "vllm:prompt_tokens", "Prompt tokens (cached ones included) of requests that produced their first token."
        )
        self.v_generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason (stop, length, abort; every abort counts).",
            [*vl, "finished_reason"],
            registry=r,
        )
        self._v_success_family = success
        self.v_success = {reason: success.labels(*values, reason) for reason in VLLM_FINISH_REASONS}
        self.v_iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Tokens computed per engine step (prefill chunks and decodes), one observation per step.",
            VLLM_ITERATION_TOKEN_BUCKETS,
        )
        self.v_ttft = histogram("vllm:time_to_first_token_seconds", "Seconds from arrival to the first token.", VLLM_TTFT_BUCKETS)
        self.v_itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive tokens of a request, one observation per token after the first.",
            VLLM_TOKEN_LATENCY_BUCKETS,
        )
        self.v_tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Seconds between consecutive tokens of a request; the same observations as "
            "vllm:inter_token_latency_seconds (vLLM's name before 0.11, read by its dashboard).",
            VLLM_TOKEN_LATENCY_BUCKETS,
        )
        self.v_request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Seconds per output token of one finished request: decode time / (output tokens - 1); "
            "requests with fewer than 2 tokens are not observed.",
            VLLM_TOKEN_LATENCY_BUCKETS,
        )
        self.v_e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from arrival to finish (aborted requests included).", VLLM_REQUEST_BUCKETS
        )
        self.v_queue = histogram(
            "vllm:request_queue_time_seconds",
            "Seconds from arrival to first scheduling (WAITING phase; to the abort if never scheduled).",
            VLLM_REQUEST_BUCKETS,
        )
        self.v_inference = histogram(
            "vllm:request_inference_time_seconds",
            "Seconds from first scheduling to the last token (RUNNING phase: prefill + decode, preemptions included).",
            VLLM_REQUEST_BUCKETS,
        )
        self.v_prefill = histogram(
            "vllm:request_prefill_time_seconds", "Seconds from first scheduling to the first token (PREFILL phase).",
            VLLM_REQUEST_BUCKETS,
        )
        self.v_decode = histogram(
            "vllm:request_decode_time_seconds", "Seconds from the first token to the last (DECODE phase).", VLLM_REQUEST_BUCKETS
        )
        # Token-count histograms: buckets from max_model_len, made in set_config().
        self.v_prompt_len: Histogram | None = None
        self.v_generation_len: Histogram | None = None
        self.v_max_tokens: Histogram | None = None
        self._v_n_family: Histogram | None = None
        self._v_max_generation_family: Histogram | None = None
        self._v_cache_info: Gauge | None = None
        # LoRA: made in set_config() when the engine has LoRA on.
        self._v_lora_info: Gauge | None = None
        self._max_lora = 0
        self._lora_current: tuple[str, str, str] | None = None
        self._lora_last_named: tuple[str, str, str] | None = None

    def _init_vllm_config(self, engine: LLMEngine) -> None:
        """The ``vllm:`` series that need the engine: token-count buckets, cache config."""
        r = self.registry
        vl = ["model_name", "engine"]
        values = (self.model_name, VLLM_ENGINE)
        buckets = build_1_2_5_buckets(engine.config.max_model_len)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, vl, buckets=buckets, registry=r)

        self.v_prompt_len = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of each finished request (aborted ones included)."
        ).labels(*values)
        self.v_generation_len = histogram(
            "vllm:request_generation_tokens", "Output tokens of each finished request (aborted ones included)."
        ).labels(*values)
        self.v_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "max_tokens of each finished request, in tokens (when unset: what max_model_len leaves after the prompt).",
        ).labels(*values)
        # Per user request (prompt), not per choice: fed by observe_finished_parent(); a
        # labelled family without samples until then.
        self._v_max_generation_family = histogram(
            "vllm:request_max_num_generation_tokens",
            "Most output tokens among the n choices of one prompt of a user request, once all have finished.",
        )
        self._v_n_family = Histogram(
            "vllm:request_params_n", "The n parameter (choices) of each prompt of a user request, once all have finished.",
            vl, buckets=VLLM_N_BUCKETS, registry=r,
        )
        args = engine.args
        info = {
            "block_size": str(engine.config.block_size),
            "cache_dtype": args.kv_cache_dtype,
            "calculate_kv_scales": str(args.calculate_kv_scales),
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "gpu_memory_utilization": str(args.gpu_memory_utilization),
            "num_gpu_blocks": str(engine.config.num_blocks),
            "num_gpu_blocks_override": str(args.num_gpu_blocks_override),
            # vLLM's CacheConfig.sliding_window is the model's window (None without one or
            # with --disable-sliding-window), whether or not every layer slides.
            "sliding_window": str(engine.model_config.sliding_window),
            "engine": VLLM_ENGINE,
        }
        self._v_cache_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig (value 1; values formatted as vLLM's).",
            list(info), registry=r,
        )
        self._v_cache_info.labels(**info).set(1)

    # --------------------------------------------------------------- feeding
    def set_config(self, engine: LLMEngine) -> None:
        """Record the engine's KV cache configuration (once the engine is built)."""
        cfg = engine.config
        self.capacity.set(cfg.num_blocks * cfg.block_size)
        self.config_info.labels(
            self.model_name,
            str(cfg.block_size),
            str(cfg.num_blocks),
            cfg.kv_cache_dtype_name,
            str(engine.args.enable_prefix_caching).lower(),
            str(cfg.sliding_window),
        ).set(1)
        if self.v_prompt_len is None:
            self._init_vllm_config(engine)
        max_loras = engine.scheduler.config.max_loras
        if max_loras and self._v_lora_info is None:
            self.enable_lora_info(max_loras)

    def enable_lora_info(self, max_loras: int) -> None:
        """Create ``vllm:lora_requests_info`` (once; LoRA on with ``max_loras`` adapters
        per batch). vLLM creates it only with ``--enable-lora``, so without LoRA the family
        is absent, not empty."""
        if self._v_lora_info is not None:
            return
        self._max_lora = max_loras
        self._v_lora_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry,
        )

    def observe_lora(self, running: Sequence[str], waiting: Sequence[str], now: float | None = None) -> None:
        """Set ``vllm:lora_requests_info`` for the adapters with running and waiting
        requests to ``now`` (wall-clock seconds; default the current time), as vLLM does
        after each step. Keeps only the current series and the last one that named an
        adapter (see the module docstring); a no-op without LoRA."""
        gauge = self._v_lora_info
        if gauge is None:
            return
        key = (str(self._max_lora), ",".join(waiting), ",".join(running))
        gauge.labels(*key).set(time.time() if now is None else now)
        previous_named = self._lora_last_named
        if key[1] or key[2]:
            self._lora_last_named = key
        for old in (self._lora_current, previous_named):
            if old is not None and old != key and old != self._lora_last_named:
                with contextlib.suppress(KeyError):
                    gauge.remove(*old)
        self._lora_current = key

    def observe_integrity_check(self, passed: bool) -> None:
        """Count one integrity check and whether it failed (engine thread)."""
        self.integrity_checks.inc()
        if not passed:
            self.integrity_failures.inc()

    def observe_finished_parent(self, n: int, max_num_generation_tokens: int) -> None:
        """One prompt of a user request whose ``n`` choices have all finished (aborted
        ones included), with the most tokens any of them generated: feeds
        ``vllm:request_params_n`` and ``vllm:request_max_num_generation_tokens``, which
        vLLM observes once per parent request, not per choice. The engine sees each
        choice as its own request with ``n = 1``, so only the layer that fans the
        choices out can call this. Thread-safe."""
        if self._v_n_family is None or self._v_max_generation_family is None:
            return  # no engine yet, so no request can have finished
        self._v_n_family.labels(self.model_name, VLLM_ENGINE).observe(n)
        self._v_max_generation_family.labels(self.model_name, VLLM_ENGINE).observe(max_num_generation_tokens)

    def observe(self, engine: LLMEngine) -> None:
        """Set the gauges and add the statistics accumulated since the last call (call
        from the engine thread, after each step and while idle)."""
        if self.v_prompt_len is None:
            self.set_config(engine)
        assert self.v_prompt_len is not None and self.v_generation_len is not None and self.v_max_tokens is not None
        s = engine.scheduler_stats()
        for g in (self.cache_usage, self.v_usage, self.v_gpu_usage):
            g.set(s.kv_cache_usage)
        self.hit_rate.set(s.prefix_cache_hit_rate)
        for g in (self.running, self.v_running):
            g.set(s.num_running)
        for g in (self.waiting, self.v_waiting):
            g.set(s.num_waiting)
        self.waiting_tokens.set(s.num_waiting_tokens)
        it = engine.take_stats()
        self.observe_lora(it.running_lora_adapters, it.waiting_lora_adapters)
        for c, v in (
            (self.prefix_queries, it.prefix_queries),
            (self.v_queries, it.prefix_queries),
            (self.prefix_hits, it.prefix_hits),
            (self.v_hits, it.prefix_hits),
            (self.preemptions, it.num_preemptions),
            (self.v_preemptions, it.num_preemptions),
            (self.prompt_tokens, it.num_prompt_tokens),
            (self.v_prompt_tokens, it.num_prompt_tokens),
            (self.generation_tokens, it.num_generation_tokens),
            (self.v_generation_tokens, it.num_generation_tokens),
        ):
            if v:
                c.inc(v)
        if it.num_batched_tokens:  # a step ran (while idle nothing is observed)
            self.iteration_tokens.observe(it.num_batched_tokens)
            self.v_iteration_tokens.observe(it.num_batched_tokens)
        for ttft in it.time_to_first_token:
            self.ttft.observe(ttft)
            self.v_ttft.observe(ttft)
        for itl in it.inter_token_latency:
            self.itl.observe(itl)
            self.v_itl.observe(itl)
            self.v_tpot.observe(itl)
        for f in it.finished:
            self.e2e.observe(f.e2e_latency)
            self.queue_time.observe(f.queue_time)
            self.success.labels(self.model_name, f.finish_reason).inc()
            success = self.v_success.get(f.finish_reason)
            if success is None:
                success = self.v_success[f.finish_reason] = self._v_success_family.labels(
                    self.model_name, VLLM_ENGINE, f.finish_reason)
            success.inc()
            self.v_e2e.observe(f.e2e_latency)
            self.v_queue.observe(f.queue_time)
            self.v_prompt_len.observe(f.num_prompt_tokens)
            self.v_generation_len.observe(f.num_generation_tokens)
            if f.max_tokens:
                self.v_max_tokens.observe(f.max_tokens)
            if f.prefill_time is not None:
                self.v_prefill.observe(f.prefill_time)
            if f.decode_time is not None:
                self.v_decode.observe(f.decode_time)
            if f.inference_time is not None:
                self.v_inference.observe(f.inference_time)
            if f.mean_time_per_output_token is not None:
                self.v_request_tpot.observe(f.mean_time_per_output_token)
