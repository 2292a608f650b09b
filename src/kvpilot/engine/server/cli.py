"""``kvpilot serve``: the OpenAI-compatible server with vLLM-compatible flags.

Start-up: the HTTP server binds at once and answers ``/health`` (200) and ``/ready``
(503) while the model loads in the engine thread; a load failure exits with status 1. The
``--lora-modules`` adapters are registered right after the model loads, before ``/ready``
turns 200; one that cannot be exits with status 2, naming the flag and the module.
SIGTERM drains: ``/ready`` turns 503, new generation requests get 503, in-flight ones
finish (up to ``--drain-timeout`` seconds; what is still running then is aborted with a
503 body, or an error event on a stream), then the process exits 0. The whole exit is
bounded from the signal: whatever still holds the process ``--drain-timeout +
ABORT_FLUSH_SECONDS + EXIT_GRACE_SECONDS`` after it (a connection uvicorn waits for, a
step or a tokenization still running in a worker thread) is cut by a hard exit with
status 0, so a pod is gone before its ``terminationGracePeriodSeconds`` (the operator
leaves 5 s after the drain timeout). A second signal stops at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.flags import serve as flags
from kvpilot.flags.serve import LoRAModulePath

if TYPE_CHECKING:
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.lora.file_sync import AdapterFileSync
    from kvpilot.engine.server.async_engine import AsyncEngine
    from kvpilot.engine.server.chat import ChatOptions
    from kvpilot.engine.server.state import ServerState

logger = logging.getLogger("kvpilot.serve")
# After the drain deadline aborts what is left: how long the aborted responses get to reach
# their clients before uvicorn closes the connections.
ABORT_FLUSH_SECONDS = 2.0
# A dead engine (a tensor-parallel worker ended): how long its error responses get to go
# out, and how long the engine thread gets to notice before the server exits anyway.
ERROR_FLUSH_SECONDS = 2.0
FATAL_EXIT_SECONDS = 20.0
# How often a running server applies its adapters file (--lora-adapters-file): the kubelet
# refreshes a mounted ConfigMap within about a minute, so a few seconds add little.
ADAPTERS_FILE_INTERVAL = 5.0
# After the drain: how long uvicorn's own shutdown may take before the process exits hard.
# With ABORT_FLUSH_SECONDS this stays under the 5 s the operator leaves between the drain
# timeout and the pod's SIGKILL (operator/builders/engine_args.py, EXIT_MARGIN_SECONDS).
EXIT_GRACE_SECONDS = 2.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Put ``kvpilot serve``'s flags (:mod:`kvpilot.flags.serve`: server, chat, engine,
    LoRA) on ``parser``. Mutates ``parser``."""
    flags.add_arguments(parser, flags.SERVER + flags.CHAT)
    EngineArgs.add_cli_args(parser)
    EngineArgs.add_lora_cli_args(parser)


class LoRAModuleError(ValueError):
    """A ``--lora-modules`` entry that cannot be registered (``kvpilot serve`` exits 2,
    naming the flag, the module and why)."""


def register_lora_modules(engine: LLMEngine, modules: tuple[LoRAModulePath, ...], served: str) -> None:
    """Register the ``--lora-modules`` adapters with the engine's LoRA manager, in order
    (each folder read and validated; in the engine thread, before the server is ready).
    Mutates ``engine.lora``.

    Raises:
        LoRAModuleError: a module named like the served model, or one the manager refuses
            (a folder that is not a PEFT adapter for this model, a rank over
            ``--max-lora-rank``), naming ``--lora-modules``, the module and the reason.
    """
    if not modules:
        return
    manager = engine.lora
    if manager is None:  # pragma: no cover - EngineArgs refuses --lora-modules without --enable-lora
        raise LoRAModuleError("--lora-modules needs --enable-lora")
    for m in modules:
        shown = f"--lora-modules {m.name}={m.path}"
        if m.name == served:
            raise LoRAModuleError(f"{shown}: '{m.name}' is the served model's name; give the adapter another name")
        try:
            manager.register(m.name, m.path, m.base_model_name)
        except InvalidRequestError as e:
            raise LoRAModuleError(f"{shown}: {e}") from None
        logger.info("Loaded LoRA adapter '%s' from %s", m.name, m.path)


