"""Tensor-parallel processes: rank 0 (the engine process) starts and watches the workers.

Ownership follows vLLM v1's executor: the engine (:class:`~kvpilot.engine.llm_engine.LLMEngine`)
owns a :class:`TPExecutor`, which owns the worker processes; each rank (rank 0 in the
engine process, each worker in its own) owns one
:class:`~kvpilot.engine.model_runner.ModelRunner` for its shard. The runner knows nothing
of the workers: :func:`load_with_workers` starts them before rank 0 loads its shard, and
:meth:`TPExecutor.execute_model` sends each step to them before rank 0 runs it.

Rank 0 runs the scheduler, the sampler and its own shard of the model. Ranks ``1..N-1``
are worker processes (``spawn``, as vLLM's multiprocessing executor, so CUDA is never
forked) that each load their shard and KV cache, then run every step rank 0 sends them:

    rank 0                                  worker r
    ------                                  --------
    TCPStore on 127.0.0.1:<free port>       TCPStore client
    spawn workers ---- (args, rank, port) ->
    process group rendezvous  <-----------> process group rendezvous
    load shard, size KV, MIN over ranks <-> load shard, size KV, MIN over ranks
    each step: flatten the SchedulerOutput
      into StepInputs, send ----- pipe ---> recv StepInputs
      forward (all-reduces) <-------------> forward (all-reduces)
      logits (all-gather) <---------------> logits (all-gather), dropped
      sample                                wait for the next step

A step's inputs reach each worker once, as one message, not per layer. A worker that
ends (killed, out of memory, a failed load) is seen at once by a watchdog thread on the
process sentinels: the executor is marked dead, a collective blocked on the missing peer
fails (gloo sees the closed connection), and the step raises :class:`WorkerDiedError`.
Workers exit when rank 0 closes their pipe or dies (their next ``recv`` fails).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvpilot.engine.config import EngineArgs, resolve_device
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.distributed import TP_TIMEOUT_SECONDS, TPGroup, WorkerDiedError
from kvpilot.engine.model_runner import (
    LoadedModel,
    ModelRunner,
    load_model,
    load_planned,
    plan_load,
)

logger = logging.getLogger(__name__)

# After a worker dies, how long a step may take to notice before the executor gives up
# on it (a NCCL collective does not see a dead peer on its own).
DEATH_GRACE_SECONDS = 10.0
# How long shutdown waits for a worker to leave before terminating it.
STOP_SECONDS = 5.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` on CUDA (one GPU per rank), the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TPExecutor:
    """Starts workers ``1..size-1`` and joins the process group as rank 0.

    Args:
        args: the engine's :class:`~kvpilot.engine.config.EngineArgs` (sent to each worker).
        device: rank 0's resolved device (``cuda`` or ``cpu``).
        timeout: seconds a rendezvous or collective may wait for a peer.
    Attributes:
        group: rank 0's :class:`TPGroup`.
        dead: why a worker ended (None while all run).
    Raises:
        ValueError: more ranks than visible CUDA devices.
        WorkerDiedError: a worker ended before the group formed.
    """

    def __init__(self, args: Any, device: torch.device, timeout: float = TP_TIMEOUT_SECONDS) -> None:
        size = args.tensor_parallel_size
        if device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs; torch sees "
                             f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES, the pod's GPU limit)")
        self.size = size
        self.dead: str | None = None
        self._closing = False
        self._errors: dict[int, str] = {}
        self._on_death: list[Callable[[str], None]] = []
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=timeout),
                               wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[mpc.Connection] = []
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(args, rank, store.port, child, level, timeout),
                               name=f"kvpilot-tp-worker-{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        logger.info("tensor parallelism: %d ranks (%s), workers %s", size,
                    "nccl" if device.type == "cuda" else "gloo", [p.pid for p in self.procs])
        self._watchdog = threading.Thread(target=self._watch, name="kvpilot-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self.group = self._rendezvous(store, device, timeout)
        except BaseException:
            self.shutdown()
            raise

    def _rendezvous(self, store: Any, device: torch.device, timeout: float) -> TPGroup:
        """Join as rank 0 in a thread, so a worker that dies first ends the wait at once."""
        result: list[Any] = []

        def join() -> None:
            try:
                result.append(TPGroup.connect(0, self.size, store.port, device, store=store, timeout=timeout))
            except BaseException as e:  # handed to the caller below
                result.append(e)

        t = threading.Thread(target=join, name="kvpilot-tp-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            if self.dead is not None:
                raise WorkerDiedError(self.dead)
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    # ------------------------------------------------------------ watching
    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
        while sentinels and not self._closing:
            ready = mpc.wait(list(sentinels), timeout=0.5)
            for s in ready:
                rank = sentinels.pop(s)
                if self._closing:
                    return
                proc = self.procs[rank - 1]
                proc.join(1.0)
                self._collect_errors()
                why = self._errors.get(rank, "")
                self.dead = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                             f"{proc.exitcode}" + (f": {why}" if why else ""))
                logger.error("%s; the engine cannot run another step", self.dead)
                for cb in list(self._on_death):
                    cb(self.dead)
                return

    def _collect_errors(self) -> None:
        """Read the error messages failed workers sent before exiting."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll():
                    kind, detail = conn.recv()
                    if kind == "error":
                        self._errors[rank] = detail
            except (EOFError, OSError):
                continue

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from the watchdog thread) when a worker ends."""
        self._on_death.append(callback)
        if self.dead is not None:
            callback(self.dead)

    def check(self, wait: float = 0.0) -> None:
        """Raise :class:`WorkerDiedError` if a worker ended, waiting up to ``wait`` s for
        the watchdog to notice (after a collective failed)."""
        end = time.monotonic() + wait
        while self.dead is None and time.monotonic() < end:
            time.sleep(0.05)
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    # ---------------------------------------------------------------- steps
    def send(self, message: Any) -> None:
        """Hand one step's inputs to every worker (one pipe message each).

        Raises:
            WorkerDiedError: a worker is gone.
        """
        self.check()
        for conn in self.conns:
            try:
                conn.send(message)
            except (BrokenPipeError, EOFError, OSError) as e:
                self.check(DEATH_GRACE_SECONDS)
                raise WorkerDiedError(f"a tensor-parallel worker is gone: {e}") from e

    def execute_model(self, runner: ModelRunner, out: SchedulerOutput) -> torch.Tensor:
        """Run one step on every rank: send its inputs to the workers, then run rank 0's
        share with ``runner`` (rank 0's). Returns what :meth:`ModelRunner.execute` returns.

        Raises:
            WorkerDiedError: a worker is gone (before the step, or a collective failed
                because it died).
        """
        inputs = runner.flatten(out)
        self.send(inputs)  # raises WorkerDiedError when a worker is gone
        try:
            parts = runner.run_inputs(inputs)
        except RuntimeError:  # a collective failed: was it a dead worker?
            self.check(DEATH_GRACE_SECONDS)
            raise
        return runner.finish_step(parts)

    # ------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop the workers (a None message, then terminate, then kill) and drop the
        process group. Idempotent; never raises."""
        if self._closing:
            return
        self._closing = True
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, EOFError, OSError):
                conn.send(None)
        deadline = time.monotonic() + STOP_SECONDS
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            conn.close()
        group = getattr(self, "group", None)
        if group is not None:
            group.close()


