"""The in-place CPU paged decode (C++) against the torch reference: every cache dtype
(fp32/bf16/fp16, FP8 E4M3/E5M2, fp4_e2m1, int4), GQA groups 1-8, pages 8-32, head_dim
64-128, contexts of one token to several hundred, mixed lengths in one batch; batch
invariance; bad block tables refused."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import cpu_attention

from .cases import (
    DECODE_CASES,
    KV4_DECODE_CASES,
    AttnCase,
    assert_attention_close,
    reference_attention,
    store_new_tokens_reference,
)

ok, why = cpu_attention.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the CPU kernels here: {why}")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# Beyond the shared cases: long contexts of very different lengths in one batch (the
# reference buckets them; the kernel walks each one's own table), fp32 queries over
# FP8 and 4-bit caches, a group of 16.
MIXED = ((0, 1), (700, 1), (15, 1), (255, 1), (31, 1))
EXTRA_CASES = [
    AttnCase("mixed-g3-f32-p16-d64", 3, 3, 64, 16, F32, F32, MIXED),
    AttnCase("mixed-g3-f32-e4m3-p16-d64", 3, 3, 64, 16, F32, E4M3, MIXED),
    AttnCase("mixed-g2-f32-e5m2-p32-d128", 2, 2, 128, 32, F32, E5M2, MIXED),
    AttnCase("mixed-g3-f32-fp4-p16-d64", 3, 3, 64, 16, F32, "fp4_e2m1", MIXED),
    AttnCase("mixed-g3-bf16-int4-p16-d64", 3, 3, 64, 16, BF16, "int4", MIXED),
    AttnCase("g16-f32-p16-d64", 16, 1, 64, 16, F32, F32, ((5, 1), (40, 1))),
]
CASES = DECODE_CASES + KV4_DECODE_CASES + EXTRA_CASES


def run_case(case: AttnCase) -> tuple[torch.Tensor, torch.Tensor]:
    b = case.batch("cpu")
    store_new_tokens_reference(b)
    out = cpu_attention.paged_decode_attention(
        b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale, b.k_scale, b.v_scale, **b.kv4
    )
    return out, reference_attention(b)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decode_matches_the_reference(case):
    out, expect = run_case(case)
    assert out.dtype == case.dtype and out.shape == expect.shape
    assert_attention_close(out, expect, case.dtype, f"cpu decode {case.id}")


def test_a_sequence_gives_the_same_bits_alone_and_in_any_batch():
    """Batch invariance: each (sequence, KV head) is one work item with a fixed summation
    order, so neighbours in the batch cannot change a sequence's bits."""
    b = EXTRA_CASES[1].batch("cpu")
    store_new_tokens_reference(b)

    def attend(rows: list[int]) -> torch.Tensor:
        idx = torch.tensor(rows)
        return cpu_attention.paged_decode_attention(
            b.q[idx], b.key_cache, b.value_cache, b.block_tables[idx], b.seq_lens[idx], b.scale, b.k_scale,
            b.v_scale,
        )

    together = attend(list(range(len(MIXED))))
    for i in range(len(MIXED)):
        assert torch.equal(attend([i])[0], together[i])
    assert torch.equal(attend([3, 1])[1], together[1])


def test_decode_refuses_a_context_longer_than_its_block_table():
    kc = torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        cpu_attention.paged_decode_attention(
            torch.zeros(1, 1, 64), kc, kc.clone(), torch.zeros(1, 2, dtype=torch.int32),
            torch.tensor([33], dtype=torch.int32), 0.125,
        )


def test_decode_refuses_a_block_id_outside_the_cache():
    kc = torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_attention.paged_decode_attention(
            torch.zeros(1, 1, 64), kc, kc.clone(), torch.tensor([[7]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), 0.125,
        )


def test_the_build_is_keyed_by_source_torch_compiler_and_cpu(monkeypatch):
    first = cpu_attention.build_dir()
    monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda: "flags : something else")
    assert cpu_attention.build_dir() != first


# Sliding windows and logit soft-caps (Mistral, Gemma 2): smaller than a page, not a
# multiple of it, longer than every context; caps alone and with a window.
MASKS = [(1, None), (5, None), (16, None), (37, 3.0), (None, 3.0), (None, 50.0), (4096, None)]
MASK_CASES = EXTRA_CASES[:5]


@pytest.mark.parametrize(("window", "cap"), MASKS, ids=[f"w{w}-cap{c}" for w, c in MASKS])
@pytest.mark.parametrize("case", MASK_CASES, ids=[c.id for c in MASK_CASES])
def test_window_and_softcap_match_the_reference(case, window, cap):
    from kvpilot.kernels import reference as ref

    b = case.batch("cpu")
    store_new_tokens_reference(b)
    out = cpu_attention.paged_decode_attention(
        b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale, b.k_scale, b.v_scale, **b.kv4,
        sliding_window=window, logit_softcap=cap,
    )
    expect = ref.paged_attention(
        b.q.float(), b.key_cache, b.value_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.scale,
        b.k_scale, b.v_scale, **b.kv4, sliding_window=window, logit_softcap=cap,
    )
    assert_attention_close(out, expect, case.dtype, f"cpu decode {case.id} w={window} cap={cap}")


def test_pages_behind_the_window_are_never_read():
    """Block-table entries wholly behind the window point at a NaN page, as after the KV
    cache manager freed them: the output is still the clean cache's."""
    from kvpilot.kernels import reference as ref

    case, window = EXTRA_CASES[0], 20  # fp32, pages of 16, contexts up to 701 tokens
    b = case.batch("cpu")
    store_new_tokens_reference(b)
    expect = ref.paged_attention(
        b.q.float(), b.key_cache, b.value_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.scale,
        b.k_scale, b.v_scale, sliding_window=window,
    )
    nan = torch.full((1, *b.key_cache.shape[1:]), float("nan"))
    key, value = torch.cat([b.key_cache, nan]), torch.cat([b.value_cache, nan])
    tables = b.block_tables.clone()
    for i, length in enumerate(b.seq_lens.tolist()):
        tables[i, : max(0, length - window) // case.page] = key.shape[0] - 1
    assert (tables == key.shape[0] - 1).sum() > 10
    out = cpu_attention.paged_decode_attention(q := b.q, key, value, tables, b.seq_lens, b.scale,
                                               sliding_window=window)
    assert_attention_close(out, expect, case.dtype, "cpu decode with NaN pages behind the window")
    full = cpu_attention.paged_decode_attention(q, key, value, tables, b.seq_lens, b.scale)
    assert not torch.isfinite(full).all()  # the poison is live for full attention


@pytest.mark.parametrize(("kwargs", "match"), [({"sliding_window": 0}, "sliding_window must be >= 1"),
                                               ({"logit_softcap": 0.0}, "logit_softcap must be finite"),
                                               ({"logit_softcap": float("inf")}, "logit_softcap must be finite")])
def test_a_bad_window_or_softcap_is_refused(kwargs, match):
    b = EXTRA_CASES[0].batch("cpu")
    with pytest.raises(ValueError, match=match):
        cpu_attention.paged_decode_attention(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale,
                                             **kwargs)
