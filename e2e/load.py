"""A load ramp with ``kvpilot bench serve``: one bench run per step, run one after the
other in a thread, each writing its result JSON. Used by the autoscaling scenario and
``make demo``."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e import pace, procs

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Step:
    """``concurrency`` streams of ``num_prompts`` random prompts."""

    concurrency: int
    num_prompts: int
    input_len: int = 160
    output_len: int = 48


@dataclass
class Ramp:
    base_url: str
    steps: list[Step]
    out_dir: Path
    model: str = "smollm2-135m-instruct"
    # Repeat the last step until stop(): a fleet that must stay under load through the
    # scenarios that follow the ramp (an ended ramp lets the autoscaler scale down).
    sustain: bool = False
    results: list[dict[str, Any]] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _current: procs.Proc | None = None

    def start(self) -> Ramp:
        self._thread = threading.Thread(target=self._run, name="bench-ramp", daemon=True)
        self._thread.start()
        return self

    def _schedule(self) -> Iterator[Step]:
        yield from self.steps
        while self.sustain and self.steps:
            yield self.steps[-1]

    def _run(self) -> None:
        for i, step in enumerate(self._schedule()):
            if self._stop.is_set():
                return
            result = self.out_dir / f"bench-{i}.json"
            self._current = procs.start(f"bench-{i}-{self.base_url.split('//')[1]}", [
                str(BIN / "kvpilot"), "bench", "serve", "--base-url", self.base_url,
                "--model", self.model, "--dataset", "random",
                "--random-input-len", str(step.input_len), "--output-len", str(step.output_len),
                "--random-range-ratio", "0.0", "--ignore-eos",
                "--num-prompts", str(step.num_prompts), "--max-concurrency", str(step.concurrency),
                # A request's bound scales with the machine's measured pace, like every wait.
                "--request-timeout", str(round(pace.PACE.bound(120))), "--result-json", str(result),
            ], self.out_dir)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._current.popen.wait(timeout=900)
            self._current.stop()
            if result.exists():
                self.results.append(json.loads(result.read_text()))

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._current is not None:
            self._current.stop(grace_seconds=5)
        if self._thread is not None:
            self._thread.join(30)

    def wait(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
