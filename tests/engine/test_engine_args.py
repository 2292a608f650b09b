"""Engine flags resolved as vLLM resolves them: a small --max-num-batched-tokens lowers the
default --max-num-seqs instead of failing; an explicit conflicting pair is refused by name."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.engine.config import DEFAULT_MAX_NUM_SEQS, EngineArgs


def parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def test_default_max_num_seqs_is_256():
    assert parse().max_num_seqs == DEFAULT_MAX_NUM_SEQS == 256
    assert EngineArgs().max_num_seqs == 256


def test_a_small_token_budget_lowers_the_default_max_num_seqs():
    assert parse("--max-num-batched-tokens", "64").max_num_seqs == 64
    assert EngineArgs(max_num_batched_tokens=8).max_num_seqs == 8


def test_an_explicit_max_num_seqs_is_kept():
    assert parse("--max-num-batched-tokens", "64", "--max-num-seqs", "16").max_num_seqs == 16


def test_an_explicit_conflicting_pair_is_refused_naming_both_flags():
    with pytest.raises(ValueError, match=r"--max-num-seqs \(256\) must be <= --max-num-batched-tokens \(64\)"):
        parse("--max-num-batched-tokens", "64", "--max-num-seqs", "256")


def test_calculate_kv_scales_is_off_unless_asked():
    assert parse().calculate_kv_scales is False
    assert parse("--calculate-kv-scales").calculate_kv_scales is True
