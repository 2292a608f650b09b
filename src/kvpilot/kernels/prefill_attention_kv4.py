"""Paged prefill/extend attention over a 4-bit cache (fp4_e2m1 / int4 codes with E4M3
group scales, :mod:`kvpilot.kernels.kv4`), dequantized in registers.

Same grid, row packing (``BLOCK_Q`` tokens x ``GROUP`` heads per tile), causal bounds and
launch order as :mod:`kvpilot.kernels.prefill_attention`; head_dim runs as two halves
(low nibbles = dims ``[0, D/2)``, high nibbles = ``[D/2, D)``), so ``q . k`` is two
half-width dots and the output two half-width accumulators. ``k_scale`` is folded into
the softmax scale and ``v_scale`` applied to the output; accumulators are fp32. A
sliding window and a logit soft-cap work as in the plain kernel (``HAS_WINDOW`` /
``HAS_SOFTCAP``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kv4_triton import load_kv4_tile, softcap_log2


@triton.jit
def _attend_tile_kv4(  # type: ignore[no-untyped-def]
    # running state of the tile's rows: q halves [M, DH], acc halves [M, DH], max and sum [M]
    q_lo,
    q_hi,
    acc_lo,
    acc_hi,
    m_i,
    l_i,
    # first key of this step, and each row's query position (causal bound)
    n0,
    q_pos,
    # packed caches, group scales, this sequence's block-table row, the KV head
    k_cache_ptr,
    v_cache_ptr,
    k_gs_ptr,
    v_gs_ptr,
    table,
    kv_head,
    qk_scale,
    seq_len,
    # sliding window in tokens (read when HAS_WINDOW), soft-cap (read when HAS_SOFTCAP)
    window,
    softcap,
    dims,
    dim_mask,
    # packed cache strides: block, token in block, head; group scales: the same
    stride_cb,
    stride_ct,
    stride_ch,
    stride_gb,
    stride_gt,
    stride_gh,
    HALF: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_INT4: tl.constexpr,
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
    off = block * stride_cb + (pos % PAGE) * stride_ct + kv_head * stride_ch
    goff = block * stride_gb + (pos % PAGE) * stride_gt + kv_head * stride_gh
    k_lo, k_hi = load_kv4_tile(k_cache_ptr, k_gs_ptr, off, goff, pos_mask, dims, dim_mask, HALF, IS_INT4)
    qk = tl.dot(q_lo, tl.trans(k_lo.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    qk += tl.dot(q_hi, tl.trans(k_hi.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    qk = qk * qk_scale
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
    v_lo, v_hi = load_kv4_tile(v_cache_ptr, v_gs_ptr, off, goff, pos_mask, dims, dim_mask, HALF, IS_INT4)
    p = p.to(DOT_DTYPE)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc_lo, acc_hi, m_new, l_i


@triton.jit
def prefill_kv4_kernel(  # type: ignore[no-untyped-def]
    # q and out [T, Hq, D]; packed caches [NB, PAGE, Hkv, D/2]; group scales [NB, PAGE, Hkv, D/16]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_gs_ptr,
    v_gs_ptr,
    out_ptr,
    # block_tables [S, W]; query_start_loc [S + 1]; seq_lens [S]
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    # fp32 tensor scales
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
    # packed cache strides: block, token in block, head; group scales: the same
    stride_cb,
    stride_ct,
    stride_ch,
    stride_gb,
    stride_gt,
    stride_gh,
    # block table row stride
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_INT4: tl.constexpr,
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
    dims = tl.arange(0, BLOCK_DH)
    dim_mask = dims < HALF
    mask = row_mask[:, None] & dim_mask[None, :]
    q_rows = q_ptr + (q_start + tok[:, None]) * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q_lo = tl.load(q_rows, mask=mask, other=0.0).to(DOT_DTYPE)
    q_hi = tl.load(q_rows + HALF, mask=mask, other=0.0).to(DOT_DTYPE)
    q_pos = ctx_len + tok
    if HAS_SOFTCAP:
        qk_scale = sm_scale / softcap * tl.load(k_scale_ptr)  # softcap_log2 brings log2(e)
    else:
        qk_scale = sm_scale * 1.4426950408889634 * tl.load(k_scale_ptr)  # softmax in base 2

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_DH], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    first_pos = ctx_len + tile * BLOCK_Q  # this tile's first query position
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    # Keys [0, unmasked_end) are visible to every row of the tile: no mask needed.
    unmasked_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    unmasked_start = 0
    if HAS_WINDOW:
        # As in prefill_attention: start at the first row's window, masked tiles until
        # every row's window has begun.
        lo = tl.maximum(first_pos - window + 1, 0)
        in_all = tl.maximum(last_pos - window + 1, lo)
        unmasked_start = lo + ((in_all - lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        for n0 in range(lo, unmasked_start, BLOCK_N):
            acc_lo, acc_hi, m_i, l_i = _attend_tile_kv4(
                q_lo, q_hi, acc_lo, acc_hi, m_i, l_i, n0, q_pos,
                k_cache_ptr, v_cache_ptr, k_gs_ptr, v_gs_ptr, table, kv_head, qk_scale, seq_len, window, softcap,
                dims, dim_mask, stride_cb, stride_ct, stride_ch, stride_gb, stride_gt, stride_gh,
                HALF, PAGE, BLOCK_N, True, IS_INT4, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
            )
        unmasked_end = unmasked_start + (tl.maximum(first_pos + 1 - unmasked_start, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(unmasked_start, unmasked_end, BLOCK_N):
        acc_lo, acc_hi, m_i, l_i = _attend_tile_kv4(
            q_lo, q_hi, acc_lo, acc_hi, m_i, l_i, n0, q_pos,
            k_cache_ptr, v_cache_ptr, k_gs_ptr, v_gs_ptr, table, kv_head, qk_scale, seq_len, window, softcap,
            dims, dim_mask, stride_cb, stride_ct, stride_ch, stride_gb, stride_gt, stride_gh,
            HALF, PAGE, BLOCK_N, False, IS_INT4, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
        )
    for n0 in range(unmasked_end, last_pos + 1, BLOCK_N):
        acc_lo, acc_hi, m_i, l_i = _attend_tile_kv4(
            q_lo, q_hi, acc_lo, acc_hi, m_i, l_i, n0, q_pos,
            k_cache_ptr, v_cache_ptr, k_gs_ptr, v_gs_ptr, table, kv_head, qk_scale, seq_len, window, softcap,
            dims, dim_mask, stride_cb, stride_ct, stride_ch, stride_gb, stride_gt, stride_gh,
            HALF, PAGE, BLOCK_N, True, IS_INT4, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_PRECISION,
        )
    # Every row saw its own key at least, so l_i > 0; with a window, padding rows past
    # the chunk may have seen none (never stored: only kept off 0 / 0).
    if HAS_WINDOW:
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    v_scale = tl.load(v_scale_ptr)
    dst = out_ptr + (q_start + tok[:, None]) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(dst, (acc_lo / l_i[:, None] * v_scale).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (acc_hi / l_i[:, None] * v_scale).to(out_ptr.dtype.element_ty), mask=mask)