def load_with_workers(args: EngineArgs) -> tuple[LoadedModel, TPExecutor | None]:
    """Rank 0's load: with ``--tensor-parallel-size N > 1`` check the split, start the
    workers (each loads its own shard), then load rank 0's shard; with one rank, the
    whole model and no executor. The caller owns the executor (``shutdown()``).

    Raises:
        ModelNotFoundError, UnsupportedModelError, ValueError: as
            :func:`~kvpilot.engine.model_runner.load_model` (a split the model cannot take
            fails before any worker starts).
        WorkerDiedError: a tensor-parallel worker failed to start.
    """
    if args.tensor_parallel_size == 1:
        return load_model(args), None
    plan = plan_load(args)
    executor = TPExecutor(args, plan.device)
    try:
        return load_planned(args, plan, executor.group), executor
    except BaseException:
        executor.shutdown()
        raise


def worker_main(args: Any, rank: int, port: int, conn: mpc.Connection, log_level: int, timeout: float) -> None:
    """A worker process: join the group, load rank ``rank``'s shard and KV cache, then run
    each step rank 0 sends until it sends None or goes away. Exits 1 after reporting an
    error to rank 0 (through the pipe) if anything fails."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    try:
        device = rank_device(resolve_device(args.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = TPGroup.connect(rank, args.tensor_parallel_size, port, device, timeout=timeout)
        runner = ModelRunner(args, load_model(args, tp=tp))
    except BaseException as e:
        logger.exception("tensor-parallel worker failed to start")
        _report(conn, e)
        os._exit(1)
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                break
            if message is None:
                break
            runner.execute_inputs(message)
    except BaseException as e:
        logger.exception("tensor-parallel worker failed in a step")
        _report(conn, e)
        os._exit(1)
    tp.close()


def _report(conn: mpc.Connection, e: BaseException) -> None:
    with contextlib.suppress(BrokenPipeError, EOFError, OSError):
        conn.send(("error", f"{type(e).__name__}: {e}"))
