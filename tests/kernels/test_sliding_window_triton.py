"""Sliding-window attention and logit soft-capping in the Triton kernels (decode, prefill
and their 4-bit variants) against the torch reference, under the interpreter.

Windows smaller than a block, not a multiple of the block size, exactly one block and
longer than every sequence; soft-cap alone and with a window; GQA; fp32/bf16/fp16
queries over same-dtype, FP8 and 4-bit caches; forced split counts (including splits
with nothing in the window) and small tiles so the masked, unmasked and causal key loops
all run. A last group points the block-table entries wholly behind each sequence's
window at a NaN-filled block: the output must still match the reference on a clean cache,
which proves those blocks are never read.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference as ref
from kvpilot.kernels.decode_attention import paged_decode_attention
from kvpilot.kernels.kv4 import GROUP_SCALE_DTYPE
from kvpilot.kernels.prefill_attention import paged_prefill_attention

from .cases import (
    BF16,
    E4M3,
    E5M2,
    F16,
    F32,
    SMALL_TILES,
    AttnCase,
    PagedBatch,
    assert_attention_close,
    store_new_tokens_reference,
)

# (sliding_window, logit_softcap). Pages are 8 or 16 tokens: 1 and 5 fit inside a
# block, 12 is not a multiple of either, 16 is one or two whole blocks, 500 is longer
# than any sequence here (the full context); None/3.0 is the soft-cap alone (the scores
# reach about +-4, well into tanh's bend) and 7/50.0 a Gemma-like cap near its linear range.
SETTINGS = [(1, None), (5, None), (12, 3.0), (16, None), (500, None), (None, 3.0), (7, 50.0)]
SETTING_IDS = [f"w{w}-cap{c}" for w, c in SETTINGS]

DECODE_SPECS = ((0, 1), (16, 1), (40, 1), (77, 1))
DECODE_CASES = [
    AttnCase("g1-f32-p16-d32-split3", 1, 2, 32, 16, F32, F32, DECODE_SPECS, 3, SMALL_TILES),
    AttnCase("g4-bf16-p8-d64-auto", 4, 1, 64, 8, BF16, BF16, ((3, 1), (30, 1), (61, 1)), None, SMALL_TILES),
    AttnCase("g3-f32-e4m3-p16-d64-split4", 3, 1, 64, 16, F32, E4M3, DECODE_SPECS, 4, SMALL_TILES),
    AttnCase("g2-f16-p8-d32-direct", 2, 2, 32, 8, F16, F16, ((5, 1), (44, 1)), 1),
    AttnCase("int4-g2-bf16-p8-d64-split2", 2, 1, 64, 8, BF16, "int4", ((9, 1), (50, 1)), 2, SMALL_TILES),
    AttnCase("fp4-g1-f32-p16-d64-direct", 1, 1, 64, 16, F32, "fp4_e2m1", ((0, 1), (37, 1)), 1),
]

# Fresh prompts, a 1-token step, chunks starting mid-block after a cached prefix, a long
# chunk over several query tiles, in one batch.
PREFILL_SPECS = ((0, 1), (0, 19), (6, 11), (16, 16), (21, 40), (37, 1))
SMALL_PREFILL_TILES = (("BLOCK_M", 16), ("BLOCK_N", 16))
PREFILL_CASES = [
    AttnCase("g1-f32-p16-d32", 1, 2, 32, 16, F32, F32, PREFILL_SPECS),
    AttnCase("g3-bf16-p8-d64-small-tiles", 3, 1, 64, 8, BF16, BF16, PREFILL_SPECS, None, SMALL_PREFILL_TILES),
    AttnCase("g4-f32-e4m3-p16-d64", 4, 1, 64, 16, F32, E4M3, PREFILL_SPECS, None, (("BLOCK_M", 32), ("BLOCK_N", 16))),
    AttnCase("g2-f16-e5m2-p8-d32", 2, 1, 32, 8, F16, E5M2, ((4, 13), (30, 9))),
    AttnCase("int4-g3-bf16-p8-d64-small-tiles", 3, 1, 64, 8, BF16, "int4", PREFILL_SPECS, None,
             SMALL_PREFILL_TILES),
    AttnCase("fp4-g1-f32-p16-d64", 1, 1, 64, 16, F32, "fp4_e2m1", ((0, 17), (23, 12), (40, 1))),
]


def expected(b: PagedBatch, window: int | None, cap: float | None) -> torch.Tensor:
    """fp32 reference over the batch's cache (new tokens stored)."""
    return ref.paged_attention(
        b.q.float(), b.key_cache, b.value_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.scale,
        b.k_scale, b.v_scale, **b.kv4, sliding_window=window, logit_softcap=cap,
    )


