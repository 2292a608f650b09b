"""What the engine reports each step, per request, and its per-step statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Logprob of one generated token and the top alternatives (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """One request's progress after a step.

    ``new_*`` fields are the delta of this step (for streaming); ``output_text`` and
    ``output_token_ids`` are cumulative. ``finish_reason`` is ``stop``, ``length`` or
    ``abort`` once ``finished``; ``stop_reason`` is the stop string or token id that
    matched (None for EOS). ``error`` is set on the final output of a request the engine
    had to end because of what it asked (a grammar that allows no token): the
    message names the field. ``prompt_logprobs`` comes with the first output of a
    request that asked for it: entry ``i`` is prompt token ``i + 1``'s
    ``(logprob, rank, top alternatives)``.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    output_text: str
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class FinishedRequestStats:
    """One engine request that finished (stopped, hit its length, or was aborted), for
    metrics. Times are seconds on the engine's clock; the phases follow vLLM's
    (``vllm/v1/metrics/stats.py``), with preemptions counted inside the phase they hit.

    Attributes:
        finish_reason: ``stop``, ``length`` or ``abort``.
        e2e_latency: seconds, arrival to finish.
        queue_time: seconds, arrival to first scheduling (to the finish for a request
            aborted before it was ever scheduled).
        num_prompt_tokens: prompt tokens.
        num_generation_tokens: output tokens generated.
        prefill_time: seconds, first scheduling to first token; None when the request
            produced no token.
        decode_time: seconds, first token to last token (0 for one token); None when the
            request produced no token.
        inference_time: seconds, first scheduling to last token (prefill + decode); None
            when the request produced no token.
        mean_time_per_output_token: seconds, ``decode_time / (num_generation_tokens - 1)``
            (the first token belongs to the prefill); None with fewer than 2 tokens, as
            there is no interval to average.
        max_tokens: tokens, the request's output limit: ``max_tokens`` when set, else
            what ``max_model_len`` leaves after the prompt.
    """

    finish_reason: str
    e2e_latency: float
    queue_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    mean_time_per_output_token: float | None = None
    max_tokens: int | None = None


@dataclass
class IterationStats:
    """Deltas of one step, for metrics.

    Attributes:
        num_prompt_tokens: prompt tokens of requests that produced their first token.
        num_generation_tokens: tokens generated this step.
        time_to_first_token: seconds, one per first token.
        inter_token_latency: seconds between consecutive tokens of a request.
        finished: requests that finished (steps and aborts), one entry each.
        num_preemptions: preemptions during this step.
        prefix_queries, prefix_hits: prefix-cache tokens (first admissions only).
        num_batched_tokens: tokens the scheduled steps computed (prefill chunks and
            decodes); 0 when no step ran since the last :meth:`LLMEngine.take_stats`.
        running_lora_adapters, waiting_lora_adapters: names of the LoRA adapters with
            running / waiting requests when the statistics were taken (a snapshot, not
            a delta; sorted; empty without adapters), as vLLM's scheduler stats report
            them for ``vllm:lora_requests_info``.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_batched_tokens: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass
class SchedulerStats:
    """Gauges sampled after a step."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
