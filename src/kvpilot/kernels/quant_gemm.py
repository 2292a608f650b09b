"""GEMMs of quantized linear layers, ``y = x @ w^T (+ bias)``, in Triton: grouped-integer
weights with float activations (WNA16), FP8 weights with FP8 or 16-bit activations
(W8A8 / W8A16), INT8 weights and activations (W8A8), and the activation quantizers the
W8A8 paths run first. Each has a torch reference (``*_reference``) in this module: the
tests' oracle and the CPU fallback, computed in tiles of :data:`REFERENCE_ROWS` output
rows so the dequantized weight never exists whole.

Weight layouts, exactly as the loader produces them (``N`` outputs, ``K`` inputs)::

    WNA16 (GPTQ/AWQ/compressed-tensors W4A16/W8A16; GGUF Q4_0/Q4_1/Q8_0/Q4_K)
      qweight   uint8 [N, K // 2] (4 bits: byte j of row n holds k = 2j in its low
                nibble, k = 2j + 1 in its high nibble) or [N, K] (8 bits); q unsigned
      scales    [N, K // g] float16/bfloat16/float32
      offsets   [N, K // g] same dtype; w[n, k] = q * scales[n, k // g] + offsets[n, k // g]
                (offset = -zero_point * scale; -8 * scale / -128 * scale when symmetric)
    FP8 (W8A8, W8A16)
      weight        float8_e4m3fn [N, K]
      weight_scale  float32 [N] (per output channel; per-tensor expanded to it), or
                    [ceil(N / bn), ceil(K / bk)] with block = (bn, bk); w = weight * scale
    INT8 (W8A8)
      weight        int8 [N, K], weight_scale float32 [N]

The kernels (one program per ``BLOCK_M x BLOCK_N`` output tile, tiles in grouped order
for L2 reuse, the K loop inside):

- :func:`wna16_gemm` (``_wna16_kernel``): each ``[BLOCK_N, BLOCK_K]`` weight tile is
  loaded packed (the two nibbles of a byte split apart and interleaved back into k
  order), dequantized in registers in fp32 (``q * scale + offset``, one scale per row
  when a tile lies in one group, else gathered per element), rounded to the activation
  dtype and fed to ``tl.dot`` with fp32 accumulation. This is the design of vLLM's
  ``awq_triton.py`` (``awq_gemm_kernel``) on the loader's simpler nibble order.
- :func:`fp8_gemm` / :func:`int8_gemm` (``_scaled_gemm_kernel``): FP8 x FP8 (fp32
  accumulator) or INT8 x INT8 (int32 accumulator) ``tl.dot``; per-token and per-channel
  scales applied once in the epilogue (vLLM's ``triton_scaled_mm`` in
  ``compressed_tensors/triton_scaled_mm.py``); block-wise scales (DeepSeek-V3, Qwen3
  FP8) applied to each ``BLOCK_K`` slice's partial product, ``BLOCK_K`` dividing ``bk``
  (vLLM's ``w8a8_block_fp8_matmul`` in ``quantization/utils/fp8_utils.py``, from
  SGLang's ``fp8_kernel.py``). W8A16 converts the FP8 tile to the activation dtype (exact)
  and applies the weight scales to the products.
- Decode-sized batches (``M <= 16``) cannot fill the GPU with output tiles, so the K
  loop is split (split-K): each split writes an fp32 partial tile to a workspace and
  ``_splitk_reduce_kernel`` adds the partials in a fixed order, adds the bias and casts
  (no atomics: the result does not depend on the order programs run in).
- :func:`quantize_fp8_activations` / :func:`quantize_int8_activations`
  (``_quant_act_kernel``): one program per (row, group): ``amax`` over the group, then
  ``clamp(x / s)``; the dynamic scale is ``max(amax, 1e-10) / QMAX`` (vLLM's
  ``per_token_group_quant_fp8``; per token is one group of ``K``). Divisions are IEEE
  (``div_rn``); FP8 casts round to nearest even; INT8 rounds half to even (torch.round).

Numerics: every kernel accumulates in fp32 (int32 for INT8) and rounds once into the
output dtype; the bias is added in fp32 before that rounding. On Hopper, FP8 ``tl.dot``
accumulates K inside the tensor cores in reduced precision (as vLLM's CUTLASS
``FP8FastAccum`` kernels do); block-wise scaling restarts it every ``BLOCK_K``.

Under the Triton interpreter (CPU tests): 16-bit operands are widened to fp32 before
``tl.dot`` (:func:`~kvpilot.kernels.triton_utils.dot_dtype`), the FP8 and bf16 roundings
the GPU does in hardware are done on the fp32 grid first (the interpreter's casts
truncate), and FP8 ``tl.dot`` is the interpreter's own emulation (operands widened
exactly, fp32 products and sums), so the CPU runs the same code as the GPU, launch
settings apart.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from .triton_utils import (
    FLOAT_DTYPES,
    FP8_FORMATS,
    INTERPRET,
    check,
    check_device,
    dot_dtype,
    dot_precision,
    num_sms,
    round_to_fp8_grid,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = FP8_FORMATS[FP8_DTYPE].max  # 448
INT8_MAX = 127.0
MIN_AMAX = 1e-10
"""A dynamic scale is ``max(amax, MIN_AMAX) / QMAX``: an all-zero row or group gets a
tiny positive scale (its codes are 0), never a division by zero (vLLM's ``eps``)."""

REFERENCE_ROWS = 1024
"""Output rows (weight rows) the references dequantize at a time."""

CONFIG_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "GROUP_M", "num_warps", "num_stages"})
"""Launch settings a ``config`` may override (:func:`wna16_default_config`,
:func:`scaled_gemm_default_config`)."""

