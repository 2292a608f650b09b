"""KV store: write each new token's K and V into its slot of the paged cache, quantizing
to FP8 on the way when the cache is FP8, or to a 4-bit format with group scales
(:mod:`kvpilot.kernels.kv4_triton`).

Layout (shared with :mod:`kvpilot.kernels.reference`)::

    key, value              [num_tokens, num_kv_heads, head_dim]    any float dtype
    key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping            [num_tokens] int64, slot = block_id * block_size + offset;
                            a negative slot skips the token (its KV is already cached)

One program writes a tile of ``BLOCK_T`` tokens x ``BLOCK_HD`` (heads x head_dim,
flattened) of K and of V. FP8 stores
``clamp(x / scale, -max, max)`` cast with round-to-nearest-even (a plain cast above the
format's max gives NaN, not saturation). Torch reference: :func:`reference.store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv4_triton import store_kv4
from .triton_utils import (
    FLOAT_DTYPES,
    FP8_FORMATS,
    INTERPRET,
    check,
    check_cache_pair,
    check_device,
    check_scale,
    round_to_fp8_grid,
)

# Elements of K (and of V) per program on the GPU: 4 tokens of 8 heads x 128.
MAX_TILE = 4096


@triton.jit
def _quantize_tile(  # type: ignore[no-untyped-def]
    x,
    scale,
    FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
):
    """``clamp(x / scale, -max, max)`` in fp32, on the FP8 grid when SOFT_ROUND."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if SOFT_ROUND:
        y = round_to_fp8_grid(y, MANTISSA_BITS, MIN_NORMAL_EXP)
    return y


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    # new K/V [T, H, D]; paged caches [NB, PAGE, H, D]; slot_mapping [T] int64 (< 0: skip)
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    # fp32 scalars, read only when QUANT
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    # key strides: token, head; value strides: token, head (dim stride 1)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    # cache strides: block, slot in block, head (dim stride 1)
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
):
    # Tile [BLOCK_T tokens, BLOCK_HD = heads x dims flattened] of one program.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hd = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD)
    heads = hd // HEAD_DIM
    dims = hd % HEAD_DIM
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1)
    mask = (slots[:, None] >= 0) & (hd[None, :] < NUM_HEADS * HEAD_DIM)
    slots = tl.maximum(slots, 0)  # keep the (masked) addresses in range
    dst = (
        (slots // PAGE)[:, None] * stride_cb
        + (slots % PAGE)[:, None] * stride_cs
        + (heads * stride_ch + dims)[None, :]
    )
    k = tl.load(
        key_ptr + tokens[:, None] * stride_kt + (heads * stride_kh + dims)[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + tokens[:, None] * stride_vt + (heads * stride_vh + dims)[None, :], mask=mask
    )
    if QUANT:
        k = _quantize_tile(
            k, tl.load(k_scale_ptr), FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, SOFT_ROUND
        )
        v = _quantize_tile(
            v, tl.load(v_scale_ptr), FP8_MAX, MANTISSA_BITS, MIN_NORMAL_EXP, SOFT_ROUND
        )
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _check_new_kv(
    key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    check(
        key.dim() == 3
        and tuple(key.shape[1:]) == (num_heads, head_dim)
        and value.shape == key.shape,
        f"key {tuple(key.shape)} / value {tuple(value.shape)} must be [num_tokens, {num_heads}, {head_dim}]",
    )
    check(
        key.dtype in FLOAT_DTYPES and value.dtype == key.dtype,
        f"key/value dtype {key.dtype}/{value.dtype} must be one float dtype",
    )
    check(
        key.stride(2) == 1 and value.stride(2) == 1,
        "key/value must have a contiguous head_dim axis",
    )
    check(
        slot_mapping.shape == (key.shape[0],) and slot_mapping.dtype == torch.int64,
        f"slot_mapping must be int64 [{key.shape[0]}]; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}",
    )
    check_device(key, value, slot_mapping)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    key_group_scales: torch.Tensor | None = None,
    value_group_scales: torch.Tensor | None = None,
    kv4_format: str | None = None,
) -> None:
    """Write ``key``/``value`` into the caches at ``slot_mapping``. Mutates both caches
    (and, for a 4-bit cache, both group-scale tensors).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` float, unit stride on dim.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``;
            for a 4-bit cache uint8 ``[..., head_dim // 2]`` (two codes per byte).
        slot_mapping: ``[num_tokens]`` int64; negative = skip.
        k_scale, v_scale: one-element fp32 tensors, required for FP8 and 4-bit caches.
        key_group_scales, value_group_scales: a 4-bit cache's E4M3 scales, one per 16
            values, ``[num_blocks, block_size, num_kv_heads, head_dim // 16]``.
        kv4_format: ``fp4_e2m1`` or ``int4`` for a 4-bit cache (None otherwise); the
            quantization is fused here (:mod:`kvpilot.kernels.kv4_triton`).
    Raises:
        ValueError: a shape, dtype, stride or device that does not fit.
    """
    if kv4_format is not None:
        _check_new_kv(key, value, slot_mapping, key.shape[1] if key.dim() == 3 else -1, key.shape[-1])
        store_kv4(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                  key_group_scales, value_group_scales, kv4_format)
        return
    _, page, num_heads, head_dim = check_cache_pair(key_cache, value_cache)
    _check_new_kv(key, value, slot_mapping, num_heads, head_dim)
    check_device(key, value, key_cache, value_cache, slot_mapping)
    fmt = FP8_FORMATS.get(key_cache.dtype)
    quant = fmt is not None
    k_scale = check_scale("k_scale", k_scale, quant, key_cache.device)
    v_scale = check_scale("v_scale", v_scale, quant, key_cache.device)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    block_hd = min(triton.next_power_of_2(num_heads * head_dim), MAX_TILE)
    block_t = max(1, MAX_TILE // block_hd) if not INTERPRET else 64
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads * head_dim, block_hd))
    _store_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale if quant else key,  # key stands in for absent scales
        v_scale if quant else key,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
        QUANT=quant,
        FP8_MAX=fmt.max if fmt is not None else 0.0,
        MANTISSA_BITS=fmt.mantissa_bits if fmt is not None else 0,
        MIN_NORMAL_EXP=fmt.min_normal_exp if fmt is not None else 0,
        SOFT_ROUND=quant and INTERPRET,
        num_warps=4,
    )
