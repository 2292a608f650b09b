"""The quantized-GEMM kernels (kvpilot.kernels.quant_gemm) against their torch references,
and the references against an independent float64 dequantize-then-matmul oracle.

What runs here, on CPU under the Triton interpreter (the same kernel code as the GPU):

- WNA16: 4- and 8-bit codes, groups of 32/64/128, per channel (K not a multiple of the
  K tile), odd groups (48: 16-wide K tiles; 8: scales gathered per element), asymmetric
  and symmetric offsets, fp32/fp16/bf16 activations, bias or not; M = 1, odd M, M over
  the 16-row tile, N not a multiple of the 32-wide tile; split-K (even, uneven, forced
  off), strided activations.
- FP8: the activation quantizer (per token, 1 x g groups with a short last group,
  static; bit for bit against the reference), W8A8 per channel (dynamic and static) and
  block-wise (128 x 128 with N and K not multiples of 128, and other blocks), W8A16
  per channel and block-wise, out dtypes, bias. The interpreter's FP8 ``tl.dot``
  widens the FP8 operands exactly and sums fp32 products, so these checks cover the
  kernel's logic and its scaling, not the tensor cores' arithmetic.
- INT8: the quantizer (round half to even, clamping, static and dynamic; bit for bit)
  and W8A8 (bit for bit without split-K: the int32 sums are exact on both sides).
- The argument checks: every ValueError names the argument.

Only on a GPU (``TRITON_INTERPRET=0`` on a CUDA machine runs this file there, and
benchmarks/gpu_check.py's ``quant_gemm`` section at Llama-3-8B shapes): bf16/fp16 and
FP8/INT8 tensor-core MMAs (Hopper's FP8 accumulator keeps about 14 bits, which the
GPU tolerance allows for), the hardware roundings the interpreter replaces by exact fp32
grid roundings, the GPU launch settings (tiles, pipelining, split-K choice) and speed.

Tolerances are derived from the dtypes: a sum of K products in fp32 is within
``(K + 4) * 2^-24 * sum|terms|`` of exact, a weight rounded to the activation dtype moves
by its unit roundoff, and each output rounding by the output's.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.quant_gemm import (
    FP8_MAX,
    MIN_AMAX,
    fp8_gemm,
    fp8_gemm_reference,
    int8_gemm,
    int8_gemm_reference,
    quantize_fp8_activations,
    quantize_fp8_activations_reference,
    quantize_int8_activations,
    quantize_int8_activations_reference,
    wna16_gemm,
    wna16_gemm_reference,
)
from kvpilot.kernels.triton_utils import INTERPRET

F32, F16, BF16, E4M3 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn

# The kernels run under the interpreter on CPU tensors, or natively on CUDA ones.
DEVICE = "cpu" if INTERPRET else "cuda"
needs_kernels = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="the Triton kernels need CUDA, or TRITON_INTERPRET=1 (set by tests/conftest.py) to run on CPU",
)

# unit roundoff (half an ulp, relative) per dtype
U = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8}
# fp32 sums everywhere, except Hopper's FP8 MMA: about 14 bits kept while summing K
# (DeepSeek-V3 technical report, section 3.3.2); the interpreter sums in fp32.
FP8_ACC_U = U[F32] if INTERPRET else 2.0**-14


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def to_dev(*ts):
    return tuple(None if t is None else t.to(DEVICE) for t in ts)


def assert_near_exact(got, exact, terms, k, out_dtype, operand_u=0.0, acc_u=U[F32], what=""):
    """``got`` (rounded to ``out_dtype``) against the float64 ``exact``, ``terms`` the
    float64 sum of the products' magnitudes (|x| @ |w|^T + |bias|): within the fp32
    summation bound, the operands' rounding and one output rounding."""
    bound = (operand_u + (k + 4) * acc_u) * terms + U[out_dtype] * exact.abs() * (1 + 1e-6)
    err = (got.double().cpu() - exact.cpu()).abs()
    worst = float((err / bound.cpu().clamp_min(1e-300)).max())
    assert (err <= bound.cpu()).all(), f"{what}: error up to {worst:.3g} x its bound (max err {float(err.max()):.3g})"


def assert_kernel_matches(got, want, terms, k, out_dtype, acc_u=U[F32], what=""):
    """Kernel against reference: two fp32 sums of the same products (each within
    ``(k + 4) * acc_u * terms`` of exact) rounded into ``out_dtype``."""
    assert got.dtype == want.dtype == out_dtype and got.shape == want.shape
    bound = 2 * (k + 4) * acc_u * terms.cpu() + U[out_dtype] * (got.double().abs() + want.double().abs()).cpu()
    err = (got.double() - want.double()).abs().cpu()
    worst = float((err / bound.clamp_min(1e-300)).max())
    assert (err <= bound).all(), f"{what}: kernel - reference up to {worst:.3g} x the bound"