def chat_options(args: argparse.Namespace) -> ChatOptions:
    """The chat flags as :class:`ChatOptions`. Raises ValueError naming the flag, the
    value and what is allowed (an unknown parser, a template file that does not exist)."""
    from kvpilot.engine.server.chat import ChatOptions

    template = args.chat_template
    if template is not None:
        path = Path(template)
        if path.is_file():
            template = path.read_text()
        elif "{{" not in template and "{%" not in template:
            raise ValueError(f"--chat-template: {template!r} is neither a file nor a Jinja template")
    try:
        return ChatOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser, template)
    except ValueError as e:
        msg = str(e)
        if args.tool_call_parser is not None and "tool" in msg and "--" not in msg:
            msg = f"--tool-call-parser: {msg}"
        elif args.reasoning_parser is not None and "reasoning" in msg and "--" not in msg:
            msg = f"--reasoning-parser: {msg}"
        raise ValueError(msg) from None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # vLLM flags that are no-ops here, accepted by kvpilot.cli (kvpilot.flags.check).
    for noop in getattr(args, "vllm_noop_flags", ()):
        logger.info("vLLM flag %s accepted as a no-op: %s", noop.arg, noop.reason)
    try:
        engine_args = EngineArgs.from_cli_args(args)
        chat = chat_options(args)
    except ValueError as e:
        print(f"kvpilot serve: {e}", file=sys.stderr)
        return 2
    from kvpilot.engine.model.loader import resolve_model

    try:
        source = resolve_model(engine_args.model)
    except FileNotFoundError as e:
        print(f"kvpilot serve: {e}", file=sys.stderr)
        return 2
    served = engine_args.served_model_name or source.name

    from kvpilot.engine.kv_events import KVEventsConfigError, make_publisher
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.lora.file_sync import AdapterFileSync
    from kvpilot.engine.server.api_server import build_app
    from kvpilot.engine.server.async_engine import AsyncEngine
    from kvpilot.engine.server.metrics import EngineMetrics
    from kvpilot.engine.server.state import ServerState

    # The KV event publisher lives as long as the server: bound before the model loads (a
    # port in use is a start-up error), stopped after the engine thread.
    kv_cfg = engine_args.kv_events_config
    kv_publisher = make_publisher(kv_cfg) if kv_cfg is not None and kv_cfg.enable_kv_cache_events else None
    if kv_publisher is not None:
        try:
            kv_publisher.start()
        except KVEventsConfigError as e:
            print(f"kvpilot serve: {e}", file=sys.stderr)
            return 2
    try:
        metrics = EngineMetrics(served)

        adapter_files: list[AdapterFileSync] = []

        def factory() -> LLMEngine:
            engine = LLMEngine(engine_args, kv_event_publisher=kv_publisher)
            try:
                register_lora_modules(engine, engine_args.lora_modules, served)
                if engine_args.lora_adapters_file is not None and engine.lora is not None:
                    # Every adapter of the file is loaded (or has failed, logged) before
                    # the server reports ready; followed afterwards by follow_adapters_file.
                    adapter_files.append(AdapterFileSync(engine.lora, engine_args.lora_adapters_file))
                    adapter_files[0].sync()
            except BaseException:
                engine.close()  # tensor-parallel workers: the server will not start
                raise
            metrics.set_config(engine)
            return engine

        engine = AsyncEngine(factory, on_step=metrics.observe, on_integrity_check=metrics.observe_integrity_check)
        state = ServerState(engine, metrics, served, args.api_key, args.max_request_body_bytes,
                            kv_events=kv_cfg, kv_publisher=kv_publisher, kv_block_size=engine_args.block_size,
                            model_path=engine_args.model or source.name, chat_options=chat,
                            enable_lora=engine_args.enable_lora)
        app = build_app(state)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=2)
        server = DrainingServer(config, state, args.drain_timeout)
        engine.start()
        threading.Thread(target=_exit_when_dead, args=(engine, server), daemon=True).start()
        if engine_args.lora_adapters_file is not None:
            threading.Thread(target=follow_adapters_file, args=(engine, adapter_files), daemon=True,
                             name="adapters-file").start()
        server.run()
        engine.shutdown()
    finally:
        if kv_publisher is not None:
            kv_publisher.shutdown()
    if isinstance(engine.load_error, LoRAModuleError):
        print(f"kvpilot serve: {engine.load_error}", file=sys.stderr)
        return 2
    if engine.load_error is not None:
        print(f"kvpilot serve: the model failed to load: {engine.load_error}", file=sys.stderr)
        return 1
    fatal = _fatal_error(engine)
    if fatal is not None:
        print(f"kvpilot serve: the engine stopped: {fatal}", file=sys.stderr)
        return 1
    return 0