_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# ----------------------------------------------------------------------------- device code
@triton.jit
def _round_to_bf16_grid(v):  # type: ignore[no-untyped-def]
    """fp32 ``v`` rounded to the nearest bfloat16, ties to even, still as fp32, so the
    cast that follows is exact. Interpreter only: its fp32 -> bf16 cast truncates
    (Triton 3.9); the GPU rounds to nearest even in hardware."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_half_even(y):  # type: ignore[no-untyped-def]
    """fp32 ``y`` (``|y| < 2^22``) rounded to the nearest integer, ties to even
    (torch.round): adding and subtracting 1.5 * 2^23 leaves no fraction bits, and IEEE
    addition rounds to nearest even. The same on the GPU and the interpreter."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):  # type: ignore[no-untyped-def]
    """Output tile ``(pid_m, pid_n)`` of program ``pid``, in groups of ``GROUP_M`` tile
    rows so programs that run together share rows of x and columns of w in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _store_tile(  # type: ignore[no-untyped-def]
    acc,
    rows,
    cols,
    split,
    M,
    N,
    y_ptr,
    ws_ptr,
    bias_ptr,
    stride_ym,
    stride_yn,
    stride_ws,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """The fp32 tile ``acc``: into the split-K workspace ``[splits, M, N]`` as it is, or
    (one split) plus the bias, rounded once into ``y``'s dtype."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT:
        ws = ws_ptr + split.to(tl.int64) * stride_ws + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(ws, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16:
            acc = _round_to_bf16_grid(acc)
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(  # type: ignore[no-untyped-def]
    ws_ptr,
    bias_ptr,
    y_ptr,
    N,
    num_splits,
    stride_ws,
    stride_ym,
    stride_yn,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``y[m, cols] = sum_s ws[s, m, cols] (+ bias)``, the splits added in order 0, 1, ..
    (deterministic), rounded once into ``y``'s dtype. Grid ``(M, cdiv(N, BLOCK_N))``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    part = ws_ptr + row * N + cols
    acc = tl.load(part, mask=ok, other=0.0)
    for s in range(1, num_splits):
        acc += tl.load(part + s * stride_ws, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = _round_to_bf16_grid(acc)
    tl.store(y_ptr + row * stride_ym + cols * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _wna16_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    bias_ptr,
    y_ptr,
    ws_ptr,
    M,
    N,
    K,
    group_size,
    k_per_split,
    # x [M, K]; qweight [N, K or K/2] (bytes); scales/offsets [N, K/g]; y [M, N]
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qk,
    stride_sn,
    stride_sg,
    stride_on,
    stride_og,
    stride_ym,
    stride_yn,
    stride_ws,
    BITS: tl.constexpr,
    GATHER_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_W: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``x @ dequant(w)^T`` over split
    ``program_id(1)``'s K range. The weight tile is dequantized in fp32 and rounded to
    the activation dtype (on the GPU by the cast to ``DOT_DTYPE``; under the interpreter
    ``ROUND_W``: 1 fp16, 2 bf16) before ``tl.dot``.

    ``GATHER_SCALES`` False: every K tile lies inside one group (``g % BLOCK_K == 0``,
    or one group for all of K), one scale and offset per row and tile. True: any ``g``,
    the scale and offset of every element loaded (slower, for odd group sizes).
    """
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + cols.to(tl.int64) * stride_sn
    o_rows = o_ptr + cols.to(tl.int64) * stride_on
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if BITS == 4:
            # k_hi is even (K is, and splits start on multiples of BLOCK_K)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                q_rows + kb[None, :] * stride_qk, mask=col_ok[:, None] & (kb < k_hi // 2)[None, :], other=0
            )
            q = tl.interleave(packed & 15, packed >> 4)  # [BLOCK_N, BLOCK_K] in k order
        else:
            q = tl.load(q_rows + ks[None, :] * stride_qk, mask=col_ok[:, None] & k_ok[None, :], other=0)
        if GATHER_SCALES:
            g = (ks // group_size)[None, :]
            sg_mask = col_ok[:, None] & k_ok[None, :]
            s = tl.load(s_rows[:, None] + g * stride_sg, mask=sg_mask, other=0.0).to(tl.float32)
            o = tl.load(o_rows[:, None] + g * stride_og, mask=sg_mask, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * s + o
        else:
            g = k0 // group_size
            s = tl.load(s_rows + g * stride_sg, mask=col_ok, other=0.0).to(tl.float32)
            o = tl.load(o_rows + g * stride_og, mask=col_ok, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * s[:, None] + o[:, None]
        if ROUND_W == 1:
            w = w.to(tl.float16).to(tl.float32)
        elif ROUND_W == 2:
            w = _round_to_bf16_grid(w)
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    _store_tile(acc, rows, cols, split, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, stride_yn, stride_ws,
                HAS_BIAS, SPLIT, ROUND_BF16)  # fmt: skip


@triton.jit
def _scaled_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    as_ptr,
    bs_ptr,
    bias_ptr,
    y_ptr,
    ws_ptr,
    M,
    N,
    K,
    k_per_split,
    block_n,
    block_k,
    # a [M, K] (FP8/INT8 codes, or 16/32-bit activations); b [N, K]; y [M, N]
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    # activation scales [M, G] (both strides 0: one static scale); weight scales [N] or
    # [ceil(N / block_n), ceil(K / block_k)]
    stride_asm,
    stride_asg,
    stride_bsn,
    stride_bsg,
    stride_ym,
    stride_yn,
    stride_ws,
    A_SCALE: tl.constexpr,
    B_BLOCK: tl.constexpr,
    INT_ACC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``(a @ b^T)`` with its scales, over split
    ``program_id(1)``'s K range.

    ``A_SCALE``: 0 none (W8A16: ``a`` is the activations, ``UPCAST`` converts both
    operands to ``DOT_DTYPE``), 1 one scale per row (per token, or static: strides 0),
    2 one per row and ``block_k`` columns. ``B_BLOCK``: weight scales per
    ``block_n x block_k`` block, else per output column. Scales that vary along K
    (``A_SCALE == 2`` or ``B_BLOCK``) multiply each ``BLOCK_K`` slice's product (the
    launcher makes ``BLOCK_K`` divide ``block_k``); the others multiply the tile once.
    """
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + cols.to(tl.int64)[:, None] * stride_bn
    as_rows = as_ptr + rows.to(tl.int64) * stride_asm
    bs_cols = bs_ptr + (cols // block_n).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT_ACC else tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + ks[None, :] * stride_bk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(DOT_DTYPE)
            b = b.to(DOT_DTYPE)
        if A_SCALE == 2 or B_BLOCK:
            part = tl.dot(a, tl.trans(b), input_precision=DOT_PRECISION)
            kb = k0 // block_k
            if A_SCALE == 2:
                part *= tl.load(as_rows + kb * stride_asg, mask=row_ok, other=0.0)[:, None]
            if B_BLOCK:
                part *= tl.load(bs_cols + kb * stride_bsg, mask=col_ok, other=0.0)[None, :]
            acc += part
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    out = acc.to(tl.float32)
    if A_SCALE == 1:
        out *= tl.load(as_rows, mask=row_ok, other=0.0)[:, None]
    if not B_BLOCK:
        out *= tl.load(bs_cols, mask=col_ok, other=0.0)[None, :]
    _store_tile(out, rows, cols, split, M, N, y_ptr, ws_ptr, bias_ptr, stride_ym, stride_yn, stride_ws,
                HAS_BIAS, SPLIT, ROUND_BF16)  # fmt: skip


@triton.jit
def _quant_act_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    q_ptr,
    s_ptr,
    in_scale_ptr,
    K,
    group_size,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_sm,
    STATIC: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    QMIN: tl.constexpr,
    EPS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_FP8: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
):
    """Row ``program_id(0)``, group ``program_id(1)`` (columns ``[g * group_size, ..)``):
    the scale (``max(amax, EPS) / QMAX``, stored, unless ``STATIC``: read from
    ``in_scale_ptr``), then ``clamp(x / s, QMIN, QMAX)`` cast to FP8 (nearest even) or
    rounded half to even to INT8. Two passes over the group in chunks of ``BLOCK``."""
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    k_lo = grp * group_size
    k_hi = tl.minimum(k_lo + group_size, K)
    x_row = x_ptr + row * stride_xm
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(in_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK):
            ks = k0 + offs
            x = tl.load(x_row + ks * stride_xk, mask=ks < k_hi, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), EPS), QMAX)
        tl.store(s_ptr + row * stride_sm + grp, scale)
    for k0 in range(k_lo, k_hi, BLOCK):
        ks = k0 + offs
        ok = ks < k_hi
        x = tl.load(x_row + ks * stride_xk, mask=ok, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, scale)
        y = tl.minimum(tl.maximum(y, QMIN), QMAX)
        if IS_INT8:
            y = _round_half_even(y)
        elif ROUND_FP8:
            y = round_to_fp8_grid(y, MANTISSA_BITS, MIN_NORMAL_EXP)
        tl.store(q_ptr + row * stride_qm + ks, y.to(q_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- host helpers
def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _check_x(x: torch.Tensor) -> None:
    check(
        x.dim() == 2 and x.shape[1] > 0 and x.dtype in FLOAT_DTYPES,
        f"x must be a 2-D [M, K >= 1] float32/float16/bfloat16 tensor; got shape {tuple(x.shape)} {x.dtype}",
    )


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None:
        check(
            bias.shape == (n,) and bias.dtype in FLOAT_DTYPES,
            f"bias must be a float32/float16/bfloat16 [N={n}] tensor; got shape {tuple(bias.shape)} {bias.dtype}",
        )


def _check_out_dtype(out_dtype: torch.dtype | None, x: torch.Tensor) -> torch.dtype:
    dtype = x.dtype if out_dtype is None else out_dtype
    check(dtype in FLOAT_DTYPES, f"out_dtype must be float32, float16 or bfloat16; got {out_dtype}")
    return dtype


def _check_input_scale(input_scale: torch.Tensor | None, x: torch.Tensor) -> None:
    if input_scale is not None:
        check(
            isinstance(input_scale, torch.Tensor) and input_scale.numel() == 1 and input_scale.dtype == torch.float32,
            "input_scale must be a one-element float32 tensor (a static per-tensor scale) or None "
            f"(dynamic); got {_describe(input_scale)}",
        )
        check(
            input_scale.device == x.device,
            f"input_scale is on {input_scale.device}; it must be on x's device {x.device}",
        )


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)} {t.dtype}"
    return repr(t)


def _check_config(config: Mapping[str, int] | None) -> dict[str, int]:
    if config is None:
        return {}
    unknown = sorted(set(config) - CONFIG_KEYS)
    check(not unknown, f"config keys {unknown} are not among {sorted(CONFIG_KEYS)}")
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if key in config:
            v = config[key]
            check(_is_pow2(v) and v >= 16, f"config {key} must be a power of two >= 16; got {v}")
    for key in ("SPLIT_K", "GROUP_M", "num_warps", "num_stages"):
        if key in config:
            check(config[key] >= 1, f"config {key} must be >= 1; got {config[key]}")
    return dict(config)


def _split_k(tiles: int, k_tiles: int, device: torch.device) -> int:
    """Splits of the K loop that bring the programs to about twice the SM count when
    the output tiles alone would leave SMs idle (decode); at most 16, at least one K
    tile each."""
    target = 2 * num_sms(device)
    if tiles >= target or k_tiles <= 1:
        return 1
    return max(1, min(int(triton.cdiv(target, tiles)), k_tiles, 16))


def _splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split): ``split_k`` clamped so no split is empty; each split's
    range starts on a multiple of ``block_k``."""
    k_tiles = max(1, triton.cdiv(k, block_k))
    per = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    return triton.cdiv(k_tiles, per), per * block_k


def _launch_reduce(ws: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, splits: int) -> None:
    m, n = y.shape
    block_n = 128 if INTERPRET else 1024
    _splitk_reduce_kernel[(m, triton.cdiv(n, block_n))](
        ws, bias if bias is not None else ws, y, n, splits, ws.stride(0), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, ROUND_BF16=INTERPRET and y.dtype == torch.bfloat16, BLOCK_N=block_n,
        num_warps=4,
    )  # fmt: skip


def _workspace(splits: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------- WNA16
def _check_wna16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Shapes and dtypes of the WNA16 arguments; returns ``(M, N, K)``."""
    _check_x(x)
    check(bits in (4, 8), f"bits must be 4 or 8; got {bits!r}")
    m, k = x.shape
    check(
        qweight.dtype == torch.uint8 and qweight.dim() == 2,
        f"qweight must be a 2-D uint8 tensor; got shape {tuple(qweight.shape)} {qweight.dtype}",
    )
    n = qweight.shape[0]
    if bits == 4:
        check(k % 2 == 0, f"x's K={k} must be even for 4-bit weights (two codes per byte)")
        check(
            qweight.shape[1] * 2 == k,
            f"qweight must be [N, K // 2] = [N, {k // 2}] for bits=4 (x's K={k}); got {tuple(qweight.shape)}",
        )
    else:
        check(qweight.shape[1] == k, f"qweight must be [N, K] = [N, {k}] for bits=8 (x's K={k}); got {tuple(qweight.shape)}")
    check(
        isinstance(group_size, int) and group_size > 0 and k % group_size == 0,
        f"group_size must be a positive divisor of K={k} (K for per-channel); got {group_size!r}",
    )
    groups = k // group_size
    check(
        scales.shape == (n, groups) and scales.dtype in FLOAT_DTYPES,
        f"scales must be float32/float16/bfloat16 [N, K // group_size] = [{n}, {groups}]; got shape "
        f"{tuple(scales.shape)} {scales.dtype}",
    )
    check(
        offsets.shape == scales.shape and offsets.dtype == scales.dtype,
        f"offsets must match scales ({tuple(scales.shape)} {scales.dtype}); got shape {tuple(offsets.shape)} "
        f"{offsets.dtype}",
    )
    _check_bias(bias, n)
    return m, n, k


def _wna16_block_k(block_k: int, k: int, group_size: int) -> tuple[int, bool]:
    """(BLOCK_K, gather): the largest power of two <= ``block_k`` dividing the group
    size (at least 16) so each K tile lies in one group; one group for all of K takes
    ``block_k`` itself. Otherwise gather the scales per element at ``block_k``."""
    if group_size == k or group_size % block_k == 0:
        return block_k, False
    pow2 = group_size & -group_size
    if pow2 >= 16:
        return min(block_k, pow2), False
    return block_k, True


def wna16_default_config(
    m: int, n: int, k: int, group_size: int, dtype: torch.dtype, device: torch.device
) -> dict[str, int]:
    """Launch settings of :func:`wna16_gemm` from host-known sizes (before the
    group-size rule of ``BLOCK_K``, which the launcher applies).

    Decode (``M <= 16``): ``BLOCK_M`` 16 (the smallest ``tl.dot``), narrow ``BLOCK_N``
    tiles and split-K up to about two programs per SM, deep pipelining (memory bound:
    the packed weights are the traffic). Larger M: 64 or 128-row tiles. Starting points
    from vLLM's and PyTorch's split-K GPTQ kernels, not yet tuned on a GPU
    (benchmarks/gpu_check.py, section quant_gemm, reports a small sweep). Under the
    interpreter: small tiles so test sizes cover the loops, masks and splits.
    """
    if INTERPRET:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "num_warps": 4, "num_stages": 1}
    elif m <= 16:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    elif m <= 64:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    if dtype == torch.float32 and not INTERPRET:  # fp32 operands: half the K tile, IEEE products
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 32)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    cfg["SPLIT_K"] = _split_k(tiles, triton.cdiv(k, cfg["BLOCK_K"]), device)
    return cfg


