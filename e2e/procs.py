"""Child processes of the e2e harness: started in their own process group, logged to a
file, stopped by pid (SIGTERM to the group, then SIGKILL), and all stopped at exit.

Every server the harness starts goes through :func:`start`, so one registry knows what
to stop when a test fails, pytest is interrupted, or the demo gets SIGINT/SIGTERM.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_RUNNING: list[Proc] = []


@dataclass
class Proc:
    """One started child and where its output goes."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    _log: object = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace_seconds: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_seconds``; returns the exit code."""
        if self.alive():
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_seconds)
            except subprocess.TimeoutExpired:
                _signal_group(self.pid, signal.SIGKILL)
                self.popen.wait(10)
        else:
            # The leader is gone; children it left in the group must not outlive it.
            _signal_group(self.pid, signal.SIGKILL)
        if self in _RUNNING:
            _RUNNING.remove(self)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.popen.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def start(name: str, argv: Sequence[str], log_dir: Path, *, env: Mapping[str, str] | None = None,
          cwd: Path | None = None) -> Proc:
    """Start ``argv`` in a new session (its own process group), output to LOG_DIR/NAME.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - closed by Proc.stop
    popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=dict(env) if env is not None else None,
                             cwd=cwd, start_new_session=True)
    proc = Proc(name=name, popen=popen, log_path=log_path, _log=log)
    _RUNNING.append(proc)
    return proc


def stop_all() -> None:
    """Stop every child still registered, newest first (clients before servers)."""
    for proc in reversed(list(_RUNNING)):
        proc.stop(grace_seconds=5)


def install_signal_handlers(*, interrupt: bool = False) -> None:
    """On SIGTERM/SIGHUP (and SIGINT) clean up before dying.

    ``interrupt=False`` (the demo): stop every child, then die of the signal as usual.
    ``interrupt=True`` (a pytest session): raise KeyboardInterrupt in the main thread, as
    Ctrl-C does, so pytest unwinds and the session fixture's ``finally`` tears the node
    down (pods deleted through the API, then mounts, network namespaces and cgroups
    removed); stopping the children first would leave all of that behind. A second
    signal kills at once (the handler is reset before raising).
    """

    def handler(signum: int, _frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)
        if interrupt:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
        stop_all()
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)
    if not interrupt:  # with interrupt, SIGINT keeps Python's KeyboardInterrupt
        signal.signal(signal.SIGINT, lambda s, f: (stop_all(), signal.default_int_handler(s, f)))


atexit.register(stop_all)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               interval: float = 0.5, on_timeout: Callable[[], str] | None = None,
               on_done: Callable[[str, float, float, bool], None] | None = None) -> object:
    """Poll ``predicate`` until it returns something truthy; raise TimeoutError naming ``what``.

    ``on_done(what, seconds_waited, timeout, met)`` is called either way (the suite's
    record of waits, :mod:`e2e.pace`)."""
    start = time.monotonic()
    deadline = start + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                if on_done:
                    on_done(what, time.monotonic() - start, timeout, True)
                return value
        except Exception as exc:  # a poll may fail while a server starts
            last_error = exc
        if time.monotonic() > deadline:
            if on_done:
                on_done(what, time.monotonic() - start, timeout, False)
            detail = f" (last error: {last_error!r})" if last_error else ""
            extra = f"\n{on_timeout()}" if on_timeout else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}{extra}")
        time.sleep(interval)
