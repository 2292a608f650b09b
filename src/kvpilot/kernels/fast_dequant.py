"""Dequantization of KV cache pages with plain torch ops, fast on CPU.

The ``torch`` attention backend (the CPU engine, and the test oracle) reads quantized
pages with these. A direct cast of an FP8 tensor (``x.to(torch.float32)``) converts one
value at a time on CPU, about 7x the cost of gathering fp32 pages (measured on the
development machine: 2.5 ms vs 0.37 ms of CPU time for 1,600 tokens x 3 heads x 64); the
paths here are exact and take a few vectorized passes:

- FP8 E5M2 is the upper byte of an IEEE half: ``(byte << 8)`` viewed as float16.
- FP8 E4M3 (fn) becomes a half with the same bits shifted: sign to bit 15, exponent and
  mantissa to bits 7..13. The half then reads ``2**-8`` times the value (the exponent
  bias is 15, not 7; subnormals map to subnormals), a factor the caller folds into a
  scale it applies anyway (:data:`FP8_HALF_FACTOR`). E4M3's NaN codes (never stored:
  writes clamp to +-448) would read as +-480.
- 4-bit pages (``fp4_e2m1``/``int4``, :mod:`kvpilot.kernels.kv4`): integer ops decode
  both nibbles of every byte into the two halves of the output; one in-place multiply
  applies the group scales and the tensor scale.
- Pages are gathered as whole rows of 8-byte words (:func:`gather_blocks`).
"""

from __future__ import annotations

import torch

from .kv4 import GROUP_SIZE, KV4Format, kv4_format

FP8_HALF_FACTOR = {torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 1.0}
"""Value of an FP8 code = its :func:`fp8_as_half` value x this factor."""


def fp8_as_half(raw: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """FP8 codes (uint8 bytes of ``fp8_dtype``) as float16 values equal to the FP8 value
    divided by ``FP8_HALF_FACTOR[fp8_dtype]`` (exact). Same shape; a new tensor.

    Raises:
        ValueError: ``raw`` not uint8, or ``fp8_dtype`` not an FP8 dtype.
    """
    if raw.dtype != torch.uint8:
        raise ValueError(f"fp8_as_half takes the raw uint8 bytes; got {raw.dtype}")
    h = raw.to(torch.int16)
    if fp8_dtype == torch.float8_e5m2:
        return h.bitwise_left_shift_(8).view(torch.float16)
    if fp8_dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_as_half: {fp8_dtype} is not float8_e4m3fn or float8_e5m2")
    h.bitwise_left_shift_(7)  # sign -> bit 14, exponent/mantissa -> bits 7..13
    return h.add_(h & 0x4000).view(torch.float16)  # carry bit 14 into bit 15 (the sign)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` for a contiguous ``cache [num_blocks, ...]`` of any dtype, copied
    as whole rows of 8-, 4-, 2- or 1-byte words (the widest that divides a block's
    bytes): indexing a uint8 or FP8 tensor copies byte by byte, several times slower.
    Returns ``[*blocks.shape, *cache.shape[1:]]`` in ``cache.dtype``; a new tensor."""
    num_blocks = cache.shape[0]
    raw = cache.view(torch.uint8) if cache.dtype.is_floating_point and cache.element_size() == 1 else cache
    row = raw.reshape(num_blocks, -1)
    row_bytes = row.shape[1] * row.element_size()
    for word in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0:
            break
    words = row.view(torch.uint8).view(num_blocks, -1).view(word)
    out = words.index_select(0, blocks.reshape(-1).long()).view(raw.dtype)
    return out.view(*blocks.shape, *cache.shape[1:]).view(cache.dtype)


# A half whose bit pattern is an E2M1 code moved into place reads 2**-14 of its value.
_E2M1_HALF_FACTOR = 2.0**14


def dequantize_kv4_fast(
    packed: torch.Tensor,
    group_scales: torch.Tensor,
    fmt: KV4Format | str,
    tensor_scale: torch.Tensor | float | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The values of :func:`kvpilot.kernels.kv4.dequantize_kv4` (up to the rounding of
    ``group_scale x tensor_scale``, applied as one product), in a few vectorized passes.

    Each byte holds dim ``j`` (low nibble) and dim ``j + D/2`` (high nibble): both
    halves decode with integer ops (int4: ``code - 8``; E2M1: its sign, exponent and
    mantissa bits moved into a half's), are copied into the two halves of the output
    and one in-place multiply applies the group scales (and the tensor scale).

    Args:
        packed: ``[..., D // 2]`` uint8.
        group_scales: ``[..., D // 16]`` float8_e4m3fn.
        tensor_scale: the layer's fp32 ``k_scale``/``v_scale`` (0-d tensor or float), or None.
    Returns:
        ``[..., D]`` in ``dtype``.
    """
    name = fmt.name if isinstance(fmt, KV4Format) else kv4_format(fmt).name
    half_d = packed.shape[-1]
    groups = group_scales.shape[-1]
    lead = packed.shape[:-1]
    b = packed.to(torch.int16)
    if name == "int4":
        lo, hi = (b & 15).sub_(8), (b >> 4).sub_(8)
        factor = 1.0
    else:  # fp4_e2m1: sign (bit 3) -> bit 15, exponent and mantissa (bits 0..2) -> bits 9..11
        lo = ((b << 12) & -32768).bitwise_or_((b << 9) & 0x0E00).view(torch.float16)
        hi = ((b << 8) & -32768).bitwise_or_((b << 5) & 0x0E00).view(torch.float16)
        factor = _E2M1_HALF_FACTOR
    factor *= FP8_HALF_FACTOR[torch.float8_e4m3fn]
    scales = fp8_as_half(group_scales.contiguous().view(torch.uint8), torch.float8_e4m3fn).to(torch.float32)
    scales = scales.mul_(factor if tensor_scale is None else tensor_scale * factor)
    out = torch.empty((*lead, 2 * half_d), dtype=torch.float32, device=packed.device)
    out[..., :half_d].copy_(lo)  # converts as it copies
    out[..., half_d:].copy_(hi)
    # In place, broadcasting one scale over its 16 values (faster than a product into
    # a preallocated output, whose 16-wide inner loop does not vectorize as well).
    out.view(*lead, groups, GROUP_SIZE).mul_(scales.unsqueeze(-1))
    return out if out.dtype == dtype else out.to(dtype)