def wna16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """``y = x @ w^T (+ bias)`` for grouped integer weights (GPTQ, AWQ,
    compressed-tensors W4A16/W8A16, GGUF Q4_0/Q4_1/Q8_0/Q4_K), dequantized in registers:
    ``w[n, k] = q[n, k] * scales[n, k // g] + offsets[n, k // g]``.

    Args:
        x: ``[M, K]`` float16/bfloat16 (float32 allowed), any strides.
        qweight: uint8, ``[N, K // 2]`` for ``bits=4`` (byte j of row n: k = 2j in the
            low nibble, k = 2j + 1 in the high one) or ``[N, K]`` for ``bits=8``; codes
            unsigned in ``[0, 2**bits)``.
        scales, offsets: ``[N, K // group_size]``, one float dtype for both (fp16, bf16
            or fp32); ``offsets = -zero_point * scales``.
        bits: 4 or 8.
        group_size: ``g``, a positive divisor of K (``K``: per channel).
        bias: optional ``[N]``, any float dtype; added in fp32 before the one rounding.
        config: launch settings overriding :func:`wna16_default_config` (keys in
            :data:`CONFIG_KEYS`; tests and tuning).

    Returns:
        ``[M, N]`` in x's dtype, a new tensor: each weight rounded to x's dtype after
        dequantization (the tensor cores' operand), products summed in fp32. Nothing is
        mutated.

    Raises:
        ValueError: naming the argument, for a shape, dtype or value outside the above
            (``bits``, a ``group_size`` that does not divide K, ``scales``/``offsets``
            not ``[N, K // g]``, ``qweight`` not matching K), tensors on different
            devices, or off CUDA unless the Triton interpreter is on; a bad ``config``.

    Design after vLLM's ``awq_triton.py``; split-K for decode-sized M.
    """
    m, n, k = _check_wna16(x, qweight, scales, offsets, bits, group_size, bias)
    overrides = _check_config(config)
    check_device(*(t for t in (x, qweight, scales, offsets, bias) if t is not None))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = wna16_default_config(m, n, k, group_size, x.dtype, x.device)
    cfg.update(overrides)
    block_k, gather = _wna16_block_k(cfg["BLOCK_K"], k, group_size)
    if "BLOCK_K" in overrides:  # taken as given: per-element scales if tiles straddle groups
        block_k = overrides["BLOCK_K"]
        gather = not (group_size == k or group_size % block_k == 0)
    if "SPLIT_K" not in overrides and block_k != cfg["BLOCK_K"]:
        tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        cfg["SPLIT_K"] = _split_k(tiles, triton.cdiv(k, block_k), x.device)
    splits, k_per_split = _splits(k, block_k, cfg["SPLIT_K"])
    ws = _workspace(splits, m, n, x.device)
    rounding = 0
    if INTERPRET:
        rounding = {torch.float16: 1, torch.bfloat16: 2}.get(x.dtype, 0)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    _wna16_kernel[grid](
        x, qweight, scales, offsets, bias if bias is not None else scales, y, ws,
        m, n, k, group_size, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), offsets.stride(0), offsets.stride(1),
        y.stride(0), y.stride(1), ws.stride(0),
        BITS=bits, GATHER_SCALES=gather, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype), ROUND_W=rounding,
        ROUND_BF16=INTERPRET and x.dtype == torch.bfloat16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if splits > 1:
        _launch_reduce(ws, bias, y, splits)
    return y


