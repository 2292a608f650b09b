"""The engine loop in its own thread, behind an asyncio bridge.

::

    HTTP handlers (event loop)            engine thread
    ──────────────────────────            ─────────────
    add_request() ──inbox (SimpleQueue)──> drain inbox: add / abort
         ^                                 step() -> outputs, stats
         └──── per-request asyncio.Queue <─ loop.call_soon_threadsafe

The thread owns the :class:`LLMEngine`; nothing else touches it. Adds are acknowledged
through a future, so a rejected request (too long, bad ids) raises in the handler that
sent it and nothing is queued. Aborts are applied before the next step, so a client
that disconnects frees its blocks within one step. An exception inside a step fails the
requests of that step with a server error and the loop carries on serving the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    RequestFailedError,
)
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.lora.adapter import LoRAWeights
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle loop sleeps between looks at the inbox (seconds).
IDLE_POLL_SECONDS = 0.05


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    out: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop
    ack: concurrent.futures.Future[Any]
    grammar: Any = None
    lora_request: LoRARequest | None = None
    lora_weights: LoRAWeights | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _AbortAll:
    reason: str


class AsyncEngine:
    """Runs an :class:`LLMEngine` in a daemon thread.

    Args:
        engine_factory: builds the engine inside the thread (model loading happens
            there, so the HTTP server can answer ``/health`` and ``/ready`` meanwhile).
        on_step: called in the engine thread after each step and when idle, with the
            engine (for metrics).
        on_integrity_check: called in the engine thread after each KV cache integrity
            check with True when it passed (for metrics).
    """

    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        on_step: Callable[[LLMEngine], None] | None = None,
        on_integrity_check: Callable[[bool], None] | None = None,
    ) -> None:
        self._factory = engine_factory
        self._on_step = on_step
        self._on_integrity_check = on_integrity_check
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self.num_unfinished = 0  # requests added and not yet finished (read from any thread)
        # KV cache integrity checks run when the engine goes idle: how many, how many
        # failed, and the first failure (which makes is_alive False: /health fails).
        self.integrity_checks = 0
        self.integrity_failures = 0
        self.integrity_error: str | None = None
        # Set when the engine can run no more steps (a tensor-parallel worker ended): the
        # thread fails what is in flight and stops; /health fails; serve exits 1.
        self.fatal_error: str | None = None

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()  # tensor-parallel workers, a publisher the engine started

    @property
    def is_alive(self) -> bool:
        """The engine thread runs (loading counts), has not failed to load, and its KV
        cache passed every integrity check (a broken block pool would serve wrong KV: a
        failed liveness probe lets Kubernetes restart the pod)."""
        return (self._thread.is_alive() and self.load_error is None and self.integrity_error is None
                and self.fatal_error is None)

    @property
    def failure(self) -> str:
        """Why the engine is not alive, for /health (empty while it is)."""
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.integrity_error is not None:
            return f"the KV cache integrity check failed: {self.integrity_error}"
        if self.fatal_error is not None:
            return f"the engine stopped: {self.fatal_error}"
        if not self._thread.is_alive():
            return "the engine thread stopped"
        return ""

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.is_alive

    # --------------------------------------------------------------- requests
    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        out: asyncio.Queue[Any] | None = None,
        grammar: Any = None,
        lora_request: LoRARequest | None = None,
        lora_weights: LoRAWeights | None = None,
    ) -> asyncio.Queue[Any]:
        """Queue a request; returns the queue its :class:`RequestOutput` s arrive on (the
        last one has ``finished``; an exception object means it failed: an
        :class:`InvalidRequestError` when the engine ended it because of what it asked,
        such as a grammar that allows no token). Several requests may share one ``out``
        queue (outputs carry their request id). ``grammar`` is the compiled grammar of
        ``params.structured_outputs`` (compiled by the caller, off the engine thread).
        ``lora_request`` is the LoRA adapter it runs with (None: the base model) and
        ``lora_weights`` that adapter's host weights (``LoRAManager.acquire``, fetched by
        the caller off the engine thread, so the engine loop never reads a disk).

        Raises:
            InvalidRequestError: the engine refused the request (nothing was queued).
            EngineDeadError: the engine is not running.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        out = asyncio.Queue() if out is None else out
        ack: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put(_Add(request_id, prompt_token_ids, params, cache_salt, out, loop, ack, grammar,
                             lora_request, lora_weights))
        await asyncio.wrap_future(ack)
        return out

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (thread-safe; unknown or finished ids are ignored)."""
        if request_ids:
            self._inbox.put(_Abort(list(request_ids)))

    def abort_all(self, reason: str) -> None:
        """Abort every request in flight (thread-safe); each stream ends with a
        :class:`RequestAbortedError` carrying ``reason`` (the drain deadline uses this)."""
        self._inbox.put(_AbortAll(reason))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. Leaving the iteration early (a client went
        away, the task was cancelled) aborts the request."""
        out = await self.add_request(request_id, prompt_token_ids, params, cache_salt)
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort([request_id])

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # report any load failure to the server
            self.load_error = e
            logger.exception("engine failed to load")
            return
        self.ready.set()
        engine = self.engine
        was_busy = False
        while not self._stop.is_set():
            self._drain_inbox(engine, block=not engine.has_unfinished_requests())
            if self._stop.is_set():
                break
            fatal = getattr(engine, "fatal_error", None)  # a worker ended while idle (or mid-step)
            if fatal is not None:
                self._die(engine, fatal)
                return
            if engine.has_unfinished_requests():
                self._step(engine)
                was_busy = True
            else:
                if was_busy:  # just went idle: a good moment for the integrity check
                    was_busy = False
                    self._check_integrity(engine)
                if self._on_step is not None:
                    self._on_step(engine)

    def _die(self, engine: LLMEngine, reason: str) -> None:
        """Fail every request in flight with ``reason`` and mark the engine dead (the thread
        then returns: nothing is accepted any more)."""
        logger.error("the engine cannot continue (%s): failing %d requests in flight", reason, len(self._streams))
        self.fatal_error = reason
        ids = list(self._streams)
        for rid in ids:
            self._finish_stream(rid, RequestFailedError(f"the engine stopped: {reason}"))
        try:
            item = self._inbox.get_nowait()
            while True:  # requests that were being added: refuse them
                if isinstance(item, _Add):
                    item.ack.set_exception(EngineDeadError(f"the engine stopped: {reason}"))
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _check_integrity(self, engine: LLMEngine) -> None:
        """Run the block pool / radix cache integrity check; count it, and on failure log
        it and record it (``/health`` then fails). The loop keeps serving meanwhile."""
        self.integrity_checks += 1
        passed = True
        try:
            engine.scheduler.check_integrity()
        except Exception as e:  # CacheIntegrityError (or an assert in older checks)
            passed = False
            self.integrity_failures += 1
            logger.exception("KV cache integrity check failed")
            if self.integrity_error is None:
                self.integrity_error = f"{type(e).__name__}: {e}"
        if self._on_integrity_check is not None:
            self._on_integrity_check(passed)

    def _drain_inbox(self, engine: LLMEngine, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_POLL_SECONDS) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, _Add):
                self._handle_add(engine, item)
            elif isinstance(item, _Abort):
                aborted = engine.abort_request(item.request_ids)
                for rid in aborted:
                    self._finish_stream(rid, RequestAbortedError(f"request {rid} was aborted"))
            elif isinstance(item, _AbortAll):
                ids = list(self._streams)
                engine.abort_request(ids)
                for rid in ids:
                    self._finish_stream(rid, RequestAbortedError(item.reason))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle_add(self, engine: LLMEngine, add: _Add) -> None:
        # The LoRA arguments only with an adapter: a base-model request is added as before.
        lora: dict[str, Any] = {} if add.lora_request is None else {
            "lora_request": add.lora_request, "lora_weights": add.lora_weights}
        try:
            engine.add_request(add.request_id, add.prompt_token_ids, add.params, add.cache_salt, grammar=add.grammar,
                               **lora)
        except BaseException as e:  # refused: hand the error back to the handler
            add.ack.set_exception(e)
            return
        self._streams[add.request_id] = (add.loop, add.out)
        self.num_unfinished += 1
        add.ack.set_result(None)

    def _step(self, engine: LLMEngine) -> None:
        try:
            outputs = engine.step()
        except Exception as e:  # an engine bug must not take every client down
            fatal = getattr(engine, "fatal_error", None)
            if fatal is not None:  # ... but a dead worker takes the engine down
                self._die(engine, fatal)
                return
            logger.exception("engine step failed; failing the requests in flight")
            ids = list(self._streams)
            engine.abort_request(ids)
            for rid in ids:
                self._finish_stream(rid, RequestFailedError(f"internal engine error: {e}"))
            return
        for out in outputs:
            if out.error is not None:
                param = out.error.split(":", 1)[0] if ":" in out.error else None
                self._finish_stream(out.request_id, InvalidRequestError(out.error, param))
                continue
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, out)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self.num_unfinished -= 1
        if self._on_step is not None:
            self._on_step(engine)

    def _finish_stream(self, request_id: str, error: BaseException) -> None:
        """Close a stream that ends without a normal final output (abort, failure)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.num_unfinished -= 1
        loop, q = stream
        loop.call_soon_threadsafe(q.put_nowait, error)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass (for drains and tests)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()

