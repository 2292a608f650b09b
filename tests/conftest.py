"""Shared fixtures: the embedded SmolLM2 loaded once per session (fp32, CPU) and a
factory for engines that share those weights."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU; read when triton builds them


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
