"""The WNA16 GEMM on CPU (C++) against ``x @ W.T`` of the dequantized matrix, computed
here in float64 from the codes: 4 and 8 bits, groups 32/64/128 (the vectorized path)
and sizes it does not take (the per-row path), fp32/bf16/fp16 scales, fp32 and bf16
activations, 1 to 32 rows, ``N`` not a multiple of any tile. fp32 dequantization and
accumulation: 1e-5 relative (the bound is summation order, about 1e-7 here). A row's
result is the same bits alone or in any batch; bad input is refused by the kernel.

The float-weight GEMM (an LM head read in place: fp32, bf16 or fp16 rows) the same way,
against ``x @ W.double().T``.

And the INT8 W8A8 passes around ``torch._int_mm`` (per-token activation quantization and
the scale epilogue): the same bits as their torch formulation in
``engine/quantization/weights.py``, on the 16-lane and the scalar tails."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import cpu_attention

ok, why = cpu_attention.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the CPU kernels here: {why}")

if ok:
    from kvpilot.kernels import cpu_quant_gemm as cq
    from kvpilot.kernels.cpu_quant_gemm import wna16_gemm

TOL = 1e-5
SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make(n: int, k: int, bits: int, group: int, sdt: torch.dtype, seed: int = 0):
    """Random codes, scales in [0.01, 0.06) and offsets in (-scale * 2^bits, 0] (asymmetric
    zero points), packed in the canonical layout; and the dense float64 matrix."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=gen) * 0.05 + 0.01).to(sdt)
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=gen).float()
    o = (-zero * s.float()).to(sdt)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if bits == 4 else q
    dense = (q.double().view(n, -1, group) * s.double()[..., None] + o.double()[..., None]).view(n, k)
    return packed, s, o, dense


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
@pytest.mark.parametrize("sdt", SCALE_DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_product_matches_the_dequantized_matrix_in_fp32(bits, group, sdt, m):
    n, k = 100, 384  # 100 rows: no multiple of 3, 8, 24
    q, s, o, dense = make(n, k, bits, group, sdt, seed=bits * group + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = wna16_gemm(x, q, s, o, bits, group)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert rel(got, x.double() @ dense.T) < TOL


@pytest.mark.parametrize("bits,group,k", [(4, 16, 96), (4, 48, 96), (4, 40, 40), (8, 8, 96), (8, 24, 72),
                                          (8, 40, 40), (4, 96, 96)])
def test_group_sizes_off_the_vector_path_are_exact_too(bits, group, k):
    """Groups that are not a multiple of 32 (4 bits) or 16 (8 bits), and one-group rows
    of a ``K`` that is not a multiple of 32, take the per-row path; 96 is the vector path
    with three blocks per group."""
    q, s, o, dense = make(37, k, bits, group, torch.float16, seed=group)
    for m in (1, 5, 11):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert rel(wna16_gemm(x, q, s, o, bits, group), x.double() @ dense.T) < TOL


@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_activations_are_read_as_they_are(bits):
    q, s, o, dense = make(64, 256, bits, 32, torch.bfloat16)
    x = torch.randn(6, 256).to(torch.bfloat16)
    assert rel(wna16_gemm(x, q, s, o, bits, 32), x.double() @ dense.T) < TOL


def test_extreme_codes_and_a_strided_input():
    """All-zero and all-maximum codes (the nibble masks' edges) and ``x`` as a column
    slice of a wider tensor (rows not K apart)."""
    for bits in (4, 8):
        q, s, o, dense = make(24, 128, bits, 32, torch.float32)
        top = (1 << bits) - 1
        q = q.clone()
        q[:8] = 0
        q[8:16] = 0xFF  # 4 bits: both nibbles 15
        dense = dense.clone()
        codes = torch.zeros(8, 128, dtype=torch.float64)
        dense[:8] = (codes.view(8, -1, 32) * s[:8].double()[..., None] + o[:8].double()[..., None]).view(8, 128)
        dense[8:16] = ((codes + top).view(8, -1, 32) * s[8:16].double()[..., None]
                       + o[8:16].double()[..., None]).view(8, 128)
        wide = torch.randn(5, 200)
        x = wide[:, 30:158]
        assert x.stride(0) == 200
        assert rel(wna16_gemm(x, q, s, o, bits, 32), x.double() @ dense.T) < TOL


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 48)])
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(bits, group):
    q, s, o, _ = make(72, 576, bits, group, torch.bfloat16)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(5))
    full = wna16_gemm(x, q, s, o, bits, group)
    for rows in (slice(0, 1), slice(31, 32), slice(3, 5), slice(8, 17), slice(10, 32)):
        assert torch.equal(wna16_gemm(x[rows], q, s, o, bits, group), full[rows]), rows


