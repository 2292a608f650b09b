"""The SGMV multi-LoRA kernels under the interpreter against the torch reference (a loop
over segments) and against a dense per-token einsum in float64: decode-length and
prefill-length segments mixed, slot -1 and empty segments, repeated slots, ranks below
R (the zero tail unread), sizes not multiples of the tiles, fp32 (tight) and bf16
(loose), T = 1, G = 0; the split reduction, the chunked segment scan, strided ``y``; and
the argument checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvpilot.kernels.lora_sgmv import (
    sgmv_lora,
    sgmv_lora_reference,
    sgmv_lora_with_config,
)


@dataclass
class Batch:
    y: torch.Tensor
    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    ranks: torch.Tensor | None

    def args(self, y: torch.Tensor | None = None) -> tuple:
        return (self.y if y is None else y, self.x, self.lora_a, self.lora_b, self.seg_starts,
                self.seg_slots, self.ranks)


def make_batch(seg_lens, slots, *, num_slots=3, width=8, in_features=40, out_features=72,
               dtype=torch.float32, ranks=None, tail=0.0, seed=0) -> Batch:
    """Random activations and adapters (O(1) outputs). Rows of A and columns of B past a
    slot's rank (``ranks``) hold ``tail``: 0 as the engine stores them, or garbage to show
    they are never read."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(seg_lens)
    x = torch.randn(num_tokens, in_features, generator=gen)
    y = torch.randn(num_tokens, out_features, generator=gen)
    lora_a = torch.randn(num_slots, width, in_features, generator=gen) / in_features**0.5
    lora_b = torch.randn(num_slots, out_features, width, generator=gen) / width**0.5
    if ranks is not None:
        for s, r in enumerate(ranks):
            lora_a[s, r:] = tail
            lora_b[s, :, r:] = tail
    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + n)
    return Batch(
        y.to(dtype), x.to(dtype), lora_a.to(dtype), lora_b.to(dtype),
        torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32),
        None if ranks is None else torch.tensor(ranks, dtype=torch.int32),
    )


def dense_oracle(b: Batch) -> torch.Tensor:
    """``y + B[slot_t] @ (A[slot_t] @ x_t)`` per token in float64, from each token's slot
    (zero for slot -1); a slot's rank cuts A's rows and B's columns."""
    slot_of = torch.repeat_interleave(b.seg_slots.long(), (b.seg_starts[1:] - b.seg_starts[:-1]).long())
    a, bb = b.lora_a.double().clone(), b.lora_b.double().clone()
    if b.ranks is not None:
        for s, r in enumerate(b.ranks.tolist()):
            a[s, r:] = 0.0
            bb[s, :, r:] = 0.0
    on = slot_of >= 0
    idx = slot_of.clamp(min=0)
    shrunk = torch.einsum("ti,tri->tr", b.x.double(), a[idx])
    delta = torch.einsum("tr,tor->to", shrunk, bb[idx]) * on[:, None]
    return b.y.double() + delta