# ----------------------------------------------------------------------------- WNA16
def wna16_inputs(m, n, k, bits, g, dtype, bias, seed=0, symmetric=False):
    """Random codes, positive scales, offsets from random zero points (or -2^(bits-1) *
    scale); x ~ N(0, 1). Returns the kernel's arguments and the unpacked codes."""
    r = gen(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=r, dtype=torch.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)) if bits == 4 else q.clone()
    scales = torch.rand(n, k // g, generator=r) * 0.02 + 0.005
    zeros = torch.full_like(scales, 2.0 ** (bits - 1)) if symmetric else torch.randint(
        0, 2**bits, scales.shape, generator=r).float()
    offsets = -zeros * scales
    x = torch.randn(m, k, generator=r)
    b = torch.randn(n, generator=r) if bias else None
    args = (x.to(dtype), packed, scales.to(dtype), offsets.to(dtype), bits, g, None if b is None else b.to(dtype))
    return args, q


def wna16_oracle(x, packed, scales, offsets, bits, g, bias):
    """float64: codes unpacked by repeating each byte and shifting by 4 * (k % 2) (the
    kernels split nibbles; the reference stacks them), every scale repeated g times.
    Returns (y, sum of |terms|)."""
    k = x.shape[1]
    if bits == 4:
        shift = (torch.arange(k) % 2) * 4
        q = (packed.cpu().long().repeat_interleave(2, dim=1) >> shift) & 15
    else:
        q = packed.cpu().long()
    s = scales.cpu().double().repeat_interleave(g, dim=1)
    o = offsets.cpu().double().repeat_interleave(g, dim=1)
    xd = x.cpu().double()
    y = xd @ (q * s + o).T
    terms = xd.abs() @ (q * s.abs() + o.abs()).T
    if bias is not None:
        y += bias.cpu().double()
        terms += bias.cpu().double().abs()
    return y, terms


# (id, M, N, K, bits, group_size, dtype, bias)
WNA16_CASES = [
    ("m1-b4-g32-bf16-bias", 1, 72, 128, 4, 32, BF16, True),
    ("m5-b4-g64-f16", 5, 40, 128, 4, 64, F16, False),
    ("m19-b4-g128-bf16-bias", 19, 72, 256, 4, 128, BF16, True),
    ("m3-b4-per-channel-k80-f32-bias", 3, 48, 80, 4, 80, F32, True),
    ("m7-b8-g32-bf16", 7, 40, 128, 8, 32, BF16, False),
    ("m1-b8-per-channel-f16-bias", 1, 33, 64, 8, 64, F16, True),
    ("m33-b8-g128-f32", 33, 100, 256, 8, 128, F32, False),
    ("m4-b4-g48-bf16-bias", 4, 40, 96, 4, 48, BF16, True),  # K tiles of 16
    ("m3-b4-g8-gathered-bf16", 3, 40, 64, 4, 8, BF16, False),  # scales per element
]


@pytest.mark.parametrize(("m", "n", "k", "bits", "g", "dtype", "bias"), [c[1:] for c in WNA16_CASES],
                         ids=[c[0] for c in WNA16_CASES])
def test_wna16_reference_matches_float64_dequantize_then_matmul(m, n, k, bits, g, dtype, bias):
    args, _ = wna16_inputs(m, n, k, bits, g, dtype, bias)
    want = wna16_gemm_reference(*args)
    assert want.dtype == dtype and want.shape == (m, n)
    exact, terms = wna16_oracle(*args)
    # the weights are rounded to x's dtype (the tensor-core operand), after an fp32 q*s+o
    assert_near_exact(want, exact, terms, k, dtype, operand_u=U[dtype] + 2 * U[F32], what="reference")


@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
@pytest.mark.parametrize(("m", "n", "k", "bits", "g", "dtype", "bias"), [c[1:] for c in WNA16_CASES],
                         ids=[c[0] for c in WNA16_CASES])
@pytest.mark.triton_interpreter
@needs_kernels
def test_wna16_kernel_matches_reference(m, n, k, bits, g, dtype, bias, symmetric):
    args, _ = wna16_inputs(m, n, k, bits, g, dtype, bias, seed=1, symmetric=symmetric)
    args = (*to_dev(*args[:4]), bits, g, *to_dev(args[6]))
    before = [t.clone() for t in args[:4]]
    got = wna16_gemm(*args)
    want = wna16_gemm_reference(*args)
    _, terms = wna16_oracle(*args)
    assert_kernel_matches(got, want, terms, k, dtype, what="wna16")
    for t, t0 in zip(args[:4], before):
        assert torch.equal(t, t0)  # nothing is written but y


@pytest.mark.parametrize(
    "config",
    [
        {"SPLIT_K": 1},
        {"SPLIT_K": 3, "BLOCK_K": 16},  # 12 K tiles in 3 splits of 4
        {"SPLIT_K": 5},  # 6 K tiles: splits of 2, the fifth would be empty: 3 splits
        {"BLOCK_K": 64},  # tiles straddle the 32-wide groups: scales gathered per element
        {"BLOCK_M": 32, "BLOCK_N": 64, "GROUP_M": 2, "SPLIT_K": 1},
    ],
    ids=["no-split", "split3", "split-clamped", "gather", "big-tiles"],
)
@pytest.mark.parametrize("m", [1, 40])
@pytest.mark.triton_interpreter
@needs_kernels
def test_wna16_launch_settings_give_the_same_result(config, m):
    args, _ = wna16_inputs(m, 72, 192, 4, 32, BF16, True, seed=2)
    args = (*to_dev(*args[:4]), 4, 32, *to_dev(args[6]))
    got = wna16_gemm(*args, config=config)
    want = wna16_gemm_reference(*args)
    _, terms = wna16_oracle(*args)
    assert_kernel_matches(got, want, terms, 192, BF16, what=str(config))


@pytest.mark.triton_interpreter
@needs_kernels
def test_wna16_strided_activations_and_empty_batch():
    args, _ = wna16_inputs(6, 40, 128, 4, 64, F16, False, seed=3)
    x, qw, s, o = to_dev(*args[:4])
    x_t = x.t().contiguous().t()  # same values, column-major
    assert x_t.stride() != x.stride()
    torch.testing.assert_close(wna16_gemm(x_t, qw, s, o, 4, 64), wna16_gemm(x, qw, s, o, 4, 64), rtol=0, atol=0)
    empty = wna16_gemm(x[:0], qw, s, o, 4, 64)
    assert empty.shape == (0, 40) and empty.dtype == F16


def test_the_bounds_catch_a_wrong_nibble_order():
    """The checks can fail: codes read high nibble first give errors far past the bound."""
    args, _ = wna16_inputs(3, 40, 64, 4, 32, BF16, False, seed=4)
    x, packed, s, o, bits, g, _ = args
    swapped = (packed >> 4) | (packed << 4)
    exact, terms = wna16_oracle(*args)
    with pytest.raises(AssertionError, match="x its bound"):
        assert_near_exact(wna16_gemm_reference(x, swapped, s, o, bits, g), exact, terms, 64, BF16,
                          operand_u=U[BF16] + 2 * U[F32])


# ----------------------------------------------------------------------------- activation quantizers
def act(m, k, dtype, seed=0, scale=3.0):
    x = torch.randn(m, k, generator=gen(seed)) * scale
    if m > 2:
        x[1] = 0.0  # an all-zero token: scale MIN_AMAX / QMAX, codes 0
        x[2, :5] = torch.tensor([1e-6, -2e-3, 0.7, -1e3, 3e-5])  # a wide range in one row
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("mode", ["token", "group32", "group128", "static", "static-saturating"])
def test_fp8_quantizer_reference_reconstructs_x(mode, dtype):
    """Independent of the reference's code: each scale is amax/448 of its row or group
    (float64, to one fp32 rounding), codes are within +-448, and x_q * s is within half
    an FP8 step of x (2^-4 relative for normals, 2^-10 * s for subnormals) or clamped."""
    x = act(7, 200, dtype)
    group = {"group32": 32, "group128": 128}.get(mode)
    static = {"static": torch.tensor(0.05), "static-saturating": torch.tensor(1e-3)}.get(mode)
    x_q, s = quantize_fp8_activations_reference(x, static, group)
    assert x_q.dtype == E4M3 and x_q.shape == x.shape and s.dtype == F32
    xd = x.double()
    if static is not None:
        assert s.shape == (1, 1) and float(s) == float(static)
        full = torch.full_like(xd, float(static))
    else:
        gs = 200 if group is None else group
        groups = -(-200 // gs)
        assert s.shape == (7, groups)
        amax = torch.stack([xd[:, i * gs:(i + 1) * gs].abs().amax(1) for i in range(groups)], 1)
        torch.testing.assert_close(s.double(), amax.clamp_min(MIN_AMAX) / FP8_MAX, rtol=2**-24, atol=0)
        full = s.double().repeat_interleave(gs, dim=1)[:, :200]
    back = x_q.double() * full
    assert x_q.double().abs().max() <= FP8_MAX and torch.isfinite(x_q.double()).all()
    target = (xd / full).clamp(-FP8_MAX, FP8_MAX) * full
    bound = 2.0**-4 * target.abs() * (1 + 2**-20) + 2.0**-10 * full
    assert ((back - target).abs() <= bound).all()
    if mode == "static-saturating":
        assert (x_q.double().abs() == FP8_MAX).any()  # clamped, not NaN


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("mode", ["token", "group32", "group128", "group-k", "static", "static-saturating"])
@pytest.mark.triton_interpreter
@needs_kernels
def test_fp8_quantizer_kernel_matches_reference_bit_for_bit(mode, dtype):
    x = act(7, 200, dtype, seed=5).to(DEVICE)
    group = {"group32": 32, "group128": 128, "group-k": 200}.get(mode)
    static = {"static": torch.tensor(0.05), "static-saturating": torch.tensor(1e-3)}.get(mode)
    static = None if static is None else static.to(DEVICE)
    got_q, got_s = quantize_fp8_activations(x, static, group)
    want_q, want_s = quantize_fp8_activations_reference(x, static, group)
    assert got_q.dtype == E4M3 and got_q.is_contiguous()
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert got_s.shape == want_s.shape and torch.equal(got_s, want_s)


@pytest.mark.triton_interpreter
@needs_kernels
def test_quantizers_read_strided_activations():
    x = act(5, 96, BF16, seed=6).to(DEVICE)
    x_t = x.t().contiguous().t()
    for fn, kw in ((quantize_fp8_activations, {"group_size": 32}), (quantize_int8_activations, {})):
        a, sa = fn(x_t, **kw)
        b, sb = fn(x, **kw)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)


def test_int8_quantizer_rounds_half_to_even_and_clamps():
    """Static scale 1: x / s are exact halves, rounded like torch.round; +-200 clamp."""
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 200.0, -200.0, 3.49, -0.51]])
    want = torch.tensor([[0, 2, 2, 0, -2, -2, 126, -128, 127, -128, 3, -1]], dtype=torch.int8)
    q, s = quantize_int8_activations_reference(x, torch.tensor(1.0))
    assert torch.equal(q, want) and s.shape == (1, 1)