def _unpack_rows(qweight: torch.Tensor, bits: int, n0: int, n1: int) -> torch.Tensor:
    """The integer codes of weight rows ``n0:n1`` as ``[n1 - n0, K]`` uint8."""
    q = qweight[n0:n1]
    if bits == 4:
        q = torch.stack((q & 15, q >> 4), dim=-1).flatten(-2)
    return q


def dequantize_wna16_reference(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """fp32 ``w[n, k] = q[n, k] * scales[n, k // g] + offsets[n, k // g]`` for weight
    rows ``rows = (n0, n1)`` (all when None): ``[n1 - n0, K]``, a new tensor, on
    qweight's device. Shapes as :func:`wna16_gemm`'s (not checked here: its callers do).
    """
    n0, n1 = (0, qweight.shape[0]) if rows is None else rows
    q = _unpack_rows(qweight, bits, n0, n1).float()
    groups = scales.shape[1]
    s = scales[n0:n1].float()[:, :, None]
    o = offsets[n0:n1].float()[:, :, None]
    return (q.view(n1 - n0, groups, group_size) * s + o).view(n1 - n0, -1)


def wna16_gemm_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch oracle and CPU fallback of :func:`wna16_gemm`, same arguments and
    result, any device: per tile of :data:`REFERENCE_ROWS` weight rows, the fp32
    dequantized weight rounded to x's dtype, ``y = fp32(x) @ fp32(w)^T (+ bias)`` in fp32,
    one rounding into x's dtype. Nothing is mutated.

    Raises:
        ValueError: as :func:`wna16_gemm` for shapes, dtypes and values.
    """
    m, n, _ = _check_wna16(x, qweight, scales, offsets, bits, group_size, bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    xf = x.float()
    for n0 in range(0, n, REFERENCE_ROWS):
        n1 = min(n, n0 + REFERENCE_ROWS)
        w = dequantize_wna16_reference(qweight, scales, offsets, bits, group_size, (n0, n1))
        part = xf @ w.to(x.dtype).float().T
        if bias is not None:
            part += bias[n0:n1].float()
        y[:, n0:n1] = part.to(x.dtype)
    return y


# ----------------------------------------------------------------------------- activation quantization
def _quantize_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None, group_size: int | None, int8: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    check_device(*(t for t in (x, input_scale) if t is not None))
    out_dtype = torch.int8 if int8 else FP8_DTYPE
    x_q = torch.empty((m, k), dtype=out_dtype, device=x.device)
    if input_scale is not None:
        scales = input_scale.reshape(1, 1)
        gs, groups = k, 1
    else:
        gs = k if group_size is None else group_size
        groups = triton.cdiv(k, gs)
        scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return x_q, scales
    block = min(triton.next_power_of_2(gs), 256 if INTERPRET else 1024)
    fmt = FP8_FORMATS[FP8_DTYPE]
    _quant_act_kernel[(m, groups)](
        x, x_q, scales, input_scale if input_scale is not None else scales,
        k, gs, x.stride(0), x.stride(1), x_q.stride(0), scales.stride(0),
        STATIC=input_scale is not None, IS_INT8=int8,
        QMAX=INT8_MAX if int8 else FP8_MAX, QMIN=-128.0 if int8 else -FP8_MAX, EPS=MIN_AMAX,
        BLOCK=block, ROUND_FP8=INTERPRET and not int8,
        MANTISSA_BITS=fmt.mantissa_bits, MIN_NORMAL_EXP=fmt.min_normal_exp,
        num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    return x_q, scales


def _check_group(group_size: int | None, input_scale: torch.Tensor | None) -> None:
    if group_size is not None:
        check(
            isinstance(group_size, int) and group_size > 0,
            f"group_size must be a positive int (columns per scale) or None (per token); got {group_size!r}",
        )
        check(
            input_scale is None,
            "group_size is for dynamic scales; with a static input_scale leave it None",
        )


def quantize_fp8_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None = None, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 activations and their scales: ``x_q = clamp(x / s, -448, 448)`` cast
    with round-to-nearest-even, ``x ~ x_q * s``.

    Scales (float32): ``input_scale`` given (a one-element float32 tensor): static
    per-tensor, returned as a ``[1, 1]`` view of it. Else dynamic, ``s = max(amax,
    1e-10) / 448`` over each row (``group_size`` None: per token, ``[M, 1]``) or over
    each run of ``group_size`` columns of a row (``[M, ceil(K / group_size)]``, the last
    group shorter when it does not divide K; DeepSeek-V3's 1 x 128 activation groups).

    Args:
        x: ``[M, K]`` float32/float16/bfloat16, any strides. Not mutated.
    Returns:
        ``(x_q [M, K] float8_e4m3fn contiguous, scales)``, new tensors (the static
        scale excepted).
    Raises:
        ValueError: x not a 2-D float tensor, ``input_scale`` not a one-element float32
            tensor on x's device, ``group_size`` not a positive int or given with a
            static scale; tensors off CUDA unless the Triton interpreter is on.

    After vLLM's ``per_token_group_quant_fp8`` (``quantization/utils/fp8_utils.py``).
    """
    _check_x(x)
    _check_input_scale(input_scale, x)
    _check_group(group_size, input_scale)
    return _quantize_activations(x, input_scale, group_size, int8=False)


def _quant_reference(
    x: torch.Tensor, input_scale: torch.Tensor | None, group_size: int | None, qmax: float, int8: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    xf = x.float()
    if input_scale is not None:
        scales = input_scale.reshape(1, 1)
        full = scales.float()
    else:
        gs = k if group_size is None else group_size
        groups = triton.cdiv(k, gs)
        padded = torch.nn.functional.pad(xf.abs(), (0, groups * gs - k)).view(m, groups, gs)
        scales = padded.amax(dim=2).clamp(min=MIN_AMAX) / qmax  # [M, G]; [M, 1] per token
        full = scales.repeat_interleave(gs, dim=1)[:, :k] if group_size is not None else scales
    y = xf / full
    if int8:
        return y.clamp(-128.0, 127.0).round().to(torch.int8), scales
    return y.clamp(-qmax, qmax).to(FP8_DTYPE), scales


def quantize_fp8_activations_reference(
    x: torch.Tensor, input_scale: torch.Tensor | None = None, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch oracle of :func:`quantize_fp8_activations`: same arguments, results
    (bit for bit) and errors, any device."""
    _check_x(x)
    _check_input_scale(input_scale, x)
    _check_group(group_size, input_scale)
    return _quant_reference(x, input_scale, group_size, FP8_MAX, int8=False)


def quantize_int8_activations(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 activations and their scales: ``x_q = clamp(round(x / s), -128,
    127)``, rounding half to even (torch.round), ``x ~ x_q * s``.

    Scales (float32): ``input_scale`` given (one-element float32): static, returned as
    a ``[1, 1]`` view of it; else dynamic per token, ``s = max(amax, 1e-10) / 127``,
    ``[M, 1]``.

    Args:
        x: ``[M, K]`` float32/float16/bfloat16, any strides. Not mutated.
    Returns:
        ``(x_q [M, K] int8 contiguous, scales)``, new tensors (the static scale excepted).
    Raises:
        ValueError: x not a 2-D float tensor, ``input_scale`` not a one-element float32
            tensor on x's device; tensors off CUDA unless the Triton interpreter is on.

    The semantics of vLLM's ``scaled_int8_quant`` (dynamic per token, symmetric).
    """
    _check_x(x)
    _check_input_scale(input_scale, x)
    return _quantize_activations(x, input_scale, None, int8=True)


def quantize_int8_activations_reference(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch oracle of :func:`quantize_int8_activations`: same arguments, results
    (bit for bit) and errors, any device."""
    _check_x(x)
    _check_input_scale(input_scale, x)
    return _quant_reference(x, input_scale, None, INT8_MAX, int8=True)


# ----------------------------------------------------------------------------- FP8 / INT8 GEMMs
def _check_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    act_quant: bool,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[int, int, int, torch.dtype]:
    _check_x(x)
    m, k = x.shape
    check(
        weight.dtype == FP8_DTYPE and weight.dim() == 2 and weight.shape[1] == k,
        f"weight must be float8_e4m3fn [N, K={k}]; got shape {tuple(weight.shape)} {weight.dtype}",
    )
    n = weight.shape[0]
    if block is None:
        check(
            weight_scale.dtype == torch.float32 and weight_scale.shape == (n,),
            f"weight_scale must be float32 [N={n}] (per channel) without block; got {_describe(weight_scale)}",
        )
    else:
        check(
            isinstance(block, (tuple, list)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
            f"block must be (block_n, block_k), two positive ints, or None; got {block!r}",
        )
        want = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
        check(
            weight_scale.dtype == torch.float32 and tuple(weight_scale.shape) == want,
            f"weight_scale must be float32 [ceil(N / {block[0]}), ceil(K / {block[1]})] = [{want[0]}, {want[1]}] "
            f"for block={tuple(block)}; got {_describe(weight_scale)}",
        )
    _check_input_scale(input_scale, x)
    check(
        act_quant or input_scale is None,
        "input_scale is for quantized activations; with act_quant=False (W8A16) leave it None",
    )
    _check_bias(bias, n)
    return m, n, k, _check_out_dtype(out_dtype, x)


def _check_int8(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
) -> tuple[int, int, int, torch.dtype]:
    _check_x(x)
    m, k = x.shape
    check(
        weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[1] == k,
        f"weight must be int8 [N, K={k}]; got shape {tuple(weight.shape)} {weight.dtype}",
    )
    n = weight.shape[0]
    check(
        weight_scale.dtype == torch.float32 and weight_scale.shape == (n,),
        f"weight_scale must be float32 [N={n}]; got {_describe(weight_scale)}",
    )
    _check_input_scale(input_scale, x)
    _check_bias(bias, n)
    return m, n, k, _check_out_dtype(out_dtype, x)


def scaled_gemm_default_config(
    m: int, n: int, k: int, kind: str, block_k: int | None, dtype: torch.dtype, device: torch.device
) -> dict[str, int]:
    """Launch settings of :func:`fp8_gemm` / :func:`int8_gemm`; ``kind`` is ``"w8a8"``
    (FP8 or INT8 codes on both sides) or ``"w8a16"``; ``block_k`` the weight's K block
    (None: per channel), which ``BLOCK_K`` must divide (the launcher enforces it).

    Large M: 128 x 256 x 128 tiles, 8 warps, 3 stages for per-channel W8A8 (the FP8
    configuration of Triton's matmul tutorial on Hopper); 128 x 128 for block-wise and
    W8A16. Decode-sized M: 16-row tiles and split-K as :func:`wna16_default_config`.
    Not yet tuned on a GPU. Under the interpreter: small tiles.
    """
    if INTERPRET:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "num_warps": 4, "num_stages": 1}
    elif m <= 16:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    elif m <= 128:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    elif kind == "w8a8" and block_k is None:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    if kind == "w8a16" and not INTERPRET:  # 16/32-bit operands: twice the bytes per K
        cfg["BLOCK_K"] = 32 if dtype == torch.float32 else 64
    if block_k is not None:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], block_k & -block_k)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    cfg["SPLIT_K"] = _split_k(tiles, triton.cdiv(k, cfg["BLOCK_K"]), device)
    return cfg


def _launch_scaled(
    a: torch.Tensor,
    weight: torch.Tensor,
    a_scales: torch.Tensor | None,
    weight_scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    kind: str,
    x_dtype: torch.dtype,
    overrides: dict[str, int],
) -> torch.Tensor:
    m, k = a.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return y
    block_k = None if block is None else block[1]
    cfg = scaled_gemm_default_config(m, n, k, kind, block_k, x_dtype, a.device)
    cfg.update(overrides)
    if block_k is not None:
        check(
            block_k % cfg["BLOCK_K"] == 0,
            f"BLOCK_K={cfg['BLOCK_K']} must divide the weight's K block {block_k} (block={tuple(block or ())}); "
            "the kernel needs block[1] to be a multiple of 16",
        )
    splits, k_per_split = _splits(k, cfg["BLOCK_K"], cfg["SPLIT_K"])
    ws = _workspace(splits, m, n, a.device)
    if a_scales is None:
        a_mode, s_a, sam, sag = 0, weight_scale, 0, 0
    else:
        a_mode = 2 if a_scales.shape[1] > 1 else 1  # [M, G] groups along K, else one per row
        s_a = a_scales
        sam = a_scales.stride(0) if a_scales.shape[0] > 1 else 0
        sag = a_scales.stride(1) if a_scales.shape[1] > 1 else 0
    block_n, bk = block if block is not None else (1, 1)
    bsn = weight_scale.stride(0)
    bsg = weight_scale.stride(1) if block is not None else 0
    upcast = kind == "w8a16"
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    _scaled_gemm_kernel[grid](
        a, weight, s_a, weight_scale, bias if bias is not None else weight_scale, y, ws,
        m, n, k, k_per_split, block_n, bk,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1),
        sam, sag, bsn, bsg, y.stride(0), y.stride(1), ws.stride(0),
        A_SCALE=a_mode, B_BLOCK=block is not None, INT_ACC=a.dtype == torch.int8,
        HAS_BIAS=bias is not None, SPLIT=splits > 1,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        UPCAST=upcast, DOT_DTYPE=dot_dtype(x_dtype) if upcast else tl.float32,
        DOT_PRECISION=dot_precision(x_dtype) if upcast else None,
        ROUND_BF16=INTERPRET and out_dtype == torch.bfloat16,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if splits > 1:
        _launch_reduce(ws, bias, y, splits)
    return y


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    act_quant: bool = True,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """``y = x @ w^T (+ bias)`` for FP8 E4M3 weights, ``w = weight * weight_scale``.

    W8A8 (``act_quant=True``): x quantized first with :func:`quantize_fp8_activations`
    (dynamic per token for per-channel weights, per token and ``block[1]`` columns for
    block-wise ones; static per tensor when ``input_scale`` is given), then an FP8 x FP8
    ``tl.dot``: ``y[m, n] = sum_k x_q[m, k] w_q[n, k] * s_x * s_w``. W8A16
    (``act_quant=False``): x stays in its dtype, the FP8 weight is converted to it in
    registers (exact) and scaled after the products.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, any strides. Not mutated.
        weight: float8_e4m3fn ``[N, K]``.
        weight_scale: float32, ``[N]`` (per output channel) without ``block``;
            ``[ceil(N / bn), ceil(K / bk)]`` with ``block=(bn, bk)``.
        input_scale: None (dynamic) or a one-element float32 tensor (static, per tensor;
            W8A8 only).
        block: None or ``(bn, bk)``; the kernel needs ``bk`` a multiple of 16 (128 in
            DeepSeek-V3 / Qwen3 FP8 checkpoints).
        act_quant: True for W8A8, False for W8A16.
        bias: optional ``[N]``, any float dtype, added in fp32.
        out_dtype: float32/float16/bfloat16; default x's dtype.
        config: launch settings overriding :func:`scaled_gemm_default_config`.

    Returns:
        ``[M, N]`` in ``out_dtype``, a new tensor; products summed in fp32 (on Hopper in
        the tensor cores' reduced-precision FP8 accumulator within a block).

    Raises:
        ValueError: naming the argument, for shapes or dtypes outside the above (e.g. a
            ``weight_scale`` that does not match ``N`` or the block grid), ``input_scale``
            with ``act_quant=False``, ``block[1]`` not a multiple of 16 (kernel only),
            tensors on different devices or off CUDA unless the interpreter is on.

    After vLLM's ``w8a8_block_fp8_matmul`` / ``per_token_group_quant_fp8`` (from SGLang's
    ``fp8_kernel.py``) and ``triton_scaled_mm``.
    """
    *_, dtype = _check_fp8(x, weight, weight_scale, input_scale, block, act_quant, bias, out_dtype)
    overrides = _check_config(config)
    if block is not None:
        check(
            block[1] % 16 == 0,
            f"block[1] (the K block) must be a multiple of 16 for the kernel; got block={tuple(block)}",
        )
        block = (int(block[0]), int(block[1]))
    check_device(*(t for t in (x, weight, weight_scale, input_scale, bias) if t is not None))
    if not act_quant:
        return _launch_scaled(x, weight, None, weight_scale, block, bias, dtype, "w8a16", x.dtype, overrides)
    group = block[1] if block is not None and input_scale is None else None
    x_q, x_s = _quantize_activations(x, input_scale, group, int8=False)
    return _launch_scaled(x_q, weight, x_s, weight_scale, block, bias, dtype, "w8a8", x.dtype, overrides)


def _expand_block_scales(weight_scale: torch.Tensor, block: tuple[int, int], n0: int, n1: int, k: int) -> torch.Tensor:
    """Block scales of weight rows ``n0:n1`` as one fp32 scale per element ``[n1-n0, K]``."""
    rows = torch.arange(n0, n1, device=weight_scale.device) // block[0]
    return weight_scale[rows].repeat_interleave(block[1], dim=1)[:, :k]


def fp8_gemm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    act_quant: bool = True,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The torch oracle and CPU fallback of :func:`fp8_gemm`, same arguments and
    result, any device, per tile of :data:`REFERENCE_ROWS` weight rows, in fp32:

    - per channel: ``acc = a @ fp32(weight)^T`` (``a``: the FP8 codes of
      :func:`quantize_fp8_activations_reference`, or x itself for W8A16), then
      ``acc * s_x * s_w`` (the kernel's epilogue order);
    - block-wise: dequantized ``(x_q * s_x) @ (weight * s_w)^T`` (W8A16: ``x @ ...``).

    Then ``+ bias`` and one rounding into ``out_dtype``. Nothing is mutated. Any ``block``
    of positive ints is accepted here (the kernel needs ``block[1] % 16 == 0``).

    Raises:
        ValueError: as :func:`fp8_gemm` for shapes and dtypes.
    """
    m, n, k, dtype = _check_fp8(x, weight, weight_scale, input_scale, block, act_quant, bias, out_dtype)
    if act_quant:
        group = block[1] if block is not None and input_scale is None else None
        x_q, x_s = _quant_reference(x, input_scale, group, FP8_MAX, int8=False)
        a = x_q.float()
        if block is not None:  # dequantized activations
            full = x_s.repeat_interleave(block[1], dim=1)[:, :k] if group is not None else x_s
            a = a * full
    else:
        a, x_s = x.float(), None
    y = torch.empty((m, n), dtype=dtype, device=x.device)
    for n0 in range(0, n, REFERENCE_ROWS):
        n1 = min(n, n0 + REFERENCE_ROWS)
        w = weight[n0:n1].float()
        if block is None:
            part = a @ w.T
            if x_s is not None:
                part = part * x_s
            part = part * weight_scale[n0:n1]
        else:
            part = a @ w.mul_(_expand_block_scales(weight_scale, block, n0, n1, k)).T
        if bias is not None:
            part += bias[n0:n1].float()
        y[:, n0:n1] = part.to(dtype)
    return y


def int8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    config: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """INT8 W8A8: ``y = (x_q @ w_q^T) * s_x[m] * s_w[n] (+ bias)``, x quantized by
    :func:`quantize_int8_activations` (dynamic per token, or static ``input_scale``),
    an INT8 x INT8 ``tl.dot`` into int32, scales applied once to the exact sums.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, any strides. Not mutated.
        weight: int8 ``[N, K]`` (symmetric codes).
        weight_scale: float32 ``[N]``.
        input_scale: None (dynamic per token) or a one-element float32 tensor (static).
        bias: optional ``[N]``, any float dtype, added in fp32.
        out_dtype: float32/float16/bfloat16; default x's dtype.
        config: launch settings overriding :func:`scaled_gemm_default_config`.

    Returns:
        ``[M, N]`` in ``out_dtype``, a new tensor.

    Raises:
        ValueError: naming the argument, for shapes or dtypes outside the above;
            tensors on different devices, or off CUDA unless the interpreter is on.

    After vLLM's ``triton_scaled_mm`` (``compressed_tensors/triton_scaled_mm.py``).
    """
    *_, dtype = _check_int8(x, weight, weight_scale, input_scale, bias, out_dtype)
    overrides = _check_config(config)
    check_device(*(t for t in (x, weight, weight_scale, input_scale, bias) if t is not None))
    x_q, x_s = _quantize_activations(x, input_scale, None, int8=True)
    return _launch_scaled(x_q, weight, x_s, weight_scale, None, bias, dtype, "w8a8", x.dtype, overrides)


def int8_gemm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The torch oracle and CPU fallback of :func:`int8_gemm`, same arguments and
    result, any device: the int32 sums ``x_q @ w_q^T`` exactly (fp32 products over K
    chunks of 1,024, each chunk's sum below 2^24, so exact, added in int32), then
    ``fp32(acc) * s_x * s_w (+ bias)`` rounded once into ``out_dtype``, per tile of
    :data:`REFERENCE_ROWS` weight rows. Nothing is mutated.

    Raises:
        ValueError: as :func:`int8_gemm` for shapes and dtypes.
    """
    m, n, k, dtype = _check_int8(x, weight, weight_scale, input_scale, bias, out_dtype)
    x_q, x_s = _quant_reference(x, input_scale, None, INT8_MAX, int8=True)
    a = x_q.float()
    y = torch.empty((m, n), dtype=dtype, device=x.device)
    for n0 in range(0, n, REFERENCE_ROWS):
        n1 = min(n, n0 + REFERENCE_ROWS)
        acc = torch.zeros((m, n1 - n0), dtype=torch.int32, device=x.device)
        for k0 in range(0, k, 1024):
            k1 = min(k, k0 + 1024)
            acc += (a[:, k0:k1] @ weight[n0:n1, k0:k1].float().T).to(torch.int32)
        part = acc.float() * x_s * weight_scale[n0:n1]
        if bias is not None:
            part += bias[n0:n1].float()
        y[:, n0:n1] = part.to(dtype)
    return y