# (id, segment lengths, slot per segment)
SEGMENTS = [
    ("decode", [1, 1, 1, 1, 1], [0, 2, -1, 1, 2]),
    ("prefill", [19, 33], [1, 0]),
    ("mixed", [1, 1, 23, 0, 1, 17, 2], [2, -1, 0, 1, 0, -1, 2]),  # an empty segment too
    ("one-token", [1], [1]),
]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}
ORACLE_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def run_and_compare(b: Batch, dtype: torch.dtype) -> torch.Tensor:
    got = b.y.clone()
    inputs = [t.clone() for t in (b.x, b.lora_a, b.lora_b, b.seg_starts, b.seg_slots)]
    sgmv_lora(*b.args(got))
    want = b.y.clone()
    sgmv_lora_reference(*b.args(want))
    assert got.dtype == dtype and got.shape == b.y.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got.double(), dense_oracle(b), **ORACLE_TOL[dtype])
    for before, after in zip(inputs, (b.x, b.lora_a, b.lora_b, b.seg_starts, b.seg_slots)):
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)  # only y is written
    return got


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("seg_lens", "slots"), [s[1:] for s in SEGMENTS], ids=[s[0] for s in SEGMENTS])
def test_sgmv_matches_reference_and_dense_einsum(seg_lens, slots, dtype):
    b = make_batch(seg_lens, slots, dtype=dtype)
    got = run_and_compare(b, dtype)
    # tokens of slot -1 keep y bit for bit
    for g, slot in enumerate(slots):
        lo, hi = b.seg_starts[g].item(), b.seg_starts[g + 1].item()
        if slot < 0:
            assert torch.equal(got[lo:hi], b.y[lo:hi])


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sizes_that_are_not_multiples_of_the_tiles(dtype):
    """in 70 and out 100 over 32-wide tiles, R = 12 in a 16-wide rank tile, 5 slots."""
    b = make_batch([3, 1, 21, 1], [4, 0, 3, 4], num_slots=5, width=12, in_features=70,
                   out_features=100, dtype=dtype, seed=3)
    run_and_compare(b, dtype)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ranks_below_r_leave_the_tail_unread(dtype):
    """NaN past each slot's rank in A and B: the kernels never read it (the reference
    slices it off); rank 0 adds nothing."""
    b = make_batch([1, 18, 1, 5, 1], [0, 1, 2, 3, 1], num_slots=4, width=16, ranks=[4, 16, 0, 9],
                   tail=float("nan"), dtype=dtype, seed=5)
    got = run_and_compare(b, dtype)
    assert torch.isfinite(got).all()
    assert torch.equal(got[19], b.y[19])  # the token of the rank-0 slot


@pytest.mark.triton_interpreter
def test_ranks_match_the_full_width_over_a_zero_tail():
    b = make_batch([2, 1, 9], [2, 0, 1], width=16, ranks=[3, 7, 16], tail=0.0, seed=7)
    with_ranks = b.y.clone()
    sgmv_lora(*b.args(with_ranks))
    full = b.y.clone()
    sgmv_lora(full, b.x, b.lora_a, b.lora_b, b.seg_starts, b.seg_slots, None)
    torch.testing.assert_close(with_ranks, full, rtol=1e-6, atol=1e-6)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(
    "config",
    [
        {"SPLIT_K": 1},
        {"SPLIT_K": 3, "BLOCK_K": 16},  # 5 k-blocks in 3 splits: the last split is short
        {"SPLIT_K": 16, "BLOCK_K": 32},  # more splits than k-blocks: clamped
        {"SHRINK_BLOCK_M": 32, "EXPAND_BLOCK_M": 32, "BLOCK_N": 64},
        {"BLOCK_G": 16},  # 40 segments scanned in 3 chunks
    ],
    ids=["split1", "split3", "split-clamped", "block-m32", "scan-chunks"],
)
def test_launch_settings_give_the_same_sums(config):
    lens = [1] * 30 + [0, 3, 1, 35, 2] + [1] * 5
    slots = [(i % 4) - 1 for i in range(len(lens))]
    b = make_batch(lens, slots, in_features=72, seed=11)
    got = b.y.clone()
    sgmv_lora_with_config(*b.args(got), config)
    want = b.y.clone()
    sgmv_lora_reference(*b.args(want))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.triton_interpreter
def test_y_may_be_a_column_slice_and_x_strided():
    """y as the middle columns of a fused output (its other columns untouched), x a
    transposed view."""
    b = make_batch([4, 1, 6], [1, -1, 0], seed=13)
    fused = torch.randn(b.y.shape[0], 8 + b.y.shape[1] + 8)
    fused[:, 8:-8] = b.y
    before = fused.clone()
    x_t = b.x.t().contiguous().t()
    assert x_t.stride() != b.x.stride()
    sgmv_lora(fused[:, 8:-8], x_t, b.lora_a, b.lora_b, b.seg_starts, b.seg_slots)
    want = b.y.clone()
    sgmv_lora_reference(*b.args(want))
    torch.testing.assert_close(fused[:, 8:-8], want, **TOL[torch.float32])
    assert torch.equal(fused[:, :8], before[:, :8]) and torch.equal(fused[:, -8:], before[:, -8:])


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(("seg_lens", "slots"), [([], []), ([0], [1]), ([0, 0], [-1, 2])],
                         ids=["G=0", "one-empty-segment", "empty-segments"])