@pytest.mark.triton_interpreter
@needs_kernels
def test_int8_quantizer_kernel_rounds_half_to_even_and_clamps():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 200.0, -200.0, 3.49, -0.51]]).to(DEVICE)
    want = torch.tensor([[0, 2, 2, 0, -2, -2, 126, -128, 127, -128, 3, -1]], dtype=torch.int8)
    q, _ = quantize_int8_activations(x, torch.tensor(1.0, device=DEVICE))
    assert torch.equal(q.cpu(), want)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_int8_quantizer_reference_reconstructs_x(dtype, static):
    x = act(6, 150, dtype, seed=7)
    sc = torch.tensor(0.02) if static else None
    q, s = quantize_int8_activations_reference(x, sc)
    assert q.dtype == torch.int8
    xd = x.double()
    if static:
        full = torch.full_like(xd, 0.02)
        assert s.shape == (1, 1)
    else:
        torch.testing.assert_close(s.double(), xd.abs().amax(1, keepdim=True).clamp_min(MIN_AMAX) / 127,
                                   rtol=2**-24, atol=0)
        full = s.double().expand_as(xd)
        assert (q.abs().amax(1)[xd.abs().amax(1) > 0] == 127).all()  # the largest maps to +-127
    target = (xd / full).clamp(-128, 127) * full
    assert ((q.double() * full - target).abs() <= full * (0.5 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("static", [None, 0.02, 1e-3], ids=["dynamic", "static", "static-saturating"])
@pytest.mark.triton_interpreter
@needs_kernels
def test_int8_quantizer_kernel_matches_reference_bit_for_bit(dtype, static):
    x = act(7, 300, dtype, seed=8).to(DEVICE)
    sc = None if static is None else torch.tensor(static, device=DEVICE)
    got_q, got_s = quantize_int8_activations(x, sc)
    want_q, want_s = quantize_int8_activations_reference(x, sc)
    assert got_q.dtype == torch.int8 and torch.equal(got_q, want_q)
    assert got_s.shape == want_s.shape and torch.equal(got_s, want_s)


# ----------------------------------------------------------------------------- FP8 GEMM
def fp8_inputs(m, n, k, block, static, dtype, bias, seed=0):
    r = gen(seed)
    weight = (torch.randn(n, k, generator=r) * 64).clamp(-448, 448).to(E4M3)
    if block is None:
        ws = torch.rand(n, generator=r) * 2e-3 + 5e-4
    else:
        ws = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=r) * 2e-3 + 5e-4
    x = torch.randn(m, k, generator=r).to(dtype)
    b = (torch.randn(n, generator=r)).to(dtype) if bias else None
    sc = torch.tensor(0.02) if static else None
    return x, weight, ws, sc, b


def fp8_oracle(x, weight, ws, input_scale, block, act_quant, bias):
    """float64 ``(x_q * s_x) @ (weight * s_w)^T (+ bias)`` from the reference quantizer's
    codes (checked on their own above), scales expanded by repeat_interleave; and the
    sum of |terms|."""
    n, k = weight.shape
    if act_quant:
        group = block[1] if block is not None and input_scale is None else None
        x_q, s = quantize_fp8_activations_reference(x.cpu(), None if input_scale is None else input_scale.cpu(), group)
        s = s.double()
        a = x_q.double() * (s.repeat_interleave(group, dim=1)[:, :k] if group else s)
    else:
        a = x.cpu().double()
    if block is None:
        w = weight.cpu().double() * ws.cpu().double()[:, None]
    else:
        full = ws.cpu().double().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
        w = weight.cpu().double() * full
    y, terms = a @ w.T, a.abs() @ w.abs().T
    if bias is not None:
        y += bias.cpu().double()
        terms += bias.cpu().double().abs()
    return y, terms


# (id, M, N, K, block, act_quant, static, dtype, out_dtype, bias)
FP8_CASES = [
    ("w8a8-channel-dynamic-m1-bf16-bias", 1, 72, 64, None, True, False, BF16, None, True),
    ("w8a8-channel-dynamic-m7-f16", 7, 40, 96, None, True, False, F16, None, False),
    ("w8a8-channel-static-m19-bf16-f32out-bias", 19, 72, 128, None, True, True, BF16, F32, True),
    ("w8a8-block128-dynamic-m5-n200-k320-bf16-bias", 5, 200, 320, (128, 128), True, False, BF16, None, True),
    ("w8a8-block128-static-m3-n136-k160", 3, 136, 160, (128, 128), True, True, BF16, None, False),
    ("w8a8-block32x64-dynamic-m33-f32-bias", 33, 72, 200, (32, 64), True, False, F32, None, True),
    ("w8a16-channel-m1-bf16-bias", 1, 72, 64, None, False, False, BF16, None, True),
    ("w8a16-channel-m9-f32", 9, 40, 96, None, False, False, F32, None, False),
    ("w8a16-block128-m4-n200-k320-bf16-bias", 4, 200, 320, (128, 128), False, False, BF16, None, True),
    ("w8a16-block16x48-m6-f16-bf16out", 6, 50, 100, (16, 48), False, False, F16, BF16, False),
]


@pytest.mark.parametrize(("m", "n", "k", "block", "act_quant", "static", "dtype", "out_dtype", "bias"),
                         [c[1:] for c in FP8_CASES], ids=[c[0] for c in FP8_CASES])
def test_fp8_reference_matches_float64_dequantize_then_matmul(m, n, k, block, act_quant, static, dtype,
                                                              out_dtype, bias):
    x, w, ws, sc, b = fp8_inputs(m, n, k, block, static, dtype, bias)
    want = fp8_gemm_reference(x, w, ws, sc, block, act_quant, b, out_dtype)
    out = out_dtype or dtype
    assert want.dtype == out and want.shape == (m, n)
    exact, terms = fp8_oracle(x, w, ws, sc, block, act_quant, b)
    assert_near_exact(want, exact, terms, k, out, what="reference")


@pytest.mark.parametrize(("m", "n", "k", "block", "act_quant", "static", "dtype", "out_dtype", "bias"),
                         [c[1:] for c in FP8_CASES], ids=[c[0] for c in FP8_CASES])
@pytest.mark.triton_interpreter
@needs_kernels
def test_fp8_kernel_matches_reference(m, n, k, block, act_quant, static, dtype, out_dtype, bias):
    x, w, ws, sc, b = to_dev(*fp8_inputs(m, n, k, block, static, dtype, bias, seed=1))
    got = fp8_gemm(x, w, ws, sc, block, act_quant, b, out_dtype)
    want = fp8_gemm_reference(x, w, ws, sc, block, act_quant, b, out_dtype)
    _, terms = fp8_oracle(x, w, ws, sc, block, act_quant, b)
    acc_u = FP8_ACC_U if act_quant else U[F32]
    assert_kernel_matches(got, want, terms, k, out_dtype or dtype, acc_u=acc_u, what="fp8")


@pytest.mark.parametrize("config", [{"SPLIT_K": 1}, {"SPLIT_K": 4, "BLOCK_K": 16}, {"BLOCK_N": 64, "BLOCK_M": 32}],
                         ids=["no-split", "split4-k16", "big-tiles"])
@pytest.mark.parametrize("block", [None, (64, 64)], ids=["channel", "block64"])
@pytest.mark.triton_interpreter
@needs_kernels
def test_fp8_launch_settings_give_the_same_result(config, block):
    x, w, ws, sc, b = to_dev(*fp8_inputs(3, 72, 192, block, False, BF16, True, seed=2))
    got = fp8_gemm(x, w, ws, sc, block, True, b, config=config)
    want = fp8_gemm_reference(x, w, ws, sc, block, True, b)
    _, terms = fp8_oracle(x, w, ws, sc, block, True, b)
    assert_kernel_matches(got, want, terms, 192, BF16, acc_u=FP8_ACC_U, what=str(config))


@pytest.mark.triton_interpreter
@needs_kernels
def test_fp8_block_k_that_the_tile_does_not_divide_is_refused():
    x, w, ws, _, _ = to_dev(*fp8_inputs(2, 40, 96, (32, 48), False, BF16, False))
    with pytest.raises(ValueError, match="BLOCK_K=32 must divide the weight's K block 48"):
        fp8_gemm(x, w, ws, block=(32, 48), config={"BLOCK_K": 32})


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                    reason="FP8 tensor-core MMA: CUDA only, without the interpreter (TRITON_INTERPRET=0); "
                           "benchmarks/gpu_check.py checks it at real shapes")
