"""Drive a workload against a server: arrivals, concurrency limit, sessions, background.

Timeline of one run (all bounded by ``config.timeout_s``)::

    resolve model, scrape /metrics
    start B background streams ──────────────────────────────────────── cancelled ┐
    wait until each has its first token                                            │
    t=0: dataset units arrive (Poisson) ── requests / session turns ── last done ──┘
    scrape /metrics, summarize

- ``config.max_concurrency`` bounds the dataset's requests in flight (a semaphore taken
  per request, so a multi-turn session holds no slot while it thinks).
- Background streams (``config.background_streams``) are closed-loop: short prompt, long
  output, a finished one replaced at once, so B decodes run for the whole dataset phase.
  They are outside the concurrency limit, and cancelled once the dataset is done; this is
  how "decodes running while long prompts arrive" is measured (their ITL is reported in
  the ``background`` class).
- A multi-turn session stops at its first failed turn; its later turns count as not sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvpilot.bench.arrivals import poisson_arrival_times
from kvpilot.bench.cache_counters import hit_rate, scrape_counters
from kvpilot.bench.client import (
    CANCELLED,
    CHAT_COMPLETIONS,
    COMPLETIONS,
    FAILED,
    OK,
    RUNNING,
    RequestRecord,
    first_model_id,
    request_payload,
    stream_request,
)
from kvpilot.bench.config import BenchConfig
from kvpilot.bench.datasets import (
    BACKGROUND,
    MAIN,
    RequestSpec,
    SessionSpec,
    Unit,
    background_request,
    build_workload,
)
from kvpilot.bench.metrics import error_counts, summarize, summarize_class

BACKGROUND_MAX_FAILURES = 3  # a background slot stops after this many failures in a row
BACKGROUND_RETRY_S = 0.2


@dataclass
class BenchResult:
    """The outcome of one run. ``by_class`` maps request class -> ``summarize_class``
    output plus ``requests_not_sent``; ``summary`` is the dataset's class (``main``)."""

    config: BenchConfig
    model: str
    started_at: str  # ISO 8601, UTC
    duration_s: float
    timed_out: bool
    records: list[RequestRecord]
    by_class: dict[str, dict[str, Any]]
    prefix_cache: dict[str, Any]
    errors: list[dict[str, Any]]
    custom_workload: bool = False  # the units came from the caller, not config.dataset

    @property
    def summary(self) -> dict[str, Any]:
        return self.by_class.get(MAIN) or next(iter(self.by_class.values()), {})

    def to_json(self) -> dict[str, Any]:
        """Everything, JSON-ready: config, environment, summaries, per-request records."""
        return {
            "config": self.config.to_json(),
            "model": self.model,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "timed_out": self.timed_out,
            "custom_workload": self.custom_workload,
            "environment": environment(),
            "summary": self.summary,
            "by_class": self.by_class,
            "prefix_cache": self.prefix_cache,
            "errors": self.errors,
            "requests": [r.to_json() for r in self.records],
        }


