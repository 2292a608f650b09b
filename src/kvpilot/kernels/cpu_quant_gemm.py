"""Grouped-integer (WNA16) and float-weight GEMMs for few activation rows on CPU
(C++, ``csrc/quant_gemm_cpu.cpp``), and the INT8 W8A8 passes.

``x @ W.T`` for ``W`` in :class:`kvpilot.engine.quantization.weights.WNA16Weight`'s
canonical layout (4- or 8-bit unsigned codes, a scale and an offset per group of
columns), with every weight dequantized exactly in fp32 in registers and fp32
accumulation: the result is ``x @ dequantize(W).T`` up to summation order, and a row's
result does not depend on the other rows of ``x`` (batch invariant). Made for decode
steps (1 to a few dozen rows), which are bound by reading the weights: each row of codes
is read once per call. Built and cached with the other CPU kernels by
:func:`kvpilot.kernels.cpu_attention.load`.
"""

from __future__ import annotations

import torch

from .cpu_attention import load

X_DTYPES = (torch.float32, torch.bfloat16)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _activation_rows(x: torch.Tensor) -> torch.Tensor:
    """Load the kernels; ``x`` as the GEMMs read it: 2-D with contiguous rows, float32
    or bfloat16 (other float dtypes converted to float32)."""
    load()
    if x.dtype not in X_DTYPES:
        x = x.float()
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    return x


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
               group_size: int) -> torch.Tensor:
    """``x @ W.T`` with ``W[n, k] = q[n, k] * scales[n, k // g] + offsets[n, k // g]``.

    Args:
        x: ``[M, K]`` float32 or bfloat16 (other float dtypes are converted to float32).
        qweight: uint8 ``[N, K // 2]`` (4 bits: column ``2j`` in byte ``j``'s low nibble,
            ``2j + 1`` in its high one) or ``[N, K]`` (8 bits).
        scales, offsets: ``[N, K // group_size]``, one of float32/bfloat16/float16.
        bits: 4 or 8; group_size: divides ``K`` (multiples of 32 take the vectorized
            path, any other size a slower one).
    Returns:
        a new ``[M, N]`` float32 tensor.
    Raises:
        RuntimeError: the kernels are unavailable, or shapes, dtypes or layouts as above
            not met (the message names the tensor).
    """
    x = _activation_rows(x)
    if offsets.dtype != scales.dtype:
        offsets = offsets.to(scales.dtype)
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32)
    torch.ops.kvpilot_cpu.wna16_gemm_cpu(out, x, qweight.contiguous(), scales.contiguous(), offsets.contiguous(),
                                         int(bits), int(group_size))
    return out


def float_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.float().T`` reading the weight where it lies: each weight is widened
    exactly to fp32 in registers and accumulated in fp32 (the tiles of
    :func:`wna16_gemm`: batch invariant, one read of the weight per call, no packed copy).

    Args:
        x: ``[M, K]`` float32 or bfloat16 (other float dtypes are converted to float32).
        weight: ``[N, K]`` float32, bfloat16 or float16 (a quantized model's LM head in
            the checkpoint's dtype, or its tied embedding table).
    Returns:
        a new ``[M, N]`` float32 tensor.
    Raises:
        RuntimeError: the kernels are unavailable, or a shape, dtype or layout as above
            not met (the message names the tensor).
    """
    x = _activation_rows(x)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    torch.ops.kvpilot_cpu.float_gemm_cpu(out, x, weight.contiguous())
    return out


def int8_quantize_rows(x: torch.Tensor, input_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of activation rows in one pass per row: the bits of
    :func:`kvpilot.engine.quantization.weights.quantize_int8_rows`.

    Args:
        x: ``[T, K]`` float32, bfloat16 or float16 (CPU).
        input_scale: a static scale (> 0), or None for one per row, ``max |x[t]| / 127``
            (at least ``1e-10 / 127``).
    Returns:
        ``(x_q [T, K] int8, scales [T, 1] float32)`` with ``x ~= x_q * scales``; ``x_q`` is
        ``round_half_even(x / s)`` clamped to ``[-128, 127]``.
    Raises:
        RuntimeError: the kernels are unavailable, or a dtype/layout as above not met.
    """
    load()
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    xq = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32)
    torch.ops.kvpilot_cpu.int8_quantize_rows_cpu(xq, scales, x, float(input_scale or 0.0))
    return xq, scales


def int8_scale(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The INT8 W8A8 epilogue: ``(acc.float() * sx) * sw`` rounded to ``dtype``, one pass.

    Args:
        acc: ``[T, N]`` int32 from ``torch._int_mm``; sx: ``[T, 1]`` (or ``[T]``) float32
            activation scales; sw: ``[N]`` float32 weight scales.
        dtype: float32, bfloat16 or float16.
    Returns:
        a new ``[T, N]`` tensor of ``dtype``.
    Raises:
        RuntimeError: the kernels are unavailable, or shapes/dtypes as above not met.
    """
    load()
    out = torch.empty(acc.shape, dtype=dtype)
    torch.ops.kvpilot_cpu.int8_scale_cpu(out, acc.contiguous(), sx.reshape(-1).contiguous(), sw.contiguous())
    return out