def test_fp8_tensor_cores_at_a_decode_and_a_prefill_size():
    for m in (4, 512):
        x, w, ws, sc, b = to_dev(*fp8_inputs(m, 1024, 2048, None, False, BF16, True, seed=9))
        got = fp8_gemm(x, w, ws, sc, None, True, b)
        want = fp8_gemm_reference(x, w, ws, sc, None, True, b)
        _, terms = fp8_oracle(x, w, ws, sc, None, True, b)
        assert_kernel_matches(got, want, terms, 2048, BF16, acc_u=FP8_ACC_U, what=f"M={m}")


# ----------------------------------------------------------------------------- INT8 GEMM
def int8_inputs(m, n, k, static, dtype, bias, seed=0):
    r = gen(seed)
    weight = torch.randint(-127, 128, (n, k), generator=r, dtype=torch.int8)
    ws = torch.rand(n, generator=r) * 2e-3 + 5e-4
    x = torch.randn(m, k, generator=r).to(dtype)
    b = torch.randn(n, generator=r).to(dtype) if bias else None
    sc = torch.tensor(0.03) if static else None
    return x, weight, ws, sc, b


def int8_oracle(x, weight, ws, input_scale, bias):
    x_q, s = quantize_int8_activations_reference(x.cpu(), None if input_scale is None else input_scale.cpu())
    acc = x_q.double() @ weight.cpu().double().T  # exact: integers below 2^53
    scale = s.double() * ws.cpu().double()
    y = acc * scale
    terms = (x_q.double().abs() @ weight.cpu().double().abs().T) * scale.abs()
    if bias is not None:
        y += bias.cpu().double()
        terms += bias.cpu().double().abs()
    return y, terms


