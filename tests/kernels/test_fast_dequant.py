"""The CPU-fast page reads equal the plain references: every FP8 code converts exactly,
4-bit pages decode to the oracle's values (up to the rounding of one scale product),
and block gathers copy exactly whatever the dtype and row size."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference as ref
from kvpilot.kernels.fast_dequant import (
    FP8_HALF_FACTOR,
    dequantize_kv4_fast,
    fp8_as_half,
    gather_blocks,
)
from kvpilot.kernels.kv4 import dequantize_kv4, quantize_kv4


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_code_converts_exactly(fp8):
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(fp8).float()
    got = fp8_as_half(codes, fp8).float() * FP8_HALF_FACTOR[fp8]
    finite = torch.isfinite(expected)
    assert torch.equal(got[finite], expected[finite])
    assert int(finite.sum()) == (254 if fp8 == torch.float8_e4m3fn else 248)  # only NaN/inf codes left out
    if fp8 == torch.float8_e4m3fn:  # its NaN codes (never stored: writes clamp) read as +-480
        assert sorted(got[~finite].tolist()) == [-480.0, 480.0]


def test_fp8_as_half_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="raw uint8"):
        fp8_as_half(torch.zeros(2), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not float8"):
        fp8_as_half(torch.zeros(2, dtype=torch.uint8), torch.float16)


@pytest.mark.parametrize("fmt", ["fp4_e2m1", "int4"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_4bit_pages_decode_to_the_oracles_values(fmt, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(6, 4, 3, head_dim, generator=gen) * 5
    x[0, 0, 0] = 0.0  # an all-zero group: scale 0, codes 0
    x[1, 1, 1, :16] = 1e-4  # tiny values: E4M3 subnormal group scales
    for tensor_scale in (None, torch.tensor(0.0137)):
        packed, groups = quantize_kv4(x, fmt, 1.0 if tensor_scale is None else tensor_scale)
        want = dequantize_kv4(packed, groups, fmt, tensor_scale, torch.float32)
        got = dequantize_kv4_fast(packed, groups, fmt, tensor_scale, torch.float32)
        if tensor_scale is None:
            assert torch.equal(got, want)
        else:  # one rounding of group_scale x tensor_scale apart
            torch.testing.assert_close(got, want, rtol=2e-7, atol=0)
        assert got.dtype == torch.float32
        assert dequantize_kv4_fast(packed, groups, fmt, tensor_scale, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
@pytest.mark.parametrize("row", [(4, 2, 8), (1, 1, 3), (2, 1, 2)])
def test_gather_blocks_copies_whole_blocks_exactly(dtype, row):
    gen = torch.Generator().manual_seed(1)
    cache = torch.randint(0, 120, (9, *row), dtype=torch.uint8, generator=gen)  # no NaN codes
    cache = cache.view(torch.float8_e4m3fn).float().to(dtype) if dtype != torch.uint8 else cache
    blocks = torch.tensor([[3, 1, 8], [0, 0, 5]])
    got = gather_blocks(cache, blocks)
    assert got.shape == (2, 3, *row) and got.dtype == dtype
    assert torch.equal(got.view(torch.uint8) if dtype.itemsize == 1 else got,
                       cache.view(torch.uint8)[blocks] if dtype.itemsize == 1 else cache[blocks])


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_read_blocks_keeps_the_fp8_scale_out_of_the_pages(fp8):
    """The unscaled read returns the factor attention folds into the query / output; the
    scaled read applies it: both equal the plain dequantization."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5 * 4, 2, 16, generator=gen)
    scale = torch.tensor(0.02)
    cache = ref.quantize(x, fp8, scale).view(5, 4, 2, 16)
    blocks = torch.tensor([[4, 0, 2]])
    plain = ref.dequantize(cache[blocks], torch.float32, scale)
    unscaled, factor = ref.read_blocks_unscaled(cache, blocks, torch.float32, scale)
    assert factor is not None and float(factor) == pytest.approx(0.02 * FP8_HALF_FACTOR[fp8])
    torch.testing.assert_close(unscaled * factor, plain, rtol=2e-7, atol=0)
    torch.testing.assert_close(ref.read_blocks(cache, blocks, torch.float32, scale), plain, rtol=2e-7, atol=0)