def test_the_thread_count_does_not_change_a_bit():
    """Each output row is one work item's, summed in one order: 1 and 2 threads agree."""
    q, s, o, _ = make(2000, 576, 4, 32, torch.float16)  # enough work for the pool
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(9))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = wna16_gemm(x, q, s, o, 4, 32)
        torch.set_num_threads(2)
        assert torch.equal(wna16_gemm(x, q, s, o, 4, 32), one)
    finally:
        torch.set_num_threads(before)


def test_empty_inputs():
    q, s, o, _ = make(16, 64, 4, 32, torch.float32)
    assert wna16_gemm(torch.zeros(0, 64), q, s, o, 4, 32).shape == (0, 16)


def test_bad_input_is_refused_by_the_kernel():
    q, s, o, _ = make(16, 64, 4, 32, torch.float32)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="does not hold 4-bit rows of K = 64"):
        wna16_gemm(x, q[:, :16].contiguous(), s, o, 4, 32)
    with pytest.raises(RuntimeError, match="group size 48 does not divide K = 64"):
        wna16_gemm(x, q, s, o, 4, 48)
    with pytest.raises(RuntimeError, match="scales and offsets must be contiguous"):
        wna16_gemm(x, q, s[:, :1], o[:, :1], 4, 32)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        wna16_gemm(x, q, s, o, 2, 32)
    with pytest.raises(RuntimeError, match="qweight must be contiguous uint8"):  # the dtype
        wna16_gemm(x, q.to(torch.int8), s, o, 4, 32)
    with pytest.raises(RuntimeError, match="scales must be float32, bfloat16 or float16"):
        wna16_gemm(x, q, s.double(), o.double(), 4, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576, 1536), (7, 70, 33), (40, 64, 48)])
@pytest.mark.parametrize("static", [None, 0.037])
def test_int8_passes_give_the_bits_of_the_torch_formulation(dtype, shape, static):
    from kvpilot.engine.quantization.weights import quantize_int8_rows

    t, k, n = shape
    gen = torch.Generator().manual_seed(t * k + n)
    x = (torch.randn(t, k, generator=gen) * torch.rand(t, 1, generator=gen) * 5).to(dtype)
    x[0, :3] = 0.0
    if t > 2:
        x[1] = 0.0  # an all-zero row: the scale's 1e-10 floor
        x[2, 5] = 1e-3 * float(x[2].abs().max())  # and a value that rounds to zero
    want_q, want_s = quantize_int8_rows(x, static)
    got_q, got_s = cq.int8_quantize_rows(x, static)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)
    if static is None:
        assert int(got_q.abs().amax(-1).min()) == 127 or t > 2  # the largest |x| maps to 127
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    sw = torch.rand(n, generator=gen) * 0.01
    acc = want_q.int() @ w.t().int()
    want = (acc.float() * want_s * sw[None, :]).to(dtype)
    got = cq.int8_scale(acc, got_s, sw, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_int8_passes_refuse_bad_input():
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        cq.int8_quantize_rows(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="acc must be a contiguous int32"):
        cq.int8_scale(torch.zeros(2, 4), torch.ones(2, 1), torch.ones(4), torch.float32)
    with pytest.raises(RuntimeError, match="sw must be a contiguous float32 \\[N\\]"):
        cq.int8_scale(torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, 1), torch.ones(3), torch.float32)


# ------------------------------------------------------------------ float weights
@pytest.mark.parametrize("m", [1, 3, 5, 32])
@pytest.mark.parametrize("k,n", [(576, 1003), (64, 7), (40, 9)])  # 40: off the 16-column vector path
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16, torch.float16])
def test_float_weights_multiply_exactly_in_fp32(wdt, k, n, m):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    w = torch.randn(n, k, generator=gen).to(wdt)
    x = torch.randn(m, k, generator=gen)
    got = cq.float_gemm(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert rel(got, x.double() @ w.double().T) <= TOL
    assert torch.equal(cq.float_gemm(x.bfloat16(), w), cq.float_gemm(x.bfloat16().float(), w))


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16, torch.float16])
def test_float_weights_a_row_gives_the_same_bits_alone_and_in_any_batch(wdt):
    w = torch.randn(200, 576, generator=torch.Generator().manual_seed(1)).to(wdt)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(2))
    full = cq.float_gemm(x, w)
    for rows in (slice(0, 1), slice(31, 32), slice(3, 5), slice(8, 17), slice(10, 32)):
        assert torch.equal(cq.float_gemm(x[rows], w), full[rows]), rows


def test_float_weights_bad_input_is_refused_by_the_kernel():
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="weight must be float32, bfloat16 or float16, got Double"):
        cq.float_gemm(x, torch.zeros(4, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight must be contiguous \\[N, 64\\]"):
        cq.float_gemm(x, torch.zeros(4, 32, dtype=torch.bfloat16))
    assert cq.float_gemm(torch.zeros(0, 64), torch.zeros(4, 64)).shape == (0, 4)
