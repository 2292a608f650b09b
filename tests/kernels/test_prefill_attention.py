"""Paged prefill/extend against the torch reference: new tokens over a cached prefix
(none, mid-block, whole blocks), causal among themselves, GQA groups 1/3/4/8, pages
8/16/32, fp32/fp16/bf16/e4m3/e5m2, one- and multi-tile query and key loops."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.prefill_attention import paged_prefill_attention

from .cases import (
    KV4_PREFILL_CASES,
    PREFILL_CASES,
    assert_attention_close,
    make_paged_batch,
    reference_attention,
    run_prefill_case,
    store_new_tokens_reference,
)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c.id for c in PREFILL_CASES])
def test_prefill_matches_reference(case):
    run_prefill_case(case)


@pytest.mark.triton_interpreter
def test_prefill_leaves_rows_of_sequences_it_was_not_given_alone():
    """The backend passes only the prefill sequences (query_start_loc starting after the
    decodes' rows); those rows must keep what the decode kernel wrote."""
    b = make_paged_batch(
        [(7, 1), (30, 1), (4, 9), (0, 5)],
        num_kv_heads=2,
        group=3,
        head_dim=64,
        page=16,
        dtype=torch.float32,
    )
    store_new_tokens_reference(b)
    out = torch.full_like(b.q, 7.0)
    paged_prefill_attention(
        b.q,
        b.key_cache,
        b.value_cache,
        b.block_tables[2:],
        b.query_start_loc[2:],
        b.seq_lens[2:],
        b.scale,
        out=out,
    )
    assert bool((out[:2] == 7.0).all())
    assert_attention_close(out[2:], reference_attention(b)[2:], torch.float32, "prefill subset")


def test_prefill_rejects_mismatched_query_start_loc():
    kc = torch.zeros(4, 16, 1, 64)
    with pytest.raises(ValueError, match="query_start_loc must be int32 \\[2\\]"):
        paged_prefill_attention(
            torch.zeros(3, 1, 64),
            kc,
            kc,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 1, 3], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            0.1,
        )


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", KV4_PREFILL_CASES, ids=[c.id for c in KV4_PREFILL_CASES])
def test_prefill_over_a_4bit_cache_matches_reference(case):
    run_prefill_case(case)