# (id, M, N, K, static, dtype, out_dtype, bias)
INT8_CASES = [
    ("m1-dynamic-bf16-bias", 1, 72, 64, False, BF16, None, True),
    ("m7-dynamic-f16", 7, 40, 300, False, F16, None, False),
    ("m20-static-bf16-f32out-bias", 20, 72, 128, True, BF16, F32, True),
    ("m3-static-f32", 3, 33, 96, True, F32, None, False),
]


@pytest.mark.parametrize(("m", "n", "k", "static", "dtype", "out_dtype", "bias"), [c[1:] for c in INT8_CASES],
                         ids=[c[0] for c in INT8_CASES])
def test_int8_reference_matches_float64(m, n, k, static, dtype, out_dtype, bias):
    """Exact int32 sums, then int -> fp32, two scale products and the bias in fp32 (four
    roundings of at most 2^-24 each) and the output rounding."""
    x, w, ws, sc, b = int8_inputs(m, n, k, static, dtype, bias)
    want = int8_gemm_reference(x, w, ws, sc, b, out_dtype)
    exact, terms = int8_oracle(x, w, ws, sc, b)
    assert_near_exact(want, exact, terms, 0, out_dtype or dtype, what="reference")


@pytest.mark.parametrize(("m", "n", "k", "static", "dtype", "out_dtype", "bias"), [c[1:] for c in INT8_CASES],
                         ids=[c[0] for c in INT8_CASES])
