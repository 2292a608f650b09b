"""The engine: one ``step()`` = schedule -> execute -> sample -> update -> detokenize.

Single-threaded by design; the server runs it in its own thread behind a queue
(:mod:`kvpilot.engine.server.async_engine`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpilot.engine.config import EngineArgs, ResolvedConfig
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_events import BlockHasher, KVEventCollector
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.kv_events import EventPublisher, make_publisher
from kvpilot.engine.lora.adapter import LoRAWeights
from kvpilot.engine.lora.manager import LoRAManager
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.model_runner import LoadedModel, ModelRunner
from kvpilot.engine.outputs import (
    FinishedRequestStats,
    IterationStats,
    RequestOutput,
    SchedulerStats,
    TokenLogprob,
)
from kvpilot.engine.sampler import Sampler, SamplerOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.structured_output import GrammarCompiler, GrammarState, StructuredOutputsParams
from kvpilot.engine.tp_executor import TPExecutor, load_with_workers

logger = logging.getLogger(__name__)


class _NoText:
    """Detokenizer stand-in for an engine without a tokenizer: token ids only, no text."""

    output_text = ""

    def add_tokens(self, token_ids: Sequence[int]) -> None:
        return None

    def take_delta(self, finished: bool) -> str:
        return ""


def _eos_ids(model_eos: Sequence[int], tokenizer: object, source_path: object) -> tuple[int, ...]:
    ids = list(model_eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in ids:
        ids.append(tok_eos)
    gen_cfg = getattr(source_path, "joinpath", None)
    if gen_cfg is not None:
        path = source_path.joinpath("generation_config.json")  # type: ignore[attr-defined]
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            for t in eos if isinstance(eos, list) else [eos] if eos is not None else []:
                if t not in ids:
                    ids.append(t)
    return tuple(ids)


class LLMEngine:
    """Owns the scheduler, the model runner, the sampler and per-request detokenizers,
    and with tensor parallelism the executor of the worker processes (vLLM v1's layout:
    the engine owns the executor, the executor the workers, each rank one model runner).

    Args:
        args: engine settings.
        clock: seconds (monotonic); latencies in stats use it.
        loaded: an already loaded model to share (its device and dtype must match
            ``args``); loaded from ``args.model`` when None.
        kv_event_publisher: where each step's KV cache events go when
            ``args.kv_events_config`` turns them on (the server passes the one it started
            and stops it itself). When None and events are on, the engine makes and starts
            the publisher the config names and stops it in :meth:`close`.

    Attributes:
        kv_events: the collector the radix cache reports to (None: events off).
        tp_executor: the tensor-parallel workers this engine started (None: one rank, or
            a shared ``loaded``).
    """

    def __init__(
        self,
        args: EngineArgs,
        clock: Callable[[], float] = time.monotonic,
        loaded: LoadedModel | None = None,
        kv_event_publisher: EventPublisher | None = None,
    ) -> None:
        self.args = args
        self.clock = clock
        self.kv_events: KVEventCollector | None = None
        self._kv_publisher: EventPublisher | None = None
        self._owns_kv_publisher = False
        self._owned_load: LoadedModel | None = None  # loaded here: closed by close()
        self.tp_executor: TPExecutor | None = None  # started here: shut down by close()
        kv_cfg = args.kv_events_config
        if kv_cfg is not None and kv_cfg.enable_kv_cache_events:
            # Bound before the weights load: a port in use fails start-up at once.
            hasher = BlockHasher(args.prefix_caching_hash_algo)
            logger.info("KV events: block hashes %s, NONE_HASH seed from %s", hasher.algo, hasher.seed_source)
            self.kv_events = KVEventCollector(args.block_size, hasher)
            if kv_event_publisher is None:
                own = make_publisher(kv_cfg)
                own.start()
                kv_event_publisher, self._owns_kv_publisher = own, True
            self._kv_publisher = kv_event_publisher
        try:
            self._init(args, loaded)
        except BaseException:
            self.close()
            raise

    def _init(self, args: EngineArgs, loaded: LoadedModel | None) -> None:
        clock = self.clock
        if loaded is None:
            loaded, self.tp_executor = load_with_workers(args)
            self._owned_load = loaded
        self.loaded = loaded
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        source = self.loaded.source
        self.eos_token_ids = _eos_ids(
            self.model_config.eos_token_ids, self.tokenizer, source.path if source.kind == "hf" else None
        )
        self.runner = ModelRunner(args, self.loaded)
        cfg: ResolvedConfig = self.runner.resolved
        self.config = cfg
        window = self.model_config.sliding_window if self.model_config.all_layers_slide else None
        if self.kv_events is not None:
            self.kv_events.set_sliding_window(window)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=cfg.max_model_len,
                # EngineArgs' LoRA fields may not exist yet in every build: getattr.
                max_loras=args.max_loras if args.enable_lora else 0,
            ),
            KVCacheManager(cfg.num_blocks, cfg.block_size, args.enable_prefix_caching, self.kv_events,
                           sliding_window=window),
            clock,
        )
        self.lora: LoRAManager | None = self.runner.lora
        self.sampler = Sampler(cfg.device, args.seed, vocab_size=self.model_config.vocab_size)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._detok: dict[str, Any] = {}
        self._prompt_len: dict[str, int] = {}
        self._stats = IterationStats()  # accumulates until take_stats()
        self._stats_preemptions = 0
        self._stats_prefix = (0, 0)

    # ------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        grammar: Any = None,
        lora_request: LoRARequest | None = None,
        lora_weights: LoRAWeights | None = None,
    ) -> None:
        """Queue one sequence (``params.n`` is handled by the caller's fan-out).

        Args:
            grammar: the compiled grammar of ``params.structured_outputs``
                (:meth:`compile_grammar`, which the server runs off its event loop);
                compiled here when None.
            lora_request: the adapter to run with (None: the base model).
            lora_weights: its host weights (:meth:`LoRAManager.acquire`, which the server
                runs off its event loop); acquired here when None (may read the disk).

        Raises:
            InvalidRequestError: empty or too-long prompt, prompt, stop or logit-bias
                token ids outside the vocabulary, a grammar that cannot be compiled,
                duplicate id; the engine state is unchanged.
        """
        self.check_request(prompt_token_ids, params)
        if lora_request is not None:
            if self.lora is None:
                raise InvalidRequestError(f"model: {lora_request.lora_name!r} is a LoRA adapter, and this engine "
                                          "runs without adapters (--enable-lora)", "model")
            if lora_weights is None:
                lora_weights = self.lora.acquire(lora_request)
            elif lora_weights.int_id != lora_request.lora_int_id:
                raise ValueError(f"lora_weights are adapter {lora_weights.int_id}'s, not {lora_request.lora_int_id}'s")
        state = None
        if params.structured_outputs is not None:
            compiled = grammar if grammar is not None else self.compile_grammar(params.structured_outputs)
            state = GrammarState(compiled, params.structured_outputs,
                                 (*self.eos_token_ids, *params.stop_token_ids) if not params.ignore_eos else ())
        req = Request(
            request_id,
            [int(t) for t in prompt_token_ids],
            params,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            lora_request=lora_request,
        )
        req.grammar = state
        req.lora_weights = lora_weights
        self.scheduler.add_request(req)
        if self.tokenizer is None:
            self._detok[request_id] = _NoText()
        else:
            # Imported here: the `tokenizers` package is not needed for token-id-only use.
            from kvpilot.engine.detokenizer import IncrementalDetokenizer

            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """The checks :meth:`add_request` makes before queueing anything (the render
        endpoints run them too, so they refuse what generation would refuse). Reads
        only immutable model facts: safe from any thread.

        Raises:
            InvalidRequestError: a prompt or stop token id outside the vocabulary, or
                stop strings on an engine without a tokenizer.
        """
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        bad = next((t for t in params.stop_token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})", "stop_token_ids"
            )
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError("stop strings need a tokenizer; this engine runs without one", "stop")
        bad = next((t for t, _ in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})", "logit_bias")
        so = params.structured_outputs
        if so is not None and self.tokenizer is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this engine runs without one", so.param)

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """Compile a structured-output constraint for this model's tokenizer (cached by
        schema; thread-safe: the server calls it from worker threads).

        Raises:
            InvalidRequestError: no tokenizer, or the schema/regex/grammar cannot be compiled.
        """
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this engine runs without one", params.param)
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammar_compiler.compile(params)

    def abort_request(self, request_ids: Sequence[str]) -> list[str]:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed
        now. Returns the ids that were aborted."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        now = self.clock()
        for req in done:
            self._release(req)
            self._stats.finished.append(self._finished_stats(req, now))
        return [r.request_id for r in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step. Returns outputs of requests that got tokens (or
        finished). Statistics accumulate until :meth:`take_stats`."""
        stats = self._stats
        sched_out = self.scheduler.schedule()
        stats.num_batched_tokens += sched_out.num_batched_tokens
        self._collect_scheduler_deltas(stats)
        if sched_out.is_empty:
            self._publish_kv_events()
            return []
        if self.lora is not None:
            group_by_adapter(sched_out)
        if self.tp_executor is None:
            logits = self.runner.execute(sched_out)
        else:  # the workers get the step first; raises WorkerDiedError when one is gone
            logits = self.tp_executor.execute_model(self.runner, sched_out)
        sampling = [it.request for it in sched_out.scheduled if it.sample]
        sampled = self.sampler(logits, sampling) if sampling else None
        tokens: list[int | None] = []
        row_of: dict[str, int] = {}
        k = 0
        for it in sched_out.scheduled:
            if it.sample:
                assert sampled is not None
                tokens.append(sampled.token_ids[k])
                row_of[it.request.request_id] = k
                k += 1
            else:
                tokens.append(None)
        now = self.clock()
        # Rows that could not sample (a grammar with no allowed token) end with an error
        # before update(), which skips requests that are no longer running.
        failed = [self._fail(sampling[row], msg, now) for row, msg in sampled.errors.items()] if sampled else []
        touched = self.scheduler.update(sched_out, tokens)
        self._publish_kv_events()
        now = self.clock()
        outputs = []
        for req in touched:
            if req.grammar is not None and not req.grammar.accept(req.output_token_ids[-1]):
                # The bitmask allowed it, so this is a bug: end this request, serve the rest.
                logger.error("%s: the grammar refused token %d that its bitmask allowed",
                             req.request_id, req.output_token_ids[-1])
                failed.append(self._fail(req, f"internal error: the grammar refused token "
                                         f"{req.output_token_ids[-1]}", now))
                continue
            outputs.append(self._make_output(req, sampled, row_of[req.request_id], now, stats))
        return failed + outputs

    def _fail(self, req: Request, message: str, now: float) -> RequestOutput:
        """End ``req`` (aborted, blocks freed) with ``message``; its final output carries
        the error (the server answers it as an invalid request)."""
        self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
        detok = self._detok.get(req.request_id)
        self._release(req)
        self._stats.finished.append(self._finished_stats(req, now))
        so = req.sampling_params.structured_outputs
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            new_text="",
            new_logprobs=None,
            output_text=detok.output_text if detok is not None else "",
            output_token_ids=req.output_token_ids,
            finished=True,
            finish_reason="abort",
            stop_reason=None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=f"{so.param if so else 'request'}: {message}",
        )

    def _publish_kv_events(self) -> None:
        """Hand this step's KV cache events (evictions while scheduling, stores while
        updating, and anything since the last step) to the publisher as one batch."""
        collector = self.kv_events
        if collector is not None and collector.events:
            assert self._kv_publisher is not None
            self._kv_publisher.publish(collector.drain())

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds (vLLM's ``reset_prefix_cache``) and
        publish the resulting events at once. Returns how many blocks were dropped."""
        dropped = self.scheduler.kv.reset_prefix_cache()
        self._publish_kv_events()
        return dropped

    def close(self) -> None:
        """Stop the KV event publisher and the tensor-parallel workers if this engine
        started them (idempotent)."""
        if self._owns_kv_publisher and self._kv_publisher is not None:
            self._kv_publisher.shutdown()
            self._owns_kv_publisher = False
        if self.tp_executor is not None:
            self.tp_executor.shutdown()
        if self._owned_load is not None:
            self._owned_load.close()

    @property
    def fatal_error(self) -> str | None:
        """Why this engine cannot run another step (a tensor-parallel worker ended), or
        None. The server then fails ``/health`` and exits non-zero."""
        return None if self.tp_executor is None else self.tp_executor.dead

    def _collect_scheduler_deltas(self, stats: IterationStats) -> None:
        s = self.scheduler
        stats.num_preemptions += s.num_preemptions_total - self._stats_preemptions
        self._stats_preemptions = s.num_preemptions_total
        q0, h0 = self._stats_prefix
        stats.prefix_queries += s.prefix_stats.queries - q0
        stats.prefix_hits += s.prefix_stats.hits - h0
        self._stats_prefix = (s.prefix_stats.queries, s.prefix_stats.hits)

    def _make_output(self, req: Request, sampled: SamplerOutput | None, row: int, now: float, stats: IterationStats) -> RequestOutput:
        token = req.output_token_ids[-1]
        # Timing.
        stats.num_generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            stats.time_to_first_token.append(now - req.arrival_time)
            stats.num_prompt_tokens += req.num_prompt_tokens
        else:
            stats.inter_token_latency.append(now - (req.last_token_time or now))
        req.last_token_time = now
        # Logprobs.
        new_lp = None
        if req.sampling_params.logprobs is not None:
            # A request that asked for logprobs sampled its token with them.
            assert sampled is not None
            logprob = sampled.logprobs[row]
            assert logprob is not None
            new_lp = [TokenLogprob(token, logprob, sampled.top_logprobs[row] or [])]
        # Text and stop strings. A stop token / EOS contributes no text.
        detok = self._detok[req.request_id]
        stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED and (
            req.stop_reason is not None or token in req.eos_token_ids
        )
        if not stopped_by_token or req.sampling_params.include_stop_str_in_output:
            matched = detok.add_tokens([token])
            if matched is not None and not req.is_finished:
                req.stop_reason = matched
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
            elif matched is not None and req.status == RequestStatus.FINISHED_LENGTH:
                # The stop string completed on the last allowed token: the text is cut
                # at the stop, so the reason is the stop (as vLLM reports it), not length.
                req.stop_reason = matched
                req.status = RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and not req.grammar.active:
            req.grammar.update_active(detok.output_text)
        finished = req.is_finished
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=detok.take_delta(finished),
            new_logprobs=new_lp,
            output_text=detok.output_text,
            output_token_ids=req.output_token_ids,
            finished=finished,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=req.prompt_logprobs if req.num_output_tokens == 1 else None,
        )
        if finished:
            self._release(req)
            stats.finished.append(self._finished_stats(req, now))
        return out

    def _finished_stats(self, req: Request, now: float) -> FinishedRequestStats:
        """The finished request's statistics (seconds; phases as vLLM's, see
        :class:`FinishedRequestStats`). A request that produced no token has no prefill,
        decode or inference time."""
        scheduled, first, last = req.first_scheduled_time, req.first_token_time, req.last_token_time
        queue = (scheduled - req.arrival_time) if scheduled is not None else now - req.arrival_time
        n_out = req.num_output_tokens
        prefill = decode = inference = tpot = None
        if scheduled is not None and first is not None and last is not None:
            prefill, decode, inference = first - scheduled, last - first, last - scheduled
            tpot = (last - first) / (n_out - 1) if n_out > 1 else None
        max_tokens = req.sampling_params.max_tokens
        return FinishedRequestStats(
            finish_reason=req.status.finish_reason or "abort",
            e2e_latency=now - req.arrival_time,
            queue_time=queue,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=n_out,
            prefill_time=prefill,
            decode_time=decode,
            inference_time=inference,
            mean_time_per_output_token=tpot,
            max_tokens=max_tokens if max_tokens is not None else self.config.max_model_len - req.num_prompt_tokens,
        )

    def _release(self, req: Request) -> None:
        self._detok.pop(req.request_id, None)
        self.sampler.release(req.request_id)

    # --------------------------------------------------------------- stats
    def take_stats(self) -> IterationStats:
        """Statistics since the previous call (steps and aborts), exactly once; the LoRA
        adapters with running and waiting requests are a snapshot taken now."""
        stats, self._stats = self._stats, IterationStats()
        s = self.scheduler
        stats.running_lora_adapters = tuple(s.running_lora_names())
        stats.waiting_lora_adapters = tuple(s.waiting_lora_names())
        return stats

    def scheduler_stats(self) -> SchedulerStats:
        s = self.scheduler
        kv = s.kv
        return SchedulerStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_waiting_tokens=s.num_waiting_tokens,
            kv_cache_usage=kv.usage,
            prefix_cache_hit_rate=s.prefix_stats.hit_rate,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.pool.num_free,
            num_cached_blocks=kv.num_cached_blocks,
        )

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name


def group_by_adapter(out: SchedulerOutput) -> None:
    """Order the step's decodes, and its prefill chunks, by adapter (stable: the base
    model first), so that each adapter's rows are one contiguous range of the step and the
    CPU products need no gather or scatter (:mod:`kvpilot.engine.lora.ops`). Decodes stay
    first. Every later use of the step (inputs, sampling rows, the scheduler's update)
    reads this order. Mutates ``out.scheduled``."""
    nd = out.num_decodes
    items = out.scheduled
    items[:nd] = sorted(items[:nd], key=lambda it: it.request.lora_int_id)
    items[nd:] = sorted(items[nd:], key=lambda it: it.request.lora_int_id)