def run_decode(case: AttnCase, b: PagedBatch, window: int | None, cap: float | None) -> torch.Tensor:
    return paged_decode_attention(
        b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.scale, b.k_scale, b.v_scale,
        max_seq_len=b.max_seq_len, num_splits=case.num_splits, config=dict(case.config), **b.kv4,
        sliding_window=window, logit_softcap=cap,
    )


def run_prefill(case: AttnCase, b: PagedBatch, window: int | None, cap: float | None) -> torch.Tensor:
    return paged_prefill_attention(
        b.q, b.key_cache, b.value_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.scale, b.k_scale,
        b.v_scale, max_query_len=b.max_query_len, config=dict(case.config), **b.kv4,
        sliding_window=window, logit_softcap=cap,
    )


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(("window", "cap"), SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.id for c in DECODE_CASES])
def test_decode_window_and_softcap_match_reference(case, window, cap):
    b = case.batch()
    store_new_tokens_reference(b)
    out = run_decode(case, b, window, cap)
    assert out.dtype == case.dtype and out.shape == b.q.shape
    assert_attention_close(out, expected(b, window, cap), case.dtype, f"decode {case.id} w={window} cap={cap}")


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(("window", "cap"), SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c.id for c in PREFILL_CASES])
def test_prefill_window_and_softcap_match_reference(case, window, cap):
    b = case.batch()
    store_new_tokens_reference(b)
    out = run_prefill(case, b, window, cap)
    assert out.dtype == case.dtype and out.shape == b.q.shape
    assert_attention_close(out, expected(b, window, cap), case.dtype, f"prefill {case.id} w={window} cap={cap}")


