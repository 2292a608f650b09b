"""Sampler on synthetic logits: every rule checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.engine.core.request import Request
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.sampler import Sampler, apply_penalties, filter_logits
from kvpilot.engine.sampling_params import SamplingParams

V = 8
EOS = 7


def req(rid="r", prompt=(1, 2), outputs=(), **kw):
    r = Request(rid, list(prompt), SamplingParams(**kw), eos_token_ids=[EOS])
    for t in outputs:
        r.append_output_token(t)
    return r


def test_greedy_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 0]])
    out = Sampler(torch.device("cpu"))(logits, [req(temperature=0.0), req("b", temperature=0.0)])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_top_k_one_and_tiny_top_p_reduce_to_greedy():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    best = int(logits.argmax())
    s = Sampler(torch.device("cpu"), seed=3)
    for _ in range(20):
        assert s(logits, [req(temperature=1.0, top_k=1)]).token_ids == [best]
        assert s(logits, [req(temperature=1.0, top_p=1e-6)]).token_ids == [best]


def test_filter_logits_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_logits(probs.log(), top_k=0, top_p=0.8, min_p=0.0)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    kept = filter_logits(probs.log(), top_k=0, top_p=0.81, min_p=0.0)
    assert torch.isfinite(kept).tolist() == [True, True, True, False]


def test_filter_logits_min_p_and_top_k():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_logits(probs.log(), top_k=0, top_p=1.0, min_p=0.2)  # floor 0.1
    assert torch.isfinite(kept).tolist() == [True, True, True, False]
    kept = filter_logits(probs.log(), top_k=2, top_p=1.0, min_p=0.0)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]


def test_penalties_follow_openai_and_hf_arithmetic():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0, 0, 0, 0, 0])
    r = req(prompt=(0,), outputs=(1, 2, 2), repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, r)
    # token 0: prompt only -> repetition: 2 / 2 = 1
    # token 1: output once -> -2 * 2 = -4, then -0.5 - 0.25
    # token 2: output twice -> 1 / 2 = 0.5, then -1.0 - 0.25
    # token 3: unseen -> unchanged
    assert logits[:4].tolist() == pytest.approx([1.0, -4.75, -0.75, 1.0])


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 3] = 1.0
    s = Sampler(torch.device("cpu"))
    assert s(logits, [req(temperature=0.0, min_tokens=2, stop_token_ids=[5])]).token_ids == [3]
    assert s(logits, [req(outputs=(3, 3), temperature=0.0, min_tokens=2)]).token_ids == [EOS]


def test_seeded_requests_reproduce_and_differ_by_seed():
    logits = torch.zeros(1, 50)

    def draw(seed):
        s = Sampler(torch.device("cpu"))
        r = req(rid=f"s{seed}", temperature=1.0, seed=seed)
        return [s(logits, [r]).token_ids[0] for _ in range(10)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0, 0, 0, 0, 0]])
    out = Sampler(torch.device("cpu"))(logits, [req(temperature=0.0, logprobs=2, repetition_penalty=1.5)])
    lse = math.log(sum(math.exp(x) for x in logits[0].tolist()))
    assert out.logprobs[0] == pytest.approx(3.0 - lse)
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1]
    assert out.top_logprobs[0][1][1] == pytest.approx(2.0 - lse)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens must be <= max_tokens \(2\), got 5"),
        ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\], got 21"),
        ({"presence_penalty": 3}, r"presence_penalty must be in \[-2, 2\], got 3"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
        ({"stop": [""]}, "stop must be a non-empty string"),
        ({"n": 0}, r"n must be an integer in \[1, 128\], got 0"),
    ],
)
def test_bad_sampling_params_name_the_value(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs)) or e.value.param == "min_tokens"