def test_empty_input_is_a_no_op(seg_lens, slots):
    b = make_batch(seg_lens, slots)
    assert b.y.shape[0] == 0
    sgmv_lora(*b.args())
    sgmv_lora_reference(*b.args())


@pytest.mark.triton_interpreter
def test_all_base_model_segments_leave_y_alone():
    b = make_batch([3, 1, 5], [-1, -1, -1])
    got = b.y.clone()
    sgmv_lora(*b.args(got))
    assert torch.equal(got, b.y)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.update(lora_a=a["lora_a"][:, :, :-1]), "lora_a must be"),
        (lambda a: a.update(lora_b=a["lora_b"][:, :-1]), "lora_b must be"),
        (lambda a: a.update(lora_b=a["lora_b"][:2]), "lora_b must be"),
        (lambda a: a.update(y=a["y"][:-1]), "y must be"),
        (lambda a: a.update(x=a["x"][0]), "x must be"),
        (lambda a: a.update(x=a["x"].int()), "x must be"),
        (lambda a: a.update(y=a["y"].double()), "y is torch.float64"),
        (lambda a: a.update(lora_b=a["lora_b"].half()), "lora_b is torch.float16"),
        (lambda a: a.update(seg_starts=a["seg_starts"].long()), "seg_starts must be int32"),
        (lambda a: a.update(seg_starts=a["seg_starts"][:0]), "seg_starts must be int32"),
        (lambda a: a.update(seg_slots=a["seg_slots"][:-1]), "seg_slots must be int32"),
        (lambda a: a.update(ranks=torch.tensor([1, 2], dtype=torch.int32)), "ranks must be int32"),
        (lambda a: a.update(ranks=torch.tensor([1, 2, 3])), "ranks must be int32"),
    ],
    ids=["a-in", "b-out", "b-slots", "y-tokens", "x-1d", "x-int", "y-dtype", "b-dtype",
         "starts-int64", "starts-empty", "slots-count", "ranks-count", "ranks-int64"],
)
@pytest.mark.parametrize("fn", [sgmv_lora, sgmv_lora_reference], ids=["kernel", "reference"])
def test_bad_shapes_and_dtypes_raise_value_error_naming_the_argument(fn, change, match):
    b = make_batch([2, 3], [0, 1])
    args = dict(zip(("y", "x", "lora_a", "lora_b", "seg_starts", "seg_slots", "ranks"), b.args()))
    change(args)
    with pytest.raises(ValueError, match=match):
        fn(**args)


@pytest.mark.parametrize(
    ("starts", "slots", "ranks", "match"),
    [
        ([0, 3, 2, 5], [0, 1, 2], None, "seg_starts must rise"),
        ([1, 3, 5], [0, 1], None, "seg_starts must rise"),
        ([0, 3, 4], [0, 1], None, "seg_starts must rise"),
        ([0, 3, 5], [0, 3], None, "seg_slots must be in"),
        ([0, 3, 5], [-2, 0], None, "seg_slots must be in"),
        ([0, 3, 5], [0, 1], [1, 9, 2], "ranks must be in"),
    ],
)
def test_reference_checks_the_index_values(starts, slots, ranks, match):
    b = make_batch([2, 3], [0, 1])
    with pytest.raises(ValueError, match=match):
        sgmv_lora_reference(b.y, b.x, b.lora_a, b.lora_b, torch.tensor(starts, dtype=torch.int32),
                            torch.tensor(slots, dtype=torch.int32),
                            None if ranks is None else torch.tensor(ranks, dtype=torch.int32))


def test_config_rejects_unknown_keys_and_bad_tiles():
    b = make_batch([2, 3], [0, 1])
    with pytest.raises(ValueError, match="config keys \\['BLOCK_X'\\]"):
        sgmv_lora_with_config(*b.args(), {"BLOCK_X": 16})
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two >= 16"):
        sgmv_lora_with_config(*b.args(), {"BLOCK_N": 24})
    with pytest.raises(ValueError, match="SPLIT_K must be >= 1"):
        sgmv_lora_with_config(*b.args(), {"SPLIT_K": 0})
