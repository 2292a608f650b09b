"""The scheduler: one token budget per step, shared by decodes and prefill chunks.

There are no prefill and decode phases (vLLM v1's framing): every running request has
``num_computed_tokens`` catching up with ``num_tokens``, and each step hands out at most
``max_num_batched_tokens`` tokens of work:

1. running requests that are decoding (one token each), oldest first: they always go
   first, so long prompts never stall decodes;
2. running requests still prefilling, a chunk each from what is left of the budget;
3. waiting requests (FCFS), admitted only if blocks for their whole prompt fit. A
   waiting request whose next few uncached blocks are being computed right now by a
   running request is passed over until they are published, so a burst of requests
   sharing a long system prompt computes it once instead of once per request. With
   LoRA on (``max_loras > 0``), a waiting request whose adapter would make the running
   batch hold more than ``max_loras`` distinct adapters is passed over too (it keeps its
   place in the queue) and admission goes on with the requests behind it, as vLLM's v1
   scheduler does with its ``scheduled_loras`` (``vllm/v1/core/sched/scheduler.py``).

Admission reserves blocks for the whole prompt, so a prefill chunk never runs out of
blocks mid-prompt; only decodes grow. When a decode cannot grow, the newest running
request is preempted by recompute (its published blocks stay in the prefix cache, so
the recompute is mostly a cache hit). No request is admitted in a step that preempted,
and admission keeps a small reserve of blocks for running requests to grow into, which
stops a preempted request from being re-admitted only to be preempted again.

When every layer of the model slides (the KV cache manager has a ``sliding_window``),
each update also frees the blocks the window has left behind
(:meth:`KVCacheManager.free_skipped`), so a long generation holds bounded memory.

The scheduler is plain Python: no device calls, so it is tested block by block on CPU.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvpilot.engine.core.block_pool import CacheIntegrityError
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits on one step's work.

    Attributes:
        max_num_batched_tokens: token budget per step (decodes + prefill chunks).
        max_num_seqs: running requests at most (<= max_num_batched_tokens).
        max_model_len: prompt + output tokens per request at most.
        watermark: share of the pool kept free when admitting while others run.
        defer_shared_prefix_blocks: a waiting request whose next ``n`` or more uncached
            blocks are being computed right now by a running request waits until they
            are published, then hits them instead of computing them twice (0 = off).
        max_loras: distinct LoRA adapters among the running requests at most (vLLM's
            ``--max-loras``); 0: LoRA is off and a request with an adapter is refused.
            Base-model requests never count.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    watermark: float = 0.01
    defer_shared_prefix_blocks: int = 4
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running request must be able to "
                "decode one token per step"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.defer_shared_prefix_blocks < 0:
            raise ValueError(f"defer_shared_prefix_blocks must be >= 0, got {self.defer_shared_prefix_blocks}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0 (0: LoRA off), got {self.max_loras}")


@dataclass
class ScheduledRequest:
    """One request's work for this step.

    Attributes:
        request: the request (read-only for the model runner and the sampler).
        token_ids: input token ids to compute, ``[num_tokens]``.
        start_position: position of ``token_ids[0]`` (= computed tokens before the step).
        slot_mapping: ``[num_tokens]`` flat KV slots (``block_id * block_size + offset``)
            where each token's K/V is written; -1 = already cached, do not write.
        sample: the chunk reaches the request's last token, so a token is sampled.
    """

    request: Request
    token_ids: list[int]
    start_position: int
    slot_mapping: list[int]
    sample: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_ids(self) -> list[int]:
        return self.request.block_ids


@dataclass
class SchedulerOutput:
    """The only hand-off from the scheduler to the model runner.

    Attributes:
        scheduled: requests with work this step; the first ``num_decodes`` have exactly
            one token each (decodes), the rest are prefill chunks.
        num_decodes: how many leading entries are single-token.
        num_batched_tokens: total tokens this step (<= the budget).
        preempted_ids: requests preempted during this step.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_decodes: int = 0
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class PrefixCacheStats:
    """Prefix cache counters in tokens; only first admissions count (recomputation
    after preemption is not a hit). ``hit_rate`` covers the most recent
    ``window_requests`` admissions."""

    def __init__(self, window_requests: int = 1000) -> None:
        self.queries = 0
        self.hits = 0
        self._window: deque[tuple[int, int]] = deque(maxlen=window_requests)

    def record(self, queries: int, hits: int) -> None:
        self.queries += queries
        self.hits += hits
        self._window.append((queries, hits))

    @property
    def hit_rate(self) -> float:
        q = sum(x for x, _ in self._window)
        return sum(h for _, h in self._window) / q if q else 0.0