@pytest.mark.triton_interpreter
@needs_kernels
def test_int8_kernel_matches_reference(m, n, k, static, dtype, out_dtype, bias):
    x, w, ws, sc, b = to_dev(*int8_inputs(m, n, k, static, dtype, bias, seed=1))
    want = int8_gemm_reference(x, w, ws, sc, b, out_dtype)
    # one split: the same int32 sums and the same fp32 epilogue, bit for bit
    assert torch.equal(int8_gemm(x, w, ws, sc, b, out_dtype, config={"SPLIT_K": 1}), want)
    # default launch (split-K at these sizes): each split's partial scaled in fp32, the
    # partials added: up to 16 splits, so 16 + 4 roundings of at most the sum of |terms|
    _, terms = int8_oracle(x, w, ws, sc, b)
    assert_kernel_matches(int8_gemm(x, w, ws, sc, b, out_dtype), want, terms, 16, out_dtype or dtype, what="int8")


# ----------------------------------------------------------------------------- argument checks
def _wna16_args():
    args, _ = wna16_inputs(2, 8, 64, 4, 32, BF16, True)
    return dict(zip(("x", "qweight", "scales", "offsets", "bits", "group_size", "bias"), args))


WNA16_BAD = [
    (lambda a: a.update(x=a["x"][0]), "x must be a 2-D"),
    (lambda a: a.update(x=a["x"].int()), "x must be a 2-D"),
    (lambda a: a.update(bits=3), "bits must be 4 or 8; got 3"),
    (lambda a: a.update(group_size=48), "group_size must be a positive divisor of K=64.*got 48"),
    (lambda a: a.update(group_size=0), "group_size must be a positive divisor"),
    (lambda a: a.update(qweight=a["qweight"][:, :-1]), r"qweight must be \[N, K // 2\]"),
    (lambda a: a.update(qweight=a["qweight"].to(torch.int8)), "qweight must be a 2-D uint8"),
    (lambda a: a.update(bits=8), r"qweight must be \[N, K\] = \[N, 64\] for bits=8"),
    (lambda a: a.update(x=torch.zeros(2, 63, dtype=BF16)), "K=63 must be even"),
    (lambda a: a.update(scales=a["scales"][:, :1]), r"scales must be .*\[8, 2\]; got shape \(8, 1\)"),
    (lambda a: a.update(scales=a["scales"].double(), offsets=a["offsets"].double()), "scales must be"),
    (lambda a: a.update(offsets=a["offsets"].float()), "offsets must match scales"),
    (lambda a: a.update(bias=torch.zeros(9)), r"bias must be .*\[N=8\] tensor; got shape \(9,\)"),
]


