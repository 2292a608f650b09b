"""Shared fixtures: the embedded SmolLM2 loaded once per session (fp32, CPU) and a
factory for engines that share those weights; and the markers that select the fast
subset (`make unit`), applied here from the fixtures a test uses.

Markers (registered in pyproject.toml; `make unit` deselects all five):

    slow                 the real SmolLM2 weights or its tokenizer, or an engine server
                         process: by fixture (below) or an explicit mark
    triton_interpreter   Triton kernels under the CPU interpreter: explicit marks
    hypothesis           a hypothesis property test: every ``@given`` test, here
    server               an HTTP server in a thread (fake OpenAI server, fake Kubernetes
                         API with a real Kopf loop): by fixture or an explicit mark
    tools                helm, promtool, the node packages (buildah) or llmd-indexer (llm-d's
                         KV cache indexer, tests/interop) from `make tools`: explicit marks
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; read when triton builds them

# Fixture -> the marker every test that uses it (directly or through another fixture) gets.
MARK_BY_FIXTURE = {
    "smollm2": "slow",  # loads the weights
    "make_engine": "slow",
    "make_llm": "slow",
    "tokenizer": "slow",  # reads the embedded model file
    "server": "slow",  # tests/engine/server: a `kvpilot serve` process
    "_fake_server": "server",  # tests/bench: the fake OpenAI-compatible server
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for fixture, marker in MARK_BY_FIXTURE.items():
            if fixture in fixtures:
                item.add_marker(marker)
        if getattr(getattr(item, "function", None), "is_hypothesis_test", False):
            item.add_marker("hypothesis")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct, loaded once (fp32 on CPU)."""
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.model_runner import load_model

    return load_model(EngineArgs(device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def make_engine(smollm2):
    """``make_engine(**engine_args)`` -> an LLMEngine on the shared SmolLM2 weights."""
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    def factory(**kwargs):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("kv_cache_memory", 0.25)
        return LLMEngine(EngineArgs(**kwargs), loaded=smollm2)

    return factory


@pytest.fixture(scope="session")
def make_llm(smollm2):
    """``make_llm(**engine_args)`` -> an offline LLM on the shared SmolLM2 weights."""
    from kvpilot.engine.llm import LLM

    def factory(**kwargs):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("kv_cache_memory", 0.25)
        return LLM(loaded=smollm2, **kwargs)

    return factory


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer alone (no weights loaded)."""
    from kvpilot.engine.model.loader import resolve_model
    from kvpilot.engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))
