"""Triton side of the 4-bit KV cache (:mod:`kvpilot.kernels.kv4` holds the format and its
torch reference): the in-register encode and decode helpers the store, decode and
prefill kernels share, the launcher checks of a 4-bit cache, and the fused
quantize-and-store kernel.

Layout (``D = head_dim``, ``HALF = D // 2``; see :mod:`kvpilot.kernels.kv4`)::

    key_cache, value_cache     [num_blocks, block_size, num_kv_heads, HALF]   uint8
                               byte j = code[j] | code[j + HALF] << 4
    key/value_group_scales     [num_blocks, block_size, num_kv_heads, D // 16] float8_e4m3fn
    k_scale, v_scale           fp32 per layer (the tensor scale)

Kernels work on the two halves of head_dim separately: a packed tile ``[N, HALF]``
gives the low half with ``& 15`` and the high half with ``>> 4``, each multiplied by its
group scale gathered per element (``dims // 16``: 16 neighbouring lanes read one byte).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv4 import GROUP_SCALE_DTYPE, GROUP_SIZE, check_kv4_head_dim, kv4_format
from .triton_utils import (
    INTERPRET,
    check,
    check_cache_pair,
    check_device,
    check_scale,
    round_to_fp8_grid,
)

# Elements of K (and of V) per store program on the GPU.
MAX_TILE = 4096

@triton.jit
def softcap_log2(x, softcap):  # type: ignore[no-untyped-def]
    """Soft-capped attention scores in the base-2 softmax domain: ``softcap * tanh(x) *
    log2(e)`` for fp32 ``x = scale * q.k / softcap`` (any shape; ``softcap`` a positive
    float). Shared by every attention kernel, plain and 4-bit (this module is the one
    they all import).

    ``tanh`` is built from one ``exp2`` as ``(1 - t) / (1 + t)`` with ``t = exp(-2|x|)``
    in ``(0, 1]``: no overflow for any finite ``x`` (large scores saturate at
    ``+-softcap``), and it runs the same under the interpreter, which lacks libdevice."""
    t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return (softcap * 1.4426950408889634) * tl.where(x < 0.0, -y, y)


@triton.jit
def kv4_values(codes, IS_INT4: tl.constexpr):  # type: ignore[no-untyped-def]
    """fp32 value of 4-bit codes (int32, 0..15), in units of the group scale.

    int4: offset binary, ``code - 8``. fp4_e2m1: bit 3 sign, bits 2-1 exponent ``e``,
    bit 0 mantissa ``m``; ``e == 0``: ``m / 2``, else ``2^(e-1) (1 + m / 2)``, built as
    fp32 bits (exact, no transcendental)."""
    if IS_INT4:
        return codes.to(tl.float32) - 8.0
    e = (codes >> 1) & 3
    m = codes & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, 0.5 * m.to(tl.float32), normal)
    return tl.where((codes & 8) != 0, -val, val)


@triton.jit
def load_kv4_tile(  # type: ignore[no-untyped-def]
    cache_ptr,
    group_scale_ptr,
    # [N] element offsets of each row's packed bytes / group scales; [N] row mask
    row_off,
    scale_row_off,
    row_mask,
    # [BLOCK_DH] dims of one half and their mask (< HALF)
    dims,
    dim_mask,
    HALF: tl.constexpr,
    IS_INT4: tl.constexpr,
):
    """Load ``[N, HALF]`` packed bytes and return the dequantized halves ``(lo, hi)``,
    each ``[N, BLOCK_DH]`` fp32 times its group scale (the tensor scale is not applied).

    The group scales are loaded as ``[N, BLOCK_DH // 16]`` tiles (a few contiguous bytes
    per row) and broadcast to the 16 dims of each group in registers: a gather of one
    scale per element issued 16 times the loads and made 4-bit decode several times
    slower than bf16 on the H200 (benchmarks/README.md, GPU)."""
    N: tl.constexpr = row_off.shape[0]
    BLOCK_DH: tl.constexpr = dims.shape[0]
    BLOCK_G: tl.constexpr = BLOCK_DH // 16
    mask = row_mask[:, None] & dim_mask[None, :]
    packed = tl.load(cache_ptr + row_off[:, None] + dims[None, :], mask=mask, other=0).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    gmask = row_mask[:, None] & (g < HALF // 16)[None, :]
    groups = group_scale_ptr + scale_row_off[:, None] + g[None, :]
    s_lo = tl.load(groups, mask=gmask, other=0.0).to(tl.float32)
    s_hi = tl.load(groups + HALF // 16, mask=gmask, other=0.0).to(tl.float32)
    s_lo = tl.reshape(tl.broadcast_to(s_lo[:, :, None], (N, BLOCK_G, 16)), (N, BLOCK_DH))
    s_hi = tl.reshape(tl.broadcast_to(s_hi[:, :, None], (N, BLOCK_G, 16)), (N, BLOCK_DH))
    lo = kv4_values(packed & 15, IS_INT4) * s_lo
    hi = kv4_values(packed >> 4, IS_INT4) * s_hi
    return lo, hi


@triton.jit
def _encode_half(  # type: ignore[no-untyped-def]
    y,
    ROWS: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT4: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
):
    """Codes ``[ROWS, BLOCK_DH]`` int32 and E4M3-exact group scales ``[ROWS, BLOCK_DH //
    16]`` fp32 of ``y`` (fp32, already divided by the tensor scale; masked lanes 0)."""
    y3 = tl.reshape(y, (ROWS, BLOCK_DH // 16, 16))
    s = tl.minimum(tl.math.div_rn(tl.max(tl.abs(y3), 2), QMAX), 448.0)  # E4M3 max
    if SOFT_ROUND:
        s = round_to_fp8_grid(s, 3, -6)
    else:
        s = s.to(tl.float8e4nv).to(tl.float32)
    s3 = s[:, :, None]
    positive = s3 > 0.0
    v = tl.where(positive, tl.math.div_rn(y3, tl.where(positive, s3, 1.0)), 0.0)
    v = tl.reshape(v, (ROWS, BLOCK_DH))
    if IS_INT4:
        v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
        r = (v + 12582912.0) - 12582912.0  # round half to even (1.5 * 2^23 trick)
        codes = r.to(tl.int32) + 8
    else:
        a = tl.abs(v)
        mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
        mag += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
        mag += (a > 5.0).to(tl.int32)
        codes = mag | ((v < 0.0).to(tl.int32) << 3)
    return codes, s


@triton.jit
def _store_kv4_kernel(  # type: ignore[no-untyped-def]
    # new K/V [T, H, D]; packed caches [NB, PAGE, H, HALF]; group scales [NB, PAGE, H, D/16]
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_gs_ptr,
    value_gs_ptr,
    slot_mapping_ptr,
    # fp32 tensor scales
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    # key strides: token, head; value strides: token, head (dim stride 1)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    # packed cache strides: block, slot in block, head; group scales: the same
    stride_cb,
    stride_cs,
    stride_ch,
    stride_gb,
    stride_gs,
    stride_gh,
    HALF: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT4: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
):
    # Tile [BLOCK_T tokens, one head, both halves of head_dim].
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_DH)
    dim_mask = dims < HALF
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1)
    row_mask = slots >= 0
    slots = tl.maximum(slots, 0)  # keep the (masked) addresses in range
    mask = row_mask[:, None] & dim_mask[None, :]
    dst = (slots // PAGE) * stride_cb + (slots % PAGE) * stride_cs + head * stride_ch
    gdst = (slots // PAGE) * stride_gb + (slots % PAGE) * stride_gs + head * stride_gh
    groups = tl.arange(0, BLOCK_DH // 16)
    gmask = row_mask[:, None] & (groups < HALF // 16)[None, :]
    for which in tl.static_range(2):
        if which == 0:
            src = key_ptr + tokens * stride_kt + head * stride_kh
            scale = tl.load(k_scale_ptr)
            cache_ptr = key_cache_ptr
            gs_ptr = key_gs_ptr
        else:
            src = value_ptr + tokens * stride_vt + head * stride_vh
            scale = tl.load(v_scale_ptr)
            cache_ptr = value_cache_ptr
            gs_ptr = value_gs_ptr
        lo = tl.load(src[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(src[:, None] + HALF + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        c_lo, s_lo = _encode_half(tl.math.div_rn(lo, scale), BLOCK_T, BLOCK_DH, QMAX, IS_INT4, SOFT_ROUND)
        c_hi, s_hi = _encode_half(tl.math.div_rn(hi, scale), BLOCK_T, BLOCK_DH, QMAX, IS_INT4, SOFT_ROUND)
        packed = (c_lo | (c_hi << 4)).to(tl.uint8)
        tl.store(cache_ptr + dst[:, None] + dims[None, :], packed, mask=mask)
        gs_dtype = gs_ptr.dtype.element_ty
        tl.store(gs_ptr + gdst[:, None] + groups[None, :], s_lo.to(gs_dtype), mask=gmask)
        tl.store(gs_ptr + gdst[:, None] + HALF // 16 + groups[None, :], s_hi.to(gs_dtype), mask=gmask)


def store_block_tokens(head_dim: int) -> int:
    """Tokens per store program on the GPU: about :data:`MAX_TILE` elements of K, and a
    power of two (``tl.arange``; head_dim 96 gave 42 and failed to compile)."""
    block_dh: int = triton.next_power_of_2(head_dim // 2)
    return max(1, MAX_TILE // (2 * block_dh))


def check_any_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_group_scales: torch.Tensor | None,
    value_group_scales: torch.Tensor | None,
    fmt_name: str | None,
) -> tuple[int, int, int, int]:
    """:func:`check_kv4_cache` when ``fmt_name`` names a 4-bit format, else
    :func:`check_cache_pair`; the same ``(num_blocks, block_size, num_kv_heads, head_dim)``.

    Raises:
        ValueError: as those two do.
    """
    if fmt_name is not None:
        return check_kv4_cache(key_cache, value_cache, key_group_scales, value_group_scales, fmt_name)
    return check_cache_pair(key_cache, value_cache)


def check_window_softcap(sliding_window: int | None, logit_softcap: float | None) -> tuple[int, float]:
    """The attention launchers' ``sliding_window`` / ``logit_softcap`` as the kernels'
    runtime arguments ``(window, softcap)``: 0 and 0.0 stand for "off" (the kernels then
    compile without that code, see ``HAS_WINDOW`` / ``HAS_SOFTCAP``).

    Raises:
        ValueError: a window below 1 token, or a soft-cap that is not a positive finite
            number.
    """
    window = 0
    if sliding_window is not None:
        window = int(sliding_window)
        check(window >= 1, f"sliding_window must be >= 1 token; got {sliding_window}")
    softcap = 0.0
    if logit_softcap is not None:
        softcap = float(logit_softcap)
        check(0.0 < softcap < float("inf"), f"logit_softcap must be positive and finite; got {logit_softcap}")
    return window, softcap


def check_kv4_cache(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_group_scales: torch.Tensor | None,
    value_group_scales: torch.Tensor | None,
    fmt_name: str,
) -> tuple[int, int, int, int]:
    """A 4-bit cache pair and its group scales fit together. Returns ``(num_blocks,
    block_size, num_kv_heads, head_dim)`` (the unpacked head_dim).

    Raises:
        ValueError: naming the tensor, what it is and what is allowed.
    """
    kv4_format(fmt_name)
    check(
        key_cache.dim() == 4 and key_cache.dtype == torch.uint8,
        f"a {fmt_name} key_cache must be uint8 [num_blocks, block_size, num_kv_heads, "
        f"head_dim // 2]; got {key_cache.dtype} {tuple(key_cache.shape)}",
    )
    check(
        value_cache.shape == key_cache.shape and value_cache.dtype == key_cache.dtype
        and value_cache.stride() == key_cache.stride(),
        f"value_cache {value_cache.dtype} {tuple(value_cache.shape)} {value_cache.stride()} must "
        f"match key_cache {key_cache.dtype} {tuple(key_cache.shape)} {key_cache.stride()}",
    )
    check(key_cache.stride(3) == 1, f"the cache's last axis must be contiguous; strides {key_cache.stride()}")
    nb, page, heads, half = key_cache.shape
    head_dim = 2 * half
    check_kv4_head_dim(head_dim, fmt_name)
    want = (nb, page, heads, head_dim // GROUP_SIZE)
    for name, gs in (("key_group_scales", key_group_scales), ("value_group_scales", value_group_scales)):
        check(gs is not None, f"{name} is required for a {fmt_name} cache")
        assert gs is not None
        check(
            tuple(gs.shape) == want and gs.dtype == GROUP_SCALE_DTYPE and gs.stride(3) == 1,
            f"{name} must be {GROUP_SCALE_DTYPE} {want} with a contiguous last axis; got "
            f"{gs.dtype} {tuple(gs.shape)} strides {gs.stride()}",
        )
    assert key_group_scales is not None and value_group_scales is not None
    check(
        key_group_scales.stride() == value_group_scales.stride(),
        "key_group_scales and value_group_scales strides differ",
    )
    return nb, page, heads, head_dim


def store_kv4(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    key_group_scales: torch.Tensor | None,
    value_group_scales: torch.Tensor | None,
    fmt_name: str,
) -> None:
    """Quantize ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to ``fmt_name``
    and write them (codes and group scales) at ``slot_mapping``. Mutates the two caches
    and the two group-scale tensors. Called by :func:`kvpilot.kernels.store_kv.store_kv`,
    which has checked ``key``/``value``/``slot_mapping``; the result equals
    :func:`kvpilot.kernels.reference.store_kv` bit for bit.

    Raises:
        ValueError: a cache, scale or group-scale tensor that does not fit.
    """
    _, page, num_heads, head_dim = check_kv4_cache(key_cache, value_cache, key_group_scales, value_group_scales, fmt_name)
    assert key_group_scales is not None and value_group_scales is not None
    check(
        tuple(key.shape[1:]) == (num_heads, head_dim),
        f"key {tuple(key.shape)} must be [num_tokens, {num_heads}, {head_dim}] for this {fmt_name} cache",
    )
    check_device(key, key_cache, value_cache, key_group_scales, value_group_scales)
    k_scale = check_scale("k_scale", k_scale, True, key_cache.device)
    v_scale = check_scale("v_scale", v_scale, True, key_cache.device)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_dh = triton.next_power_of_2(half)
    block_t = store_block_tokens(head_dim) if not INTERPRET else 32
    fmt = kv4_format(fmt_name)
    _store_kv4_kernel[(triton.cdiv(num_tokens, block_t), num_heads)](
        key,
        value,
        key_cache,
        value_cache,
        key_group_scales,
        value_group_scales,
        slot_mapping,
        k_scale,
        v_scale,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_group_scales.stride(0),
        key_group_scales.stride(1),
        key_group_scales.stride(2),
        HALF=half,
        BLOCK_DH=block_dh,
        PAGE=page,
        BLOCK_T=block_t,
        QMAX=fmt.qmax,
        IS_INT4=fmt.name == "int4",
        SOFT_ROUND=INTERPRET,
        num_warps=4,
    )
