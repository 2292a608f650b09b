"""Real servers for the download tests, from `make tools` (scripts/install-tools.sh), on
127.0.0.1 at free ports, always stopped: moto's S3 server and go-containerregistry's
in-memory OCI registry."""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.operator.tools import tool
from tests.serverproc import free_port


@contextmanager
def _serving(args: list[str], url: str, ready_path: str) -> Iterator[str]:
    log = tempfile.NamedTemporaryFile(prefix="fetch-server-", suffix=".log")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited {proc.returncode}:\n"
                                   f"{Path(log.name).read_text(errors='replace')[-2000:]}")
            try:
                httpx.get(url + ready_path, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{args[0]} did not answer at {url}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server; yields its endpoint URL (any access key is accepted)."""
    port = free_port()
    with _serving([tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                  f"http://127.0.0.1:{port}", "/") as url:
        yield url


@contextmanager
def oci_registry() -> Iterator[str]:
    """An in-memory OCI registry (plain HTTP); yields ``127.0.0.1:PORT``."""
    port = free_port()
    with _serving([tool("registry"), "-port", str(port)], f"http://127.0.0.1:{port}", "/v2/"):
        yield f"127.0.0.1:{port}"
