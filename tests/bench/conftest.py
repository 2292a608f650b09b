"""Fixtures: a fresh fake OpenAI-compatible server per test, always stopped."""

from __future__ import annotations

import pytest

from tests.bench.fake_server import Behaviour, FakeServer


@pytest.fixture
def fake():
    """``fake(**behaviour)`` -> a started ``FakeServer``; all are stopped after the test."""
    servers: list[FakeServer] = []

    def start(**behaviour) -> FakeServer:
        server = FakeServer(Behaviour(**behaviour)).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__()