def environment() -> dict[str, str]:
    """Versions and machine, stored with every result."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        kvpilot_version = version("kvpilot")
    except PackageNotFoundError:
        kvpilot_version = "unknown"
    return {"kvpilot": kvpilot_version, "python": platform.python_version(),
            "httpx": httpx.__version__, "machine": platform.platform()}


def run_benchmark(config: BenchConfig, workload: Sequence[Unit] | None = None) -> BenchResult:
    """Run ``workload`` (default: the config's dataset) and return the result.

    Blocking wrapper of ``run_benchmark_async``; must not be called from a running event
    loop. Raises ``BenchError`` only when the run cannot start (no model id).
    """
    return asyncio.run(run_benchmark_async(config, workload))


async def run_benchmark_async(config: BenchConfig, workload: Sequence[Unit] | None = None,
                              clock: Callable[[], float] = time.perf_counter) -> BenchResult:
    """See ``run_benchmark``. ``workload`` may mix ``RequestSpec`` and ``SessionSpec`` units
    with any ``request_class`` names; they arrive in order on the config's arrival process."""
    units = list(build_workload(config) if workload is None else workload)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s, connect=min(30.0, config.timeout_s))
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as http:
        model = config.model or await first_model_id(http, config.base_url)
        metrics_url = config.metrics_url or config.base_url + "/metrics"
        before, why_before = await scrape_counters(http, metrics_url)
        run = _Run(config, http, model, clock)
        started_at = datetime.datetime.now(datetime.timezone.utc).isoformat()
        timed_out = False
        try:
            await asyncio.wait_for(run.main_phase(units), config.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            end = clock()
            await run.stop_background()
        after, why_after = await scrape_counters(http, metrics_url)
    cache = hit_rate(before, after)
    why = why_before or why_after
    if cache["note"] and why:
        cache["note"] += f" ({why})"
    origin = run.origin if run.origin is not None else end
    for r in run.records:
        if r.send_time_s is not None:
            r.send_time_s -= origin
        if r.status == RUNNING:  # cut off by the run timeout
            r.fail(f"unfinished at the run timeout ({config.timeout_s:g} s)")
    duration = end - origin
    return BenchResult(config, model, started_at, duration, timed_out, run.records,
                       _by_class(units, run.records, duration, config.percentiles),
                       cache, error_counts(run.records), custom_workload=workload is not None)


def _by_class(units: Sequence[Unit], records: Sequence[RequestRecord], duration_s: float,
              percentiles: Sequence[float]) -> dict[str, dict[str, Any]]:
    """Summaries of the workload's classes (in workload order, with ``requests_not_sent``),
    then of the others (background)."""
    summaries = summarize(records, duration_s, percentiles)
    by_class: dict[str, dict[str, Any]] = {}
    for name, planned in _planned_requests(units).items():
        found = summaries.pop(name, None)
        by_class[name] = found or summarize_class([], duration_s, percentiles)
        by_class[name]["requests_not_sent"] = planned - sum(r.request_class == name
                                                            for r in records)
    by_class.update(summaries)
    return by_class


def _planned_requests(units: Sequence[Unit]) -> dict[str, int]:
    planned: dict[str, int] = {}
    for u in units:
        n = u.num_turns if isinstance(u, SessionSpec) else 1
        planned[u.request_class] = planned.get(u.request_class, 0) + n
    return planned


class _Run:
    """The mutable state of one run: records, the concurrency slot, background tasks."""

    def __init__(self, config: BenchConfig, http: httpx.AsyncClient, model: str,
                 clock: Callable[[], float]):
        self.config, self.http, self.model, self.clock = config, http, model, clock
        self.records: list[RequestRecord] = []
        self.origin: float | None = None  # clock() at the first arrival
        self._slots = (asyncio.Semaphore(config.max_concurrency)
                       if config.max_concurrency else None)
        self._background: list[asyncio.Task[None]] = []

    async def main_phase(self, units: Sequence[Unit]) -> None:
        """Background warm-up, then every unit on the arrival process, until all finish."""
        await self._start_background()
        times = poisson_arrival_times(len(units), self.config.request_rate,
                                      random.Random(self.config.seed + 1))
        tasks: list[asyncio.Task[None]] = []
        self.origin = start = self.clock()
        try:
            for unit, at in zip(units, times):
                delay = start + at - self.clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if isinstance(unit, SessionSpec):
                    tasks.append(asyncio.create_task(self._session(unit)))
                else:
                    tasks.append(asyncio.create_task(self._request(unit)))
            await asyncio.gather(*tasks)
        finally:
            await _cancel(tasks)

    async def stop_background(self) -> None:
        await _cancel(self._background)
        for r in self.records:
            if r.request_class == BACKGROUND and r.status == RUNNING:
                r.status = CANCELLED

    async def _request(self, spec: RequestSpec) -> None:
        async with self._slot():  # a request gets its record when it is sent
            record = self._record(spec.request_class, COMPLETIONS, spec.target_input_tokens,
                                  spec.output_len, group=spec.group)
            await self._send(record, prompt=spec.prompt)

    async def _session(self, spec: SessionSpec) -> None:
        replies: list[str] = []
        for turn in range(spec.num_turns):
            if turn and self.config.think_time_s:
                await asyncio.sleep(self.config.think_time_s)
            async with self._slot():
                record = self._record(spec.request_class, CHAT_COMPLETIONS,
                                      spec.target_input_tokens(turn), spec.output_len,
                                      session_id=spec.session_id, turn=turn)
                await self._send(record, messages=spec.messages(turn, replies))
            if record.status != OK:
                return  # the history is broken: the later turns are not sent
            replies.append(record.reply)

    async def _start_background(self) -> None:
        n = self.config.background_streams
        if not n:
            return
        rng = random.Random(self.config.seed + 2)
        warm = [asyncio.Event() for _ in range(n)]
        self._background = [asyncio.create_task(self._background_slot(rng, e)) for e in warm]
        await asyncio.gather(*(e.wait() for e in warm))

    async def _background_slot(self, rng: random.Random, warm: asyncio.Event) -> None:
        failures = 0
        while failures < BACKGROUND_MAX_FAILURES:
            spec = background_request(self.config, rng)
            record = self._record(BACKGROUND, COMPLETIONS, spec.target_input_tokens,
                                  spec.output_len)
            await self._send(record, prompt=spec.prompt, on_first_text=warm.set)
            warm.set()  # also when the stream failed before any text: do not wait forever
            failures = failures + 1 if record.status == FAILED else 0
            if failures:
                await asyncio.sleep(BACKGROUND_RETRY_S)

    def _record(self, request_class: str, endpoint: str, target_input_tokens: int,
                max_tokens: int, session_id: int | None = None, turn: int | None = None,
                group: int | None = None) -> RequestRecord:
        record = RequestRecord(len(self.records), request_class, endpoint,
                               target_input_tokens, max_tokens, session_id, turn, group)
        self.records.append(record)
        return record

    async def _send(self, record: RequestRecord, *, prompt: str | None = None,
                    messages: list[dict[str, str]] | None = None,
                    on_first_text: Callable[[], None] | None = None) -> None:
        c = self.config
        body = request_payload(self.model, record.max_tokens, prompt=prompt, messages=messages,
                               ignore_eos=c.ignore_eos, temperature=c.temperature,
                               extra_body=c.extra_body)
        # send_time_s stays on the raw clock here; run_benchmark_async makes it relative
        await stream_request(self.http, c.base_url + record.endpoint, body, record,
                             timeout_s=c.request_timeout_s, clock=self.clock,
                             on_first_text=on_first_text)

    def _slot(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self._slots if self._slots is not None else contextlib.nullcontext()


async def _cancel(tasks: Sequence[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
