"""Stage 1 of split-KV paged decode over a 4-bit cache (fp4_e2m1 / int4 codes with E4M3
group scales, :mod:`kvpilot.kernels.kv4`), dequantized in registers.

Same grid, splits and online softmax as :mod:`kvpilot.kernels.decode_attention` (whose
merge stage it shares), with head_dim handled as two halves because a packed byte holds
dim ``j`` (low nibble) and dim ``j + D/2`` (high nibble)::

    packed K tile [BLOCK_N, D/2] u8 --& 15--> k_lo * group scale --+
                                    \\--->> 4--> k_hi * group scale --+--> qk = q_lo k_lo^T
                                                                          + q_hi k_hi^T
    V likewise; acc_lo += p v_lo, acc_hi += p v_hi (fp32)

A sliding window starts the key range at the window's first key and a logit soft-cap
is applied to the scores before the mask, as in the plain kernel.

The per-layer tensor scales are exact outside the loop: ``k_scale`` in the softmax
scale, ``v_scale`` on the output. Codes times an E4M3 scale have at most 7 significant
bits, so the cast of the dequantized tile to bf16/fp16 for ``tl.dot`` is exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kv4_triton import load_kv4_tile, softcap_log2


@triton.jit
def decode_split_kv4_kernel(  # type: ignore[no-untyped-def]
    # q [S, Hq, D]; packed caches [NB, PAGE, Hkv, D/2]; group scales [NB, PAGE, Hkv, D/16]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_gs_ptr,
    v_gs_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    # fp32 tensor scales
    k_scale_ptr,
    v_scale_ptr,
    # out [S, Hq, D] written when DIRECT; else fp32 scratch mid_o [S, Hq, SPLITS, BLOCK_D]
    # and mid_lse [S, Hq, SPLITS] (log2 domain)
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    sm_scale,
    num_splits,
    min_tiles_per_split,
    # sliding window in tokens (read when HAS_WINDOW) and soft-cap (read when HAS_SOFTCAP)
    window,
    softcap,
    # q strides: seq, head (dim stride 1)
    stride_qs,
    stride_qh,
    # packed cache strides: block, token in block, head; group scales: the same
    stride_cb,
    stride_ct,
    stride_ch,
    stride_gb,
    stride_gt,
    stride_gh,
    # block table row stride
    stride_bt,
    # out strides: seq, head
    stride_os,
    stride_oh,
    # mid_o strides: seq, head (split stride BLOCK_D); mid_lse: seq, head (split stride 1)
    stride_ms,
    stride_mh,
    stride_ls,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_INT4: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The keys this query sees are [first, seq_len), shared out by the splits (see
    # decode_attention): nothing before a sliding window is loaded.
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    num_tiles = (seq_len - first + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = tl.maximum((num_tiles + num_splits - 1) // num_splits, min_tiles_per_split)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(seq_len, start + tiles_per_split * BLOCK_N)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_DH)
    dim_mask = dims < HALF
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :]
    q_lo = tl.load(q_rows, mask=q_mask, other=0.0).to(DOT_DTYPE)
    q_hi = tl.load(q_rows + HALF, mask=q_mask, other=0.0).to(DOT_DTYPE)
    if HAS_SOFTCAP:
        qk_scale = sm_scale / softcap * tl.load(k_scale_ptr)  # softcap_log2 brings log2(e)
    else:
        qk_scale = sm_scale * 1.4426950408889634 * tl.load(k_scale_ptr)  # softmax in base 2

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_lo = tl.zeros([BLOCK_H, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, BLOCK_DH], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table + pos // PAGE, mask=pos_mask, other=0).to(tl.int64)
        off = block * stride_cb + (pos % PAGE) * stride_ct + kv_head * stride_ch
        goff = block * stride_gb + (pos % PAGE) * stride_gt + kv_head * stride_gh
        k_lo, k_hi = load_kv4_tile(k_cache_ptr, k_gs_ptr, off, goff, pos_mask, dims, dim_mask, HALF, IS_INT4)
        qk = tl.dot(q_lo, tl.trans(k_lo.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        qk += tl.dot(q_hi, tl.trans(k_hi.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        qk = qk * qk_scale
        if HAS_SOFTCAP:
            qk = softcap_log2(qk, softcap)
        qk = tl.where(pos_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_lo, v_hi = load_kv4_tile(v_cache_ptr, v_gs_ptr, off, goff, pos_mask, dims, dim_mask, HALF, IS_INT4)
        p = p.to(DOT_DTYPE)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    has_tokens = l_i > 0.0  # false only for an empty split
    l_safe = tl.where(has_tokens, l_i, 1.0)
    o_lo = acc_lo / l_safe[:, None]
    o_hi = acc_hi / l_safe[:, None]
    if DIRECT:
        v_scale = tl.load(v_scale_ptr)
        dst = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, (o_lo * v_scale).to(out_ptr.dtype.element_ty), mask=q_mask)
        tl.store(dst + HALF, (o_hi * v_scale).to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        mid = mid_o_ptr + (seq * stride_ms + heads * stride_mh + split * BLOCK_D)[:, None] + dims[None, :]
        tl.store(mid, o_lo, mask=q_mask)
        tl.store(mid + HALF, o_hi, mask=q_mask)
        lse = tl.where(has_tokens, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=row_mask)


def kv4_launch_meta(head_dim: int) -> dict[str, int]:
    """Constexprs of the half-width tiles for ``head_dim``."""
    half = head_dim // 2
    return {"HALF": half, "BLOCK_DH": triton.next_power_of_2(half)}