def poison_blocks_behind_window(b: PagedBatch, window: int) -> int:
    """Append a NaN block to the caches (NaN values, or NaN group scales for a 4-bit
    cache) and point every block-table entry that lies wholly before the window of its
    sequence's first new token at it, as a cache manager that frees such blocks would.
    Returns the number of entries redirected."""
    page = b.key_cache.shape[1]

    def with_nan_block(cache: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([cache, fill.expand(1, *cache.shape[1:]).clone()])

    if b.kv4_format is not None:
        nan_scale = torch.tensor(float("nan")).to(GROUP_SCALE_DTYPE)
        assert b.key_group_scales is not None and b.value_group_scales is not None
        b.key_group_scales = with_nan_block(b.key_group_scales, nan_scale)
        b.value_group_scales = with_nan_block(b.value_group_scales, nan_scale)
        code = torch.tensor(0x77, dtype=torch.uint8)
        b.key_cache, b.value_cache = with_nan_block(b.key_cache, code), with_nan_block(b.value_cache, code)
    else:
        nan = torch.tensor(float("nan")).to(b.key_cache.dtype)
        b.key_cache, b.value_cache = with_nan_block(b.key_cache, nan), with_nan_block(b.value_cache, nan)
    null_block = b.key_cache.shape[0] - 1
    redirected = 0
    tables = b.block_tables.clone()
    for i, (cached, _) in enumerate(b.specs):
        first_query = cached  # position of the sequence's first new token
        dead = max(0, first_query - window + 1) // page  # blocks [0, dead) hold no visible key
        tables[i, :dead] = null_block
        redirected += dead
    b.block_tables = tables
    return redirected


NAN_CASES = [
    ("decode", DECODE_CASES[0], 5, None),
    ("decode", DECODE_CASES[1], 12, 3.0),
    ("decode", DECODE_CASES[2], 16, None),
    ("decode", DECODE_CASES[4], 7, 50.0),
    ("prefill", PREFILL_CASES[0], 5, None),
    ("prefill", PREFILL_CASES[1], 12, 3.0),
    ("prefill", PREFILL_CASES[2], 16, None),
    ("prefill", PREFILL_CASES[4], 7, None),
]


@pytest.mark.triton_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the poisoned full-context run
@pytest.mark.parametrize(
    ("kind", "case", "window", "cap"), NAN_CASES, ids=[f"{k}-{c.id}-w{w}" for k, c, w, _ in NAN_CASES]
)
def test_blocks_behind_the_window_are_never_read(kind, case, window, cap):
    b = case.batch()
    store_new_tokens_reference(b)
    expect = expected(b, window, cap)  # the clean cache
    expect_full = expected(b, None, cap)
    assert poison_blocks_behind_window(b, window) > 0, "the case must have blocks behind the window"
    run = run_decode if kind == "decode" else run_prefill
    out = run(case, b, window, cap)
    assert_attention_close(out, expect, case.dtype, f"{kind} {case.id} with NaN blocks behind w={window}")
    # The poison is live: attention over the whole context reads it (NaN; under the
    # interpreter an FP8 NaN byte decodes to a large finite value instead).
    full = run(case, b, None, cap).float()
    assert not bool(torch.isfinite(full).all()) or not torch.allclose(full, expect_full, atol=0.1)


@pytest.mark.triton_interpreter
def test_decode_splits_share_out_the_window_only():
    """Many forced splits over a short window: most splits hold no key (their partial
    result must drop out of the merge), and the output stays finite and exact."""
    case = AttnCase("g1-f32-p8-d32-split8", 1, 1, 32, 8, F32, F32, ((90, 1), (3, 1)), 8, SMALL_TILES)
    b = case.batch()
    store_new_tokens_reference(b)
    for window in (3, 20, 40):
        out = run_decode(case, b, window, None)
        assert_attention_close(out, expected(b, window, None), F32, f"decode 8 splits w={window}")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sliding_window": 0}, "sliding_window must be >= 1"),
        ({"logit_softcap": 0.0}, "logit_softcap must be positive"),
        ({"logit_softcap": float("inf")}, "logit_softcap must be positive"),
    ],
)
def test_bad_window_or_softcap_is_refused(kwargs, match):
    kc = torch.zeros(2, 16, 1, 32)
    q = torch.zeros(1, 1, 32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(q, kc, kc, table, one, 0.1, **kwargs)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(q, kc, kc, table, torch.tensor([0, 1], dtype=torch.int32), one, 0.1, **kwargs)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"), [(F32, F32), (BF16, E4M3), (F32, "int4")], ids=["fp32", "bf16-e4m3", "fp32-int4"]
)
def test_backend_mixed_batch_window_and_softcap_match_torch_backend(dtype, cache_dtype):
    """The ``triton`` backend runs the window and soft-cap in its kernels (decodes and
    prefill chunks of one batch) and agrees with the ``torch`` backend."""
    from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend
    from tests.engine.test_triton_backend import layer_and_meta

    from .cases import make_paged_batch

    specs = [(9, 1), (40, 1), (0, 1), (0, 12), (27, 9), (32, 1)]
    b = make_paged_batch(specs, num_kv_heads=2, group=2, head_dim=64, page=16, dtype=dtype,
                         cache_dtype=cache_dtype, seed=5)
    cpu = torch.device("cpu")
    outs = []
    for backend in (TorchAttentionBackend(cpu), TritonAttentionBackend(cpu)):
        kv, meta = layer_and_meta(b, cache_dtype, False)
        outs.append(backend.forward(b.q, b.key, b.value, kv, meta, b.scale, sliding_window=10, logit_softcap=4.0))
    assert_attention_close(outs[1], outs[0].float(), dtype, "triton vs torch backend, window 10, cap 4")