class RequestRejectedError(InvalidRequestError):
    """A request that can never be served (too long for the model or the KV pool)."""


class Scheduler:
    """Decides each step's work.

    Args:
        config: step limits.
        kv_cache: the block manager (owned by the scheduler from now on).
        clock: seconds, for queue-time stamps.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv_cache
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.prefix_stats = PrefixCacheStats()
        self.num_preemptions_total = 0
        capacity = kv_cache.num_blocks * kv_cache.block_size
        if config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is larger than the KV cache "
                f"({kv_cache.num_blocks} blocks x {kv_cache.block_size} = {capacity} tokens); "
                "lower --max-model-len or give the cache more memory"
            )
        self.watermark_blocks = max(1, int(config.watermark * kv_cache.num_blocks))

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request, or reject it at once if it can never fit.

        Raises:
            RequestRejectedError: empty prompt, or prompt (+ max_tokens) longer than
                ``max_model_len``; the message names both numbers.
            ValueError: the request has a LoRA adapter but ``max_loras`` is 0 (LoRA is
                off: the engine must refuse such a request before it gets here).
        """
        if request.lora_request is not None and self.config.max_loras == 0:
            raise ValueError(
                f"request {request.request_id!r} has LoRA adapter {request.lora_request.lora_name!r}, "
                "but the scheduler's max_loras is 0 (LoRA is off)"
            )
        n = request.num_prompt_tokens
        limit = self.config.max_model_len
        if n == 0:
            raise RequestRejectedError("the prompt is empty: at least one token is required", "prompt")
        if n >= limit:
            raise RequestRejectedError(
                f"the prompt has {n} tokens, but this model's maximum context length "
                f"(max_model_len) is {limit} tokens, which must also leave room for one "
                f"output token (KV pool: {self.kv.num_blocks * self.kv.block_size} tokens)",
                "prompt",
            )
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and n + max_tokens > limit:
            raise RequestRejectedError(
                f"the prompt has {n} tokens and max_tokens is {max_tokens} ({n + max_tokens} in "
                f"all), but this model's maximum context length is {limit} tokens; "
                f"lower max_tokens to at most {limit - n}",
                "max_tokens",
            )
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) the given requests and free their
        blocks. Unknown or already finished ids are ignored. Returns the requests."""
        assert status.is_finished
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self.kv.free(req)
            req.status = status
            done.append(req)
        return done

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens not yet prefilled, over waiting and partially prefilled requests; a
        preempted request counts its generated tokens too (they are recomputed)."""
        total = sum(r.num_tokens for r in self.waiting)
        total += sum(r.num_tokens - r.num_computed_tokens for r in self.running if r.is_prefilling)
        return total

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def running_lora_ids(self) -> set[int]:
        """The ``lora_int_id`` of every adapter with a running request (what
        ``max_loras`` bounds)."""
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def running_lora_names(self) -> list[str]:
        """Names of the adapters with at least one running request, sorted (vLLM's
        ``running_lora_adapters``)."""
        return sorted({r.lora_request.lora_name for r in self.running if r.lora_request is not None})

    def waiting_lora_names(self) -> list[str]:
        """Names of the adapters with at least one waiting request (preempted ones
        included), sorted (vLLM's ``waiting_lora_adapters``)."""
        return sorted({r.lora_request.lora_name for r in self.waiting if r.lora_request is not None})

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Mutates block tables, queues and request states."""
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledRequest] = []
        chunks: list[ScheduledRequest] = []
        preempted: list[str] = []

        # 1. Decodes, oldest first; preempt the newest running request when out of blocks.
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or req.is_prefilling:
                continue
            n = req.num_tokens - req.num_computed_tokens
            while not self.kv.grow(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            decodes.append(self._make_scheduled(req, n))
            budget -= n

        # 2. Running prefills continue, a chunk each (their blocks are already reserved).
        for req in self.running:
            if budget <= 0:
                break
            if req.is_prefilling:
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                chunks.append(self._make_scheduled(req, n))
                budget -= n

        # 3. Admit waiting requests (none in a step that had to preempt), FCFS except
        #    that a request whose prefix is being computed right now waits for it, and
        #    one whose adapter would exceed max_loras waits for a running adapter to go.
        #    Preempted requests resume through this same loop.
        defer = bool(self.config.defer_shared_prefix_blocks) and self.kv.enable_prefix_caching
        inflight = self._inflight_block_hashes() if defer else set()
        max_loras = self.config.max_loras
        loras = self.running_lora_ids() if max_loras else set()
        i = 0
        while not preempted and i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            lora_id = req.lora_int_id
            if lora_id and lora_id not in loras and len(loras) >= max_loras:
                i += 1  # vLLM's skip: the request keeps its place, admission goes on
                continue
            nodes, num_hit = self.kv.match_prefix(req)
            if req.needs_prompt_logprobs:  # every prompt position must be computed for its logprobs
                nodes, num_hit = [], 0
            if inflight and self._prefix_in_flight(req, len(nodes), inflight):
                i += 1
                continue
            reserve = self.watermark_blocks + len(self.running) if self.running else 0
            if not self.kv.can_admit(req, nodes, reserve):
                break
            del self.waiting[i]
            self.kv.admit(req, nodes, num_hit)
            if defer:
                inflight.update(self._unpublished_hashes(req))
            if req.num_preemptions == 0:
                self.prefix_stats.record(req.num_tokens, num_hit)
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = self.clock()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if lora_id:
                loras.add(lora_id)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            item = self._make_scheduled(req, n)
            (decodes if n == 1 else chunks).append(item)
            budget -= n

        scheduled = decodes + chunks
        return SchedulerOutput(
            scheduled=scheduled,
            num_decodes=len(decodes),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=preempted,
        )

    # ------------------------------------------------- in-batch prefix sharing
    def _unpublished_hashes(self, req: Request) -> list[int]:
        bs = self.kv.block_size
        return req.block_hashes(bs, self.kv.num_publishable_blocks(req))[req.num_published_blocks :]

    def _inflight_block_hashes(self) -> set[int]:
        """Chain hashes of full blocks that running requests will publish but have not
        yet (their KV is not written)."""
        out: set[int] = set()
        for req in self.running:
            out.update(self._unpublished_hashes(req))
        return out

    def _prefix_in_flight(self, req: Request, num_matched: int, inflight: set[int]) -> bool:
        """Whether the ``defer_shared_prefix_blocks`` blocks after the cached prefix are
        being computed by someone else (SGLang's in-batch prefix check, by chain hash)."""
        bs = self.kv.block_size
        need = self.config.defer_shared_prefix_blocks
        if req.num_tokens // bs < num_matched + need:
            return False
        hashes = req.block_hashes(bs, num_matched + need)
        return all(h in inflight for h in hashes[num_matched:])

    def _make_scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        bs = self.kv.block_size
        blocks = req.block_ids
        skip_below = req.num_prefix_kv_tokens
        slots = [
            -1 if p < skip_below else blocks[p // bs] * bs + p % bs for p in range(start, start + n)
        ]
        return ScheduledRequest(
            request=req,
            token_ids=req.token_ids[start : start + n],
            start_position=start,
            slot_mapping=slots,
            sample=start + n == req.num_tokens,
        )

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: release blocks, back to the head of the queue."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    # --------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int | None]) -> list[Request]:
        """Apply a finished step. ``sampled_token_ids[i]`` is the new token of
        ``output.scheduled[i]`` (None where ``sample`` is False).

        Advances ``num_computed_tokens``, publishes full blocks to the prefix cache,
        frees blocks behind an all-layer sliding window, appends tokens, applies
        token-level stops and frees finished requests.
        Returns the requests that got a token this step (finished ones included).
        """
        touched: list[Request] = []
        for item, token in zip(output.scheduled, sampled_token_ids, strict=True):
            req = item.request
            if req.status != RequestStatus.RUNNING:
                continue  # finished between schedule() and update()
            req.num_computed_tokens += item.num_tokens
            self.kv.publish(req)
            self.kv.free_skipped(req)
            if not item.sample:
                continue
            assert token is not None
            req.append_output_token(int(token))
            touched.append(req)
            status = req.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish_requests([req.request_id], status)
        return touched

    def check_integrity(self) -> None:
        """Block accounting invariants over all live requests (tests after every step,
        the server whenever the engine goes idle): the KV cache manager's checks, no
        waiting request holding blocks, at most ``max_num_seqs`` running, at most
        ``max_loras`` distinct adapters running (none with LoRA off).

        Raises:
            CacheIntegrityError: an invariant does not hold; the message names the numbers.
        """
        self.kv.check_integrity(self.requests.values())
        for req in self.waiting:
            if req.block_ids:
                raise CacheIntegrityError(f"waiting {req.request_id} holds blocks {req.block_ids}")
        if len(self.running) > self.config.max_num_seqs:
            raise CacheIntegrityError(
                f"{len(self.running)} requests running, max_num_seqs is {self.config.max_num_seqs}"
            )
        loras = self.running_lora_ids()
        if len(loras) > self.config.max_loras:
            raise CacheIntegrityError(
                f"{len(loras)} distinct LoRA adapters running (ids {sorted(loras)}), "
                f"max_loras is {self.config.max_loras}"
            )
