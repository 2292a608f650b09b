"""Fixtures: one fake OpenAI-compatible server for the whole session (started once,
always stopped), reset to a fresh behaviour and state for each use."""

from __future__ import annotations

import pytest

from tests.bench.fake_server import Behaviour, FakeServer


@pytest.fixture(scope="session")
def _fake_server():
    with FakeServer() as server:
        yield server


@pytest.fixture
def fake(_fake_server):
    """``fake(**behaviour)`` -> the fake server, reset: empty state, the given behaviour.
    A second call in one test resets it again (tests use one at a time)."""

    def start(**behaviour) -> FakeServer:
        return _fake_server.reset(Behaviour(**behaviour))

    return start
