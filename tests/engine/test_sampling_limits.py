"""Sampling values at the edge of what fp32 logits can take: a tiny temperature is raised
to vLLM's floor instead of making the logits infinite, a tiny repetition penalty is
refused by name, and a failed step leaves the offline LLM usable."""

from __future__ import annotations

import pytest

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.sampling_params import MIN_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 0.001])
def test_a_tiny_temperature_is_raised_to_the_floor(temperature):
    assert SamplingParams(temperature=temperature).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).temperature == 0.0  # greedy stays greedy
    assert SamplingParams(temperature=0.7).temperature == 0.7


@pytest.mark.parametrize(("field", "value"), [("repetition_penalty", 5e-324), ("repetition_penalty", 101.0),
                                              ("temperature", float("nan")), ("temperature", float("inf"))])
def test_values_fp32_logits_cannot_take_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError, match=field) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


@pytest.mark.slow
def test_a_failed_step_leaves_the_offline_llm_serving(make_llm, monkeypatch):
    llm = make_llm(kv_cache_memory=0.05)
    real_step = llm.engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=2, temperature=0))
    assert out[0].outputs[0].text == " Paris."
