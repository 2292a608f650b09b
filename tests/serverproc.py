"""Run `kvpilot serve` in a subprocess for tests: a free loopback port, bounded waits,
always stopped (SIGTERM, then SIGKILL) even when a test fails."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after ``timeout`` s; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


class ServerProcess:
    """``kvpilot serve`` with ``args`` on 127.0.0.1:<free port>."""

    def __init__(self, *args: str, host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:
        self.host = host
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kvpilot-serve-", suffix=".log", delete=False)  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "kvpilot.cli", "serve", "--host", host, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-6000:]

    def stop(self, timeout: float = 30.0) -> int:
        code = stop_process(self.proc, timeout)
        self.log.close()
        return code
