"""Paged prefill/extend attention over a varlen batch: each sequence's new tokens attend
to its cached prefix and to themselves causally, all read from the paged cache.

Layout (see :mod:`kvpilot.kernels.reference`)::

    q                        [num_tokens, num_heads, head_dim]   packed varlen queries
    query_start_loc          [num_seqs + 1] int32                sequence i owns
                                                                 q[qsl[i]:qsl[i+1]]
    seq_lens                 [num_seqs] int32                    context after this step
    key_cache, value_cache   [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables             [num_seqs, max_blocks] int32

The engine writes the step's K/V into the cache before attention, so the new tokens'
K/V are read from pages like the prefix: a chunked prefill or a prefix hit needs no copy,
and an FP8 cache gives the new tokens exactly the values later steps will read.

Grid ``(query tiles, num_seqs, num_kv_heads)``. A program's ``BLOCK_M`` rows are
``BLOCK_Q = BLOCK_M // GROUP`` query tokens times the ``GROUP`` query heads of one KV
head (row ``m`` = token ``m // GROUP``, head ``m % GROUP``; any group size), so each
K/V tile serves the whole group::

    keys      0 ............................ ctx_len ........... seq_len
    tile t    |====== no mask ======|== causal mask ==|
              [0, first query pos]   up to the tile's last query position

Query token ``i`` of a chunk sits at position ``ctx_len + i`` (``ctx_len = seq_len -
q_len``) and sees keys ``<= ctx_len + i``. Tiles are launched last-first so the longest
(causal) programs start early. FP8: ``k_scale`` folded into the softmax scale,
``v_scale`` on the output, fp32 accumulators. 4-bit caches run
:mod:`kvpilot.kernels.prefill_attention_kv4` (same grid, head_dim in two halves).

Sliding window ``W`` (``HAS_WINDOW``): query ``p`` sees keys ``p - W < j <= p``. A tile
with queries at ``[first_pos, last_pos]`` starts its key loop at ``first_pos - W + 1``
(nothing before it is loaded, so blocks wholly behind the window may be freed)::

    keys   lo ......... lo + ~BLOCK_Q ........... first_pos ........ last_pos
           |== window + causal mask ==|== no mask ==|== causal + window mask ==|

Logit soft-cap ``c`` (``HAS_SOFTCAP``): scores ``s`` become ``c * tanh(s / c)`` before
the masks. Both are compile-time switches; without them the kernel is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv4_triton import check_any_cache, check_window_softcap, softcap_log2
from .prefill_attention_kv4 import prefill_kv4_kernel
from .triton_utils import (
    FLOAT_DTYPES,
    INTERPRET,
    check,
    check_device,
    check_scale,
    dot_dtype,
    dot_precision,
    is_fp8,
)


@triton.jit
def _attend_tile(  # type: ignore[no-untyped-def]
    # running state of the tile's rows: q [M, D], acc [M, D], max and sum [M]
    q,
    acc,
    m_i,
    l_i,
    # first key of this step, and each row's query position (causal bound)
    n0,
    q_pos,
    # the caches, this sequence's block-table row, the KV head
    k_cache_ptr,
    v_cache_ptr,
    table,
    kv_head,
    qk_scale,
    seq_len,
    # sliding window in tokens (read when HAS_WINDOW), soft-cap (read when HAS_SOFTCAP)
    window,
    softcap,
    dims,
    dim_mask,
    # cache strides: block, token in block, head
    stride_cb,
    stride_ct,
    stride_ch,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys ``[n0, n0 + BLOCK_N)``. ``CAUSAL``: mask each
    row's keys after its position and, with ``HAS_WINDOW``, those before its window."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pos_mask = pos < seq_len
    block = tl.load(table + pos // PAGE, mask=pos_mask, other=0).to(tl.int64)
    kv_off = block * stride_cb + (pos % PAGE) * stride_ct + kv_head * stride_ch
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
    if HAS_SOFTCAP:
        qk = softcap_log2(qk, softcap)
    if CAUSAL:
        visible = pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if CAUSAL and HAS_WINDOW:
        # A row may have seen no key yet (all before its window): keep it at 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(
        p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
    )
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(  # type: ignore[no-untyped-def]
    # q and out [T, Hq, D]; caches [NB, PAGE, Hkv, D]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    # block_tables [S, W]; query_start_loc [S + 1]; seq_lens [S]
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    # fp32 scalars, read only when QUANT
    k_scale_ptr,
    v_scale_ptr,
    sm_scale,
    num_q_tiles,
    # sliding window in tokens (read when HAS_WINDOW) and soft-cap (read when HAS_SOFTCAP)
    window,
    softcap,
    # q strides: token, head; out strides: token, head (dim stride 1)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    # cache strides: block, token in block, head (dim stride 1)
    stride_cb,
    stride_ct,
    stride_ch,
    # block table row stride
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = num_q_tiles - 1 - tl.program_id(0)  # longest (last) tiles first
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + tok[:, None]) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = ctx_len + tok
    if HAS_SOFTCAP:
        qk_scale = sm_scale / softcap  # softcap_log2 brings the base-2 factor
    else:
        qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    if QUANT:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    first_pos = ctx_len + tile * BLOCK_Q  # this tile's first query position
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    # Keys [0, unmasked_end) are visible to every row of the tile: no mask needed.
    unmasked_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    unmasked_start = 0
    if HAS_WINDOW:
        # The tile's keys start at lo, the first key in the window of its first row
        # (nothing before it is loaded: those blocks may be freed). Keys before
        # last_pos - window + 1 are outside some row's window: masked tiles up to there.
        lo = tl.maximum(first_pos - window + 1, 0)
        in_all = tl.maximum(last_pos - window + 1, lo)
        unmasked_start = lo + ((in_all - lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        for n0 in range(lo, unmasked_start, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, n0, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, qk_scale, seq_len,
                window, softcap, dims, dim_mask, stride_cb, stride_ct, stride_ch,
                PAGE, BLOCK_N, True, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
            )
        unmasked_end = unmasked_start + (tl.maximum(first_pos + 1 - unmasked_start, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(unmasked_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, qk_scale, seq_len,
            window, softcap, dims, dim_mask, stride_cb, stride_ct, stride_ch,
            PAGE, BLOCK_N, False, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
        )
    for n0 in range(unmasked_end, last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, n0, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, qk_scale, seq_len,
            window, softcap, dims, dim_mask, stride_cb, stride_ct, stride_ch,
            PAGE, BLOCK_N, True, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
        )
    # Every row saw its own key at least, so l_i > 0; with a window, padding rows past
    # the chunk may have seen none (never stored: only kept off 0 / 0).
    if HAS_WINDOW:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    if QUANT:
        out = out * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + (q_start + tok[:, None]) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def default_config(head_dim: int, group: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch settings (tuned on the H200 by benchmarks/gpu_check.py).
    Under the interpreter, few large programs: its cost is per program and operation,
    not per element (tests pass small tiles explicitly to cover the tile loops)."""
    if INTERPRET:
        return {
            "BLOCK_M": max(64, triton.next_power_of_2(group)),
            "BLOCK_N": 32,
            "num_warps": 4,
            "num_stages": 1,
        }
    block_m = 128 if head_dim <= 128 else 64
    return {
        "BLOCK_M": max(block_m, triton.next_power_of_2(group)),
        "BLOCK_N": 64,
        "num_warps": 8 if head_dim >= 128 else 4,
        "num_stages": 3 if head_dim <= 128 else 2,
    }


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    key_group_scales: torch.Tensor | None = None,
    value_group_scales: torch.Tensor | None = None,
    kv4_format: str | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their paged contexts.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` fp32/fp16/bf16, unit stride on dim.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any
            float dtype or FP8 (then ``k_scale``/``v_scale`` are required); they already
            hold this step's K/V.
        block_tables: ``[num_seqs, max_blocks]`` int32.
        query_start_loc: ``[num_seqs + 1]`` int32 cumulative query counts (may start
            above 0: a batch's decodes can be left out of ``q``'s first rows).
        seq_lens: ``[num_seqs]`` int32 context lengths, each >= its query count.
        max_query_len: the longest query count, known on the host (sizes the grid
            without a device sync); read from ``query_start_loc`` when None.
        out: ``[num_tokens, num_heads, head_dim]`` to write into (only rows owned by a
            sequence are written).
        config: override of :func:`default_config` keys.
        key_group_scales, value_group_scales, kv4_format: a 4-bit cache (uint8 codes
            ``[..., head_dim // 2]``, E4M3 group scales ``[..., head_dim // 16]``,
            ``fp4_e2m1`` or ``int4``), dequantized in registers
            (:mod:`kvpilot.kernels.prefill_attention_kv4`); ``k_scale``/``v_scale`` required.
        sliding_window: W tokens, or None for full causal attention. A query at
            position ``p`` sees the keys ``j`` with ``p - W < j <= p``. A query tile
            starts reading at the first key of its earliest query's window, so
            block-table entries wholly before the window of a sequence's first new
            token are never read (they may point at a freed or null block).
        logit_softcap: c, or None for none: each score ``s = scale * q.k`` (``k_scale``
            included) becomes ``c * tanh(s / c)`` before the mask and the softmax.
    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    Raises:
        ValueError: shapes, dtypes, strides or devices that do not fit; a window below
            1 or a soft-cap that is not positive and finite.
    """
    window, softcap = check_window_softcap(sliding_window, logit_softcap)
    kv4 = kv4_format is not None
    _, page, num_kv_heads, head_dim = check_any_cache(
        key_cache, value_cache, key_group_scales, value_group_scales, kv4_format
    )
    check(
        q.dim() == 3 and q.shape[2] == head_dim,
        f"q must be [num_tokens, num_heads, {head_dim}]; got {tuple(q.shape)}",
    )
    num_heads = q.shape[1]
    check(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} must be float32/float16/bfloat16")
    check(q.stride(2) == 1, "q must have a contiguous head_dim axis")
    check(
        num_heads % num_kv_heads == 0,
        f"num_heads ({num_heads}) must be a multiple of the cache's num_kv_heads ({num_kv_heads})",
    )
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check(
        seq_lens.dim() == 1 and seq_lens.dtype == torch.int32,
        f"seq_lens must be int32 [num_seqs]; got {seq_lens.dtype} {tuple(seq_lens.shape)}",
    )
    check(
        query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32,
        f"query_start_loc must be int32 [{num_seqs + 1}]; got {query_start_loc.dtype} {tuple(query_start_loc.shape)}",
    )
    check(
        block_tables.dim() == 2
        and block_tables.shape[0] == num_seqs
        and block_tables.dtype == torch.int32,
        f"block_tables must be int32 [{num_seqs}, max_blocks]; got {block_tables.dtype} {tuple(block_tables.shape)}",
    )
    check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    check_device(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    quant = kv4 or is_fp8(key_cache.dtype)
    k_scale = check_scale("k_scale", k_scale, quant, q.device)
    v_scale = check_scale("v_scale", v_scale, quant, q.device)
    if out is None:
        out = torch.empty_like(q)
    check(
        out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out must be like q"
    )
    if num_seqs == 0 or q.shape[0] == 0:
        return out

    group = num_heads // num_kv_heads
    cfg = default_config(head_dim, group, q.dtype)
    cfg.update(config or {})
    block_m = cfg["BLOCK_M"]
    check(block_m >= group, f"BLOCK_M {block_m} must hold at least one token's {group} query heads")
    block_q = block_m // group
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    dummy = q  # stands in for absent scale pointers
    grid = (num_q_tiles, num_seqs, num_kv_heads)
    if kv4:
        assert key_group_scales is not None and value_group_scales is not None
        prefill_kv4_kernel[grid](
            q, key_cache, value_cache, key_group_scales, value_group_scales, out,
            block_tables, query_start_loc, seq_lens, k_scale, v_scale, scale, num_q_tiles, window, softcap,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            key_group_scales.stride(0), key_group_scales.stride(1), key_group_scales.stride(2),
            block_tables.stride(0),
            GROUP=group,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            HALF=head_dim // 2,
            BLOCK_DH=triton.next_power_of_2(head_dim // 2),
            PAGE=page,
            BLOCK_N=cfg["BLOCK_N"],
            IS_INT4=kv4_format == "int4",
            HAS_WINDOW=bool(window),
            HAS_SOFTCAP=bool(softcap),
            DOT_DTYPE=dot_dtype(q.dtype),
            DOT_PRECISION=dot_precision(q.dtype),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        return out
    _prefill_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        k_scale if quant else dummy,
        v_scale if quant else dummy,
        scale,
        num_q_tiles,
        window,
        softcap,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=page,
        BLOCK_N=cfg["BLOCK_N"],
        QUANT=quant,
        HAS_WINDOW=bool(window),
        HAS_SOFTCAP=bool(softcap),
        DOT_DTYPE=dot_dtype(q.dtype),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