@pytest.mark.parametrize(("change", "match"), WNA16_BAD, ids=[str(i) for i in range(len(WNA16_BAD))])
@pytest.mark.parametrize("fn", [wna16_gemm, wna16_gemm_reference], ids=["kernel", "reference"])
def test_wna16_bad_arguments_raise_value_error_naming_them(fn, change, match):
    args = _wna16_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        fn(**args)


def _fp8_args():
    x, w, ws, _, b = fp8_inputs(2, 8, 64, None, False, BF16, True)
    return {"x": x, "weight": w, "weight_scale": ws, "bias": b}


FP8_BAD = [
    (lambda a: a.update(weight=a["weight"].to(BF16)), "weight must be float8_e4m3fn"),
    (lambda a: a.update(weight=a["weight"][:, :32]), r"weight must be float8_e4m3fn \[N, K=64\]"),
    (lambda a: a.update(weight_scale=a["weight_scale"][:, None]), r"weight_scale must be float32 \[N=8\]"),
    (lambda a: a.update(weight_scale=a["weight_scale"].half()), r"weight_scale must be float32 \[N=8\]"),
    (lambda a: a.update(block=(4, 32)), r"weight_scale must be float32 \[ceil\(N / 4\), ceil\(K / 32\)\] = \[2, 2\]"),
    (lambda a: a.update(block=(0, 32)), r"block must be \(block_n, block_k\).*got \(0, 32\)"),
    (lambda a: a.update(input_scale=torch.ones(2)), "input_scale must be a one-element float32"),
    (lambda a: a.update(input_scale=torch.tensor(1.0, dtype=torch.float64)), "input_scale must be a one-element"),
    (lambda a: a.update(input_scale=torch.tensor(1.0), act_quant=False), "input_scale is for quantized activations"),
    (lambda a: a.update(out_dtype=torch.int8), "out_dtype must be float32, float16 or bfloat16; got torch.int8"),
    (lambda a: a.update(bias=torch.zeros(8, 1)), "bias must be"),
    (lambda a: a.update(x=a["x"].to(E4M3)), "x must be a 2-D"),
]


