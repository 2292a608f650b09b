"""Prompts and workloads: lengths, seeding, shared prefixes, multi-turn message layout,
and the config's validation messages."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.bench.config import BenchConfig
from kvpilot.bench.datasets import (
    BACKGROUND,
    RequestSpec,
    SessionSpec,
    background_request,
    build_workload,
    drawn_length,
)
from kvpilot.bench.text import WORDS, random_text


@given(st.integers(min_value=0, max_value=3000), st.integers(min_value=0, max_value=2**32))
def test_random_text_has_one_word_or_full_stop_per_requested_token(n, seed):
    text = random_text(random.Random(seed), n)
    words = text.split()
    stops = text.count(".")
    assert len(words) + stops == n
    assert all(w.rstrip(".") in WORDS for w in words)


def test_words_are_distinct_lower_case_words():
    assert len(set(WORDS)) == len(WORDS) >= 250
    assert all(w.isalpha() and w.islower() for w in WORDS)


def test_workloads_are_deterministic_for_a_seed():
    for dataset in ("random", "shared-prefix", "multi-turn"):
        a = build_workload(BenchConfig(dataset=dataset, seed=7, num_prompts=10))
        b = build_workload(BenchConfig(dataset=dataset, seed=7, num_prompts=10))
        c = build_workload(BenchConfig(dataset=dataset, seed=8, num_prompts=10))
        assert a == b and a != c


@given(st.integers(min_value=1, max_value=5000), st.floats(min_value=0, max_value=0.99),
       st.integers(min_value=0, max_value=1000))
def test_drawn_lengths_stay_in_the_range(length, ratio, seed):
    n = drawn_length(random.Random(seed), length, ratio)
    assert max(1, math.floor(length * (1 - ratio))) <= n <= math.ceil(length * (1 + ratio))


def test_random_dataset_lengths():
    fixed = build_workload(BenchConfig(num_prompts=5, random_input_len=50, output_len=9))
    assert all(isinstance(u, RequestSpec) for u in fixed)
    assert [(u.target_input_tokens, u.output_len) for u in fixed] == [(50, 9)] * 5
    assert all(len(u.prompt.split()) + u.prompt.count(".") == 50 for u in fixed)
    ranged = build_workload(BenchConfig(num_prompts=200, random_input_len=100,
                                        output_len=100, random_range_ratio=0.5))
    inputs = [u.target_input_tokens for u in ranged]
    assert min(inputs) >= 50 and max(inputs) <= 150 and len(set(inputs)) > 20
    assert len({u.prompt[:60] for u in ranged}) == 200  # no accidental shared prefixes


def test_shared_prefix_groups_share_their_prefix_only():
    config = BenchConfig(dataset="shared-prefix", num_prompts=12, num_groups=3,
                         shared_prefix_len=40, question_len=8)
    units = build_workload(config)
    assert sorted(u.group for u in units) == [0] * 4 + [1] * 4 + [2] * 4
    assert [u.group for u in units] != [i % 3 for i in range(12)]  # shuffled
    prefixes = {}
    for u in units:
        prefix, question = u.prompt.split("\n\n")
        prefixes.setdefault(u.group, set()).add(prefix)
        assert len(question.split()) + question.count(".") == 8
    assert all(len(p) == 1 for p in prefixes.values())
    assert len(set().union(*prefixes.values())) == 3
    assert len({u.prompt for u in units}) == 12


def test_multi_turn_sessions_and_their_messages():
    config = BenchConfig(dataset="multi-turn", num_sessions=4, num_turns=3,
                         system_prompt_len=30, turn_input_len=10, output_len=5,
                         num_system_prompts=2)
    sessions = build_workload(config)
    assert all(isinstance(s, SessionSpec) and s.num_turns == 3 for s in sessions)
    assert sessions[0].system_prompt == sessions[2].system_prompt
    assert sessions[0].system_prompt != sessions[1].system_prompt
    s = sessions[0]
    assert s.messages(0, []) == [{"role": "system", "content": s.system_prompt},
                                 {"role": "user", "content": s.user_turns[0]}]
    m = s.messages(2, ["first reply", "second reply"])
    assert [x["content"] for x in m] == [s.system_prompt, s.user_turns[0], "first reply",
                                         s.user_turns[1], "second reply", s.user_turns[2]]
    assert [s.target_input_tokens(t) for t in range(3)] == [40, 55, 70]
    with pytest.raises(ValueError, match="turn 2 of 3 needs 2 replies, got 1"):
        s.messages(2, ["only one"])
    no_system = build_workload(BenchConfig(dataset="multi-turn", system_prompt_len=0))
    assert no_system[0].messages(0, [])[0]["role"] == "user"


def test_background_request_is_short_in_long_out():
    spec = background_request(BenchConfig(background_input_len=16,
                                          background_output_len=900), random.Random(0))
    assert spec.request_class == BACKGROUND and spec.output_len == 900
    assert len(spec.prompt.split()) + spec.prompt.count(".") == 16


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"request_rate": -1.0}, "request_rate (--request-rate) must be a number > 0, or inf "
                             "for all at once, got -1.0"),
    ({"request_rate": 0.0}, "got 0.0"),
    ({"max_concurrency": 0}, "max_concurrency (--max-concurrency) must be an integer >= 1, "
                             "got 0"),
    ({"num_prompts": 0}, "num_prompts (--num-prompts) must be an integer >= 1, got 0"),
    ({"random_range_ratio": 1.0}, "random_range_ratio (--random-range-ratio) must be a "
                                  "number in [0, 1), got 1.0"),
    ({"dataset": "sharegpt"}, "dataset (--dataset) must be one of random, shared-prefix, "
                              "multi-turn, got 'sharegpt'"),
    ({"base_url": "localhost:8000"}, "base_url (--base-url) must be an http:// or https:// "
                                     "URL, got 'localhost:8000'"),
    ({"timeout_s": math.inf}, "timeout_s (--timeout) must be a finite number of seconds"),
    ({"think_time_s": -0.5}, "think_time_s (--think-time) must be a finite number"),
    ({"num_turns": 1.5}, "num_turns (--num-turns) must be an integer >= 1, got 1.5"),
    ({"percentiles": (50, 101)}, "percentiles (--percentiles) must be one or more numbers "
                                 "in [0, 100], got (50, 101)"),
    ({"shared_prefix_len": -1}, "shared_prefix_len (--shared-prefix-len) must be an "
                                "integer >= 0, got -1"),
])
def test_config_errors_name_the_field_its_flag_and_the_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        BenchConfig(**kwargs)
    assert message in str(err.value)


def test_config_normalizes_the_base_url():
    assert BenchConfig(base_url="http://h:1/v1/").base_url == "http://h:1"
    assert BenchConfig(base_url="https://h/").base_url == "https://h"
    assert BenchConfig(dataset="multi-turn", num_sessions=3, num_turns=4).num_requests == 12
