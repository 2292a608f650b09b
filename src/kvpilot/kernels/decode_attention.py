"""Paged decode attention: one query token per sequence over its whole paged context,
split along the context (flash-decoding) and merged by log-sum-exp.

Layout (see :mod:`kvpilot.kernels.reference`)::

    q                        [num_seqs, num_heads, head_dim]
    key_cache, value_cache   [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables             [num_seqs, max_blocks] int32
    seq_lens                 [num_seqs] int32 (>= 1), the query token included

Stage 1, grid ``(num_seqs, num_kv_heads, num_splits)``: a program takes the ``GROUP``
query heads that share one KV head as the rows of a ``[BLOCK_H, head_dim]`` tile, so
each K/V tile is read from memory once for the whole group (any group size: rows past
``GROUP`` are masked), and runs an online softmax over its split of the context in
tiles of ``BLOCK_N`` tokens gathered through the block table::

    context  |---- split 0 ----|---- split 1 ----|-- split 2 --|
    program  (seq, kv_head, 0)   (seq, kv_head, 1)  (seq, kv_head, 2)
    writes   o_0, lse_0          o_1, lse_1         o_2, lse_2      (fp32 scratch)

Stage 2, grid ``(num_seqs, num_heads)``: ``out = sum_s exp(lse_s - lse) * o_s`` with
``lse = log sum_s exp(lse_s)``. With one split, stage 1 writes the output directly.

Splits are sized per sequence (``tiles_per_split = max(ceil(tiles / num_splits),
min_tiles)``), so short sequences in a batch use fewer splits and the rest exit at once.
4-bit caches (fp4_e2m1 / int4 with E4M3 group scales) run their own stage 1
(:mod:`kvpilot.kernels.decode_attention_kv4`) and this merge.
FP8 and 4-bit caches: ``k_scale`` is folded into the softmax scale and ``v_scale`` multiplies the
output once; both are exact because attention is linear in K (inside the exponent) and
in V. Accumulators are fp32 throughout.

Sliding window ``W`` (``HAS_WINDOW``): the query at ``p = seq_len - 1`` sees keys
``[max(0, seq_len - W), seq_len)``; the splits share out that range only, so keys (and
whole blocks) before it are never loaded, and split 0 always holds a key. Logit
soft-cap ``c`` (``HAS_SOFTCAP``): scores ``s`` become ``c * tanh(s / c)`` before the
softmax. Both are compile-time switches; without them the kernels are unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention_kv4 import decode_split_kv4_kernel, kv4_launch_meta
from .kv4_triton import check_any_cache, check_window_softcap, softcap_log2
from .triton_utils import (
    FLOAT_DTYPES,
    check,
    check_device,
    check_scale,
    dot_dtype,
    dot_precision,
    is_fp8,
    num_sms,
)

# Split heuristic (see choose_num_splits).
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256
PROGRAMS_PER_SM = 4


@triton.jit
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    # q [S, Hq, D]; caches [NB, PAGE, Hkv, D]; block_tables [S, W]; seq_lens [S]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    # fp32 scalars, read only when QUANT
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
    # cache strides: block, token in block, head (dim stride 1)
    stride_cb,
    stride_ct,
    stride_ch,
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
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANT: tl.constexpr,
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
    # The keys this query sees are [first, seq_len); the splits share them out, so with a
    # window nothing before it is loaded (its blocks may be freed) and split 0 is never empty.
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
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    if HAS_SOFTCAP:
        qk_scale = sm_scale / softcap  # softcap_log2 brings the base-2 factor
    else:
        qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    if QUANT:
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table + pos // PAGE, mask=pos_mask, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % PAGE) * stride_ct + kv_head * stride_ch
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            qk = softcap_log2(qk, softcap)
        qk = tl.where(pos_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m_i = m_new

    has_tokens = l_i > 0.0  # false only for an empty split
    l_safe = tl.where(has_tokens, l_i, 1.0)
    o = acc / l_safe[:, None]
    store_mask = row_mask[:, None] & dim_mask[None, :]
    if DIRECT:
        if QUANT:
            o = o * tl.load(v_scale_ptr)
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        mid = seq * stride_ms + heads * stride_mh + split * BLOCK_D
        tl.store(mid_o_ptr + mid[:, None] + dims[None, :], o, mask=store_mask)
        lse = tl.where(has_tokens, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + seq * stride_ls + heads * stride_lh + split, lse, mask=row_mask)


@triton.jit
def _decode_merge_kernel(  # type: ignore[no-untyped-def]
    # scratch from stage 1, the output [S, Hq, D] and the fp32 v_scale (when QUANT)
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    v_scale_ptr,
    num_splits,
    # mid_o strides: seq, head; mid_lse strides: seq, head; out strides: seq, head
    stride_ms,
    stride_mh,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    base = seq * stride_ms + head * stride_mh
    lse_base = seq * stride_ls + head * stride_lh
    # Split 0 always holds tokens (seq_len >= 1), so the running max starts finite.
    m = tl.load(mid_lse_ptr + lse_base)
    denom = tl.full([BLOCK_D], 1.0, tl.float32)
    acc = tl.load(mid_o_ptr + base + dims, mask=dim_mask, other=0.0)
    for s in range(1, num_splits):
        lse = tl.load(mid_lse_ptr + lse_base + s)
        o = tl.load(mid_o_ptr + base + s * BLOCK_D + dims, mask=dim_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)  # 0 for an empty split (lse = -inf)
        acc = acc * alpha + w * o
        denom = denom * alpha + w
        m = m_new
    out = acc / denom
    if QUANT:
        out = out * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    sms: int,
    block_n: int,
    min_split_tokens: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """Splits along the context so the launch fills the GPU.

    Stage 1 has ``num_seqs * num_kv_heads`` programs per split; aim for about
    ``PROGRAMS_PER_SM`` per SM (memory-bound work needs several resident programs per SM
    to hide latency), without splits shorter than ``min_split_tokens`` tokens (the
    merge and the scratch traffic would cost more than they hide) and at most
    ``MAX_SPLITS``. A full batch (64 sequences x 8 KV heads on 132 SMs) gets 2 splits;
    one long sequence gets up to 64.
    """
    programs = max(1, num_seqs * num_kv_heads)
    want: int = triton.cdiv(sms * PROGRAMS_PER_SM, programs)
    longest: int = triton.cdiv(max(1, max_seq_len), max(min_split_tokens, block_n))
    return max(1, min(want, longest, MAX_SPLITS))


# Tokens per tile by cache kind, for head_dim <= 128 (halved above). Chosen from the
# H200 sweep of benchmarks/gpu_check.py (section decode_tune, 2026-12-04; Llama-3-8B
# attention, 64 x 4,096 and 1 x 32,768, all in benchmarks/README.md): 8-bit tiles of 64
# tokens left the loads too short to hide latency (128: 1 x 32,768 went from 109 to
# 71 us); 4-bit tiles are bound by the in-register decode, and 32 tokens keep more
# programs resident (int4 at 1 x 32,768: 272 -> 118 us; fp4 at 64 x 4,096: 790 -> 730).
BLOCK_N_BY_CACHE = {"model": 64, "fp8": 128, "kv4": 32}


def default_config(head_dim: int, group: int, dtype: torch.dtype, cache: str = "model") -> dict[str, int]:
    """Tile sizes and launch settings.

    Args:
        head_dim: the (unpacked) head size.
        group: query heads per KV head.
        dtype: the query dtype (unused: the settings did not depend on it on the H200).
        cache: ``"model"`` (the cache holds q's dtype), ``"fp8"`` or ``"kv4"``.
    Raises:
        KeyError: an unknown ``cache``.
    """
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16
    block_n = BLOCK_N_BY_CACHE[cache]
    return {
        "BLOCK_N": block_n if head_dim <= 128 else max(16, block_n // 2),
        "BLOCK_H": block_h,
        "MIN_SPLIT_TOKENS": MIN_TOKENS_PER_SPLIT,
        "num_warps": 4,
        "num_stages": 2,
    }


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    key_group_scales: torch.Tensor | None = None,
    value_group_scales: torch.Tensor | None = None,
    kv4_format: str | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` fp32/fp16/bf16, unit stride on dim.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any
            float dtype or FP8 (then ``k_scale``/``v_scale`` are required).
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32, each >= 1.
        scale: softmax scale.
        max_seq_len: the longest ``seq_lens`` entry, known on the host (avoids a device
            sync); chooses the number of splits. Read from ``seq_lens`` when None.
        num_splits: force the number of splits (benchmarks, tests).
        out: ``[num_seqs, num_heads, head_dim]`` to write into (q's dtype).
        config: override of :func:`default_config` keys.
        key_group_scales, value_group_scales, kv4_format: a 4-bit cache (uint8 codes
            ``[..., head_dim // 2]``, E4M3 group scales ``[..., head_dim // 16]``,
            ``fp4_e2m1`` or ``int4``), dequantized in registers
            (:mod:`kvpilot.kernels.decode_attention_kv4`); ``k_scale``/``v_scale`` required.
        sliding_window: W tokens, or None for the whole context. The query of a
            sequence sits at position ``p = seq_len - 1`` and sees the keys ``j`` with
            ``p - W < j <= p`` (the last W tokens, itself included). Keys before the
            window are never read, so block-table entries wholly before it may point
            anywhere (a freed or null block); the splits share out the window only.
        logit_softcap: c, or None for none: each score ``s = scale * q.k`` (``k_scale``
            included) becomes ``c * tanh(s / c)`` before the softmax.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
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
        f"q must be [num_seqs, num_heads, {head_dim}]; got {tuple(q.shape)}",
    )
    num_seqs, num_heads, _ = q.shape
    check(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} must be float32/float16/bfloat16")
    check(q.stride(2) == 1, "q must have a contiguous head_dim axis")
    check(
        num_heads % num_kv_heads == 0,
        f"num_heads ({num_heads}) must be a multiple of the cache's num_kv_heads ({num_kv_heads})",
    )
    check(
        block_tables.dim() == 2
        and block_tables.shape[0] == num_seqs
        and block_tables.dtype == torch.int32,
        f"block_tables must be int32 [{num_seqs}, max_blocks]; got {block_tables.dtype} {tuple(block_tables.shape)}",
    )
    check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    check(
        seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32,
        f"seq_lens must be int32 [{num_seqs}]; got {seq_lens.dtype} {tuple(seq_lens.shape)}",
    )
    check_device(q, key_cache, value_cache, block_tables, seq_lens)
    quant = kv4 or is_fp8(key_cache.dtype)
    k_scale = check_scale("k_scale", k_scale, quant, q.device)
    v_scale = check_scale("v_scale", v_scale, quant, q.device)
    if out is None:
        out = torch.empty_like(q)
    check(
        out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out must be like q"
    )
    if num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    cfg = default_config(head_dim, group, q.dtype, "kv4" if kv4 else "fp8" if is_fp8(key_cache.dtype) else "model")
    cfg.update(config or {})
    block_n, block_d = cfg["BLOCK_N"], triton.next_power_of_2(head_dim)
    check(
        cfg["BLOCK_H"] >= group,
        f"BLOCK_H {cfg['BLOCK_H']} must cover the group of {group} query heads",
    )
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    check(
        max_seq_len <= block_tables.shape[1] * page,
        f"max_seq_len {max_seq_len} exceeds the block table ({block_tables.shape[1]} blocks of {page})",
    )
    min_split_tokens = cfg["MIN_SPLIT_TOKENS"]
    if num_splits is None:
        # With a window only its last W keys are read: split by that many.
        attended = min(max_seq_len, window) if window else max_seq_len
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, attended, num_sms(q.device), block_n, min_split_tokens
        )
    check(num_splits >= 1, f"num_splits must be >= 1; got {num_splits}")
    # Per-sequence split length: never below this many tiles (short sequences split less).
    min_tiles = triton.cdiv(min_split_tokens, block_n)
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
        stride_ms = stride_mh = stride_ls = stride_lh = 0
    else:
        mid_o = torch.empty(
            (num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
        stride_ms, stride_mh = mid_o.stride(0), mid_o.stride(1)
        stride_ls, stride_lh = mid_lse.stride(0), mid_lse.stride(1)
    dummy = q  # stands in for absent scale pointers
    grid = (num_seqs, num_kv_heads, num_splits)
    if kv4:
        assert key_group_scales is not None and value_group_scales is not None
        decode_split_kv4_kernel[grid](
            q, key_cache, value_cache, key_group_scales, value_group_scales, block_tables, seq_lens,
            k_scale, v_scale, out, mid_o, mid_lse, scale, num_splits, min_tiles, window, softcap,
            q.stride(0), q.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            key_group_scales.stride(0), key_group_scales.stride(1), key_group_scales.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            stride_ms, stride_mh, stride_ls, stride_lh,
            GROUP=group,
            BLOCK_H=cfg["BLOCK_H"],
            BLOCK_D=block_d,
            PAGE=page,
            BLOCK_N=block_n,
            IS_INT4=kv4_format == "int4",
            DIRECT=direct,
            HAS_WINDOW=bool(window),
            HAS_SOFTCAP=bool(softcap),
            DOT_DTYPE=dot_dtype(q.dtype),
            DOT_PRECISION=dot_precision(q.dtype),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **kv4_launch_meta(head_dim),
        )
    else:
        _decode_split_kernel[grid](
            q,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            k_scale if quant else dummy,
            v_scale if quant else dummy,
            out,
            mid_o,
            mid_lse,
            scale,
            num_splits,
            min_tiles,
            window,
            softcap,
            q.stride(0),
            q.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            stride_ms,
            stride_mh,
            stride_ls,
            stride_lh,
            GROUP=group,
            BLOCK_H=cfg["BLOCK_H"],
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            PAGE=page,
            BLOCK_N=block_n,
            QUANT=quant,
            DIRECT=direct,
            HAS_WINDOW=bool(window),
            HAS_SOFTCAP=bool(softcap),
            DOT_DTYPE=dot_dtype(q.dtype),
            DOT_PRECISION=dot_precision(q.dtype),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            mid_o,
            mid_lse,
            out,
            v_scale if quant else dummy,
            num_splits,
            stride_ms,
            stride_mh,
            stride_ls,
            stride_lh,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            QUANT=quant,
            num_warps=1 if block_d <= 64 else 2,
        )
    return out