@pytest.mark.parametrize(("change", "match"), FP8_BAD, ids=[str(i) for i in range(len(FP8_BAD))])
@pytest.mark.parametrize("fn", [fp8_gemm, fp8_gemm_reference], ids=["kernel", "reference"])
def test_fp8_bad_arguments_raise_value_error_naming_them(fn, change, match):
    args = _fp8_args()
    change(args)
    with pytest.raises(ValueError, match=match):
        fn(**args)


def test_fp8_kernel_needs_a_k_block_multiple_of_16_the_reference_does_not():
    args = _fp8_args()
    args.update(block=(4, 8), weight_scale=torch.rand(2, 8))
    with pytest.raises(ValueError, match=r"block\[1\] \(the K block\) must be a multiple of 16"):
        fp8_gemm(**args)
    assert fp8_gemm_reference(**args).shape == (2, 8)


INT8_BAD = [
    (lambda a: a.update(weight=a["weight"].to(torch.uint8)), r"weight must be int8 \[N, K=64\]"),
    (lambda a: a.update(weight=a["weight"][:, 1:]), r"weight must be int8 \[N, K=64\]"),
    (lambda a: a.update(weight_scale=torch.rand(7)), r"weight_scale must be float32 \[N=8\]; got shape \(7,\)"),
    (lambda a: a.update(input_scale=torch.ones(1, 2)), "input_scale must be a one-element"),
    (lambda a: a.update(out_dtype=torch.float64), "out_dtype must be"),
    (lambda a: a.update(bias=torch.zeros(8, dtype=torch.int32)), "bias must be a float32/float16/bfloat16"),
]


@pytest.mark.parametrize(("change", "match"), INT8_BAD, ids=[str(i) for i in range(len(INT8_BAD))])
@pytest.mark.parametrize("fn", [int8_gemm, int8_gemm_reference], ids=["kernel", "reference"])
def test_int8_bad_arguments_raise_value_error_naming_them(fn, change, match):
    x, w, ws, _, b = int8_inputs(2, 8, 64, False, BF16, True)
    args = {"x": x, "weight": w, "weight_scale": ws, "bias": b}
    change(args)
    with pytest.raises(ValueError, match=match):
        fn(**args)


@pytest.mark.parametrize(
    ("fn", "kwargs", "match"),
    [
        (quantize_fp8_activations, {"group_size": 0}, "group_size must be a positive int.*got 0"),
        (quantize_fp8_activations_reference, {"group_size": 2.5}, "group_size must be a positive int"),
        (quantize_fp8_activations, {"group_size": 32, "input_scale": torch.tensor(1.0)},
         "group_size is for dynamic scales"),
        (quantize_int8_activations, {"input_scale": torch.tensor([1.0, 2.0])}, "input_scale must be a one-element"),
        (quantize_int8_activations_reference, {"x": torch.zeros(2, 3, 4)}, "x must be a 2-D"),
        (quantize_fp8_activations, {"x": torch.zeros(2, 0)}, r"x must be a 2-D \[M, K >= 1\]"),
    ],
)
def test_quantizer_bad_arguments_raise_value_error_naming_them(fn, kwargs, match):
    kw = {"x": torch.randn(2, 64), **kwargs}
    with pytest.raises(ValueError, match=match):
        fn(**kw)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"BLOCK_X": 16}, r"config keys \['BLOCK_X'\] are not among"),
        ({"BLOCK_N": 24}, "config BLOCK_N must be a power of two >= 16; got 24"),
        ({"BLOCK_K": 8}, "config BLOCK_K must be a power of two >= 16; got 8"),
        ({"SPLIT_K": 0}, "config SPLIT_K must be >= 1; got 0"),
    ],
)
def test_bad_configs_are_refused(config, match):
    args = _wna16_args()
    with pytest.raises(ValueError, match=match):
        wna16_gemm(**args, config=config)
    with pytest.raises(ValueError, match=match):
        fp8_gemm(**_fp8_args(), config=config)
