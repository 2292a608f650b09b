"""Split-KV paged decode against the torch reference: GQA groups 1/3/4/8, pages 8/16/32,
head_dim 64/128, fp32/fp16/bf16 with same-dtype, e4m3 and e5m2 caches, one split (direct
output), forced splits with empty ones, and the automatic choice."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.decode_attention import choose_num_splits, paged_decode_attention

from .cases import DECODE_CASES, KV4_DECODE_CASES, run_decode_case


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.id for c in DECODE_CASES])
def test_decode_matches_reference(case):
    run_decode_case(case)


@pytest.mark.parametrize(
    ("num_seqs", "kv_heads", "max_len", "sms", "expect"),
    [
        (64, 8, 4096, 132, 2),  # full batch: 512 programs, ~4 per SM with 2 splits
        (1, 8, 32768, 132, 64),  # one long sequence: the cap
        (1, 8, 1000, 132, 4),  # never below 256 tokens per split
        (256, 8, 4096, 132, 1),  # enough programs already
        (1, 1, 1, 132, 1),
    ],
)
def test_number_of_splits_fills_the_gpu_without_tiny_splits(
    num_seqs, kv_heads, max_len, sms, expect
):
    assert choose_num_splits(num_seqs, kv_heads, max_len, sms, 64) == expect


def test_decode_rejects_a_block_table_too_short_for_the_context():
    kc = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="exceeds the block table"):
        paged_decode_attention(
            q,
            kc,
            kc,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([17], dtype=torch.int32),
            0.1,
            max_seq_len=17,
        )


def test_decode_rejects_heads_that_do_not_divide():
    kc = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="multiple of the cache's num_kv_heads"):
        paged_decode_attention(
            torch.zeros(1, 3, 64),
            kc,
            kc,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            0.1,
        )


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("case", KV4_DECODE_CASES, ids=[c.id for c in KV4_DECODE_CASES])
def test_decode_over_a_4bit_cache_matches_reference(case):
    run_decode_case(case)
