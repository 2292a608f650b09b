"""A request's scheduling state: tokens, progress, block table and finish status."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpilot.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpilot.engine.core.radix_cache import RadixNode
    from kvpilot.engine.lora.request import LoRARequest
    from kvpilot.engine.structured_output import GrammarState


CacheNamespace = tuple[str | None, str | None]
"""``(lora_name, cache_salt)``: which requests may share prefix-cache blocks. vLLM v1
mixes the same two keys, the LoRA name first, into its block hashes
(``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``)."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, blocks released, will recompute
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` (``stop``, ``length``, ``abort``) or None."""
        return self.value if self.is_finished else None


class Request:
    """One sequence being generated.

    There is no prefill or decode phase: ``num_computed_tokens`` (tokens whose KV is in
    the cache) catches up with ``num_tokens`` (prompt + output so far). The request is
    *prefilling* while more than one token is missing.

    Attributes:
        block_ids: the block table; block ``i`` holds positions ``[i*bs, (i+1)*bs)``.
        num_prefix_kv_tokens: positions whose KV came from the prefix cache at the last
            admission. A full-prompt hit recomputes the last prompt token for its logits,
            but its KV is already there, so its slot mapping entry is -1 (skip the write
            into a shared block).
        num_published_blocks / last_node: how much of the block table is in the radix
            tree, and the tree node of the last published block.
        num_skipped_blocks: leading block-table entries already freed because every
            layer's sliding window has moved past them (all-sliding models only); those
            entries hold ``NULL_BLOCK`` and no reference
            (:meth:`KVCacheManager.free_skipped`).
        num_cached_tokens: prefix-cache hit at the first admission (reported as usage).
        prompt_logprobs: with ``prompt_logprobs`` asked, entry ``i`` is
            ``(logprob, rank, top)`` of prompt token ``i + 1``: its logprob, its rank in
            the distribution (1 = most likely) and the top alternatives
            ``[(token_id, logprob)]``; filled as prefill chunks compute them.
        grammar: the structured-output matcher (None: free text); advanced by the engine
            over each appended output token.
        lora_request: the adapter the request runs with (None: the base model). Its name
            is part of the prefix-cache namespace (:attr:`cache_namespace`), so requests
            under different adapters (or an adapter and the base) never share KV.
        lora_weights: the adapter's loaded weights, set by the engine and handed to the
            model runner; opaque to the scheduling core, which never reads it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        cache_salt: str | None = None,
        arrival_time: float = 0.0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time
        self.lora_request = lora_request
        self.lora_weights: Any = None  # the engine's LoRAWeights, opaque here

        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_prefix_kv_tokens = 0
        self.block_ids: list[int] = []
        self.num_published_blocks = 0
        self.num_skipped_blocks = 0
        self.last_node: RadixNode | None = None
        self._block_hashes: list[int] = []  # chain hashes of full blocks, see block_hashes()

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        self.grammar: GrammarState | None = None
        self.prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = (
            [] if sampling_params.prompt_logprobs is not None else None)
        # Per-step sampling results, filled by the engine for outputs.
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.sampled_logprobs: list[float] = []
        # Timestamps (seconds on the engine's clock).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def lora_int_id(self) -> int:
        """The adapter's ``lora_int_id``; 0 without one (vLLM's "no adapter")."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def lora_name(self) -> str | None:
        """The adapter's name; None without one."""
        return self.lora_request.lora_name if self.lora_request is not None else None

    @property
    def cache_namespace(self) -> CacheNamespace:
        """The prefix-cache namespace ``(adapter cache key, cache salt)``: the radix tree's
        root and the first link of every block hash. Requests share KV only within one.
        The adapter's key is its name and a digest of its files
        (:attr:`~kvpilot.engine.lora.request.LoRARequest.cache_key`)."""
        return (self.lora_request.cache_key if self.lora_request is not None else None, self.cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked and not all computed yet: the prompt must be
        computed, not taken from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """Chain hashes of the first ``num_blocks`` full blocks: ``h[i]`` identifies the
        prefix ``token_ids[: (i + 1) * block_size]`` within the request's
        :attr:`cache_namespace` (adapter name and cache salt). Computed incrementally and
        cached; used to spot prefixes already being computed (process-local ``hash()``;
        the wire hash is :func:`kvpilot.engine.core.kv_events.block_hash`)."""
        hashes = self._block_hashes
        h = hashes[-1] if hashes else hash(("kvpilot", self.cache_namespace))
        for i in range(len(hashes), num_blocks):
            h = hash((h, tuple(self.token_ids[i * block_size : (i + 1) * block_size])))
            hashes.append(h)
        return hashes[:num_blocks]

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop checks after a token was appended (stop strings are checked
        by the detokenizer). Returns the finished status, or None to continue."""
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and self.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )
