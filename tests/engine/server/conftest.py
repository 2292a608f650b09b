from __future__ import annotations

import pytest

from tests.serverproc import ServerProcess

API_KEY = "test-key"


@pytest.fixture(scope="session")
def server():
    """One server for the HTTP tests: small limits so overload and limits are reachable."""
    proc = ServerProcess(
        "--api-key", API_KEY,
        "--kv-cache-memory", "0.25",
        "--max-model-len", "1024",
        "--max-num-seqs", "4",
        "--max-num-batched-tokens", "256",
        "--max-request-body-bytes", str(1 << 20),
        "--log-level", "warning",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c