def follow_adapters_file(engine: AsyncEngine, syncs: list[AdapterFileSync],
                         interval: float = ADAPTERS_FILE_INTERVAL) -> None:
    """Apply the adapters file every ``interval`` seconds while the engine runs (a daemon
    thread: loads read disks and fetch, never on the event loop or the engine thread)."""
    while engine.is_alive:
        time.sleep(interval)
        if syncs and engine.is_ready:
            try:
                syncs[0].sync()
            except Exception:  # logged; the next pass tries again, the server keeps serving
                logger.exception("applying the adapters file failed")


def _fatal_error(engine: AsyncEngine) -> str | None:
    """Why the engine can run no more steps (a tensor-parallel worker ended), or None."""
    if engine.fatal_error is not None:
        return engine.fatal_error
    llm = engine.engine
    return None if llm is None else llm.fatal_error


def _exit_when_dead(engine: AsyncEngine, server: uvicorn.Server) -> None:
    """Stop the server when the model fails to load, or when the engine dies after it
    (a tensor-parallel worker ended): once the engine thread has failed the requests in
    flight (their error responses get a moment to go out), or at the latest
    ``FATAL_EXIT_SECONDS`` after the death was seen. ``run`` then returns 1, so
    Kubernetes restarts the pod."""
    while not engine.ready.is_set():
        if engine.load_error is not None:
            server.should_exit = True
            return
        time.sleep(0.1)
    seen = None
    while not server.should_exit:
        if engine.fatal_error is not None:
            time.sleep(ERROR_FLUSH_SECONDS)
            break
        if _fatal_error(engine) is not None:
            seen = seen if seen is not None else time.monotonic()
            if time.monotonic() - seen > FATAL_EXIT_SECONDS:
                break
        time.sleep(0.1)
    else:
        return
    logger.error("the engine stopped (%s): exiting", _fatal_error(engine))
    server.should_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with a draining SIGTERM (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: a drained exit is a clean exit (status 0).
        if self.state.draining or self.should_exit:
            self.force_exit = True
            self.should_exit = True
            return
        logger.info("signal %d: draining (up to %.0fs) before exit", sig, self.drain_timeout)
        self.state.draining = True
        threading.Thread(target=self._drain, name="kvpilot-drain", daemon=True).start()
        bound = self.drain_timeout + ABORT_FLUSH_SECONDS + EXIT_GRACE_SECONDS
        threading.Thread(target=_exit_after, args=(bound,), name="kvpilot-exit", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while time.monotonic() < deadline:
            if self.state.inflight == 0 and self.state.engine.num_unfinished == 0:
                break
            time.sleep(0.05)
        else:
            # Fail what is left cleanly (503 / an SSE error event) rather than let uvicorn
            # cancel the handlers mid-response, which cuts connections with a 500.
            logger.warning("drain timeout: aborting %d requests still in flight", self.state.inflight)
            self.state.drain_expired = True  # handlers still waiting for a body answer 503
            self.state.engine.abort_all(
                f"the server is shutting down: the drain timeout of {self.drain_timeout:g}s passed")
            end = time.monotonic() + ABORT_FLUSH_SECONDS
            while self.state.inflight and time.monotonic() < end:
                time.sleep(0.05)
        self.should_exit = True


def _exit_after(seconds: float) -> None:
    """Exit the process with status 0 if it is still alive ``seconds`` from now (a
    daemon thread, started at the signal: a normal exit before then ends it)."""
    time.sleep(seconds)
    logger.warning("still running %.1fs after the signal (drain, abort flush and shutdown); exiting now", seconds)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
