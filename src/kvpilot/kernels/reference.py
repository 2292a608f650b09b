"""Torch reference implementations of the paged-KV operations.

These are the test oracle for the Triton kernels and the engine's ``torch`` attention
backend (CPU and CUDA). Layouts, shared by every backend::

    key_cache, value_cache   [num_blocks, block_size, num_kv_heads, head_dim]
    flat slot                block_id * block_size + offset_in_block
    q                        [num_tokens, num_heads, head_dim]   (varlen, packed)
    query_start_loc          [num_seqs + 1] int32, cumulative query lengths
    seq_lens                 [num_seqs] int32, tokens in the cache per sequence
                             *including* this step's (its queries are the last ones)
    block_tables             [num_seqs, max_blocks_per_seq] int32 (padding is ignored)

Quantized caches (FP8) hold ``x / scale`` clamped to the format's finite range; reads
multiply by the per-layer scale. 4-bit caches (``kv4_format`` = ``fp4_e2m1`` or ``int4``,
see :mod:`kvpilot.kernels.kv4`) are uint8 ``[num_blocks, block_size, num_kv_heads,
head_dim // 2]`` with E4M3 group scales ``[num_blocks, block_size, num_kv_heads,
head_dim // 16]`` (``key_group_scales`` / ``value_group_scales``) under the per-layer
``k_scale`` / ``v_scale``. Accumulation is always in the query dtype or wider.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fast_dequant import FP8_HALF_FACTOR, dequantize_kv4_fast, fp8_as_half, gather_blocks
from .kv4 import KV4Args, quantize_kv4
from .kv4 import kv4_format as _kv4_format

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def _raw(x: torch.Tensor) -> torch.Tensor:
    """Byte view of an FP8 tensor (CPU indexing kernels do not cover FP8 dtypes)."""
    return x.view(torch.uint8) if is_quantized(x.dtype) else x


def _take(cache_flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache_flat[index]`` for any cache dtype."""
    return _raw(cache_flat)[index].view(cache_flat.dtype)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cast ``x`` to the cache dtype; for FP8 divide by ``scale`` and clamp to the finite
    range first (casting above the max gives NaN, not saturation)."""
    if not is_quantized(cache_dtype):
        return x.to(cache_dtype)
    finfo = torch.finfo(cache_dtype)
    y = x.float() / scale if scale is not None else x.float()
    return y.clamp_(finfo.min, finfo.max).to(cache_dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`quantize` (up to rounding): cast to ``dtype`` and rescale."""
    if not is_quantized(x.dtype):
        return x.to(dtype)
    y = x.to(torch.float32)
    if scale is not None:
        y = y * scale
    return y.to(dtype)


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
    """Write each token's K/V into its slot. Mutates ``key_cache`` and ``value_cache``
    (and the group scales of a 4-bit cache).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64; a negative slot skips that token.
        k_scale, v_scale: fp32 scalars for quantized caches (ignored otherwise).
        key_group_scales, value_group_scales, kv4_format: a 4-bit cache's E4M3 group
            scales and its format (see the module docstring).
    """
    num_blocks, block_size, h, d = key_cache.shape
    if kv4_format is not None:
        d *= 2
    if key.shape[1:] != (h, d) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match cache heads {h}x{d}")
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if kv4_format is not None:
        assert key_group_scales is not None and value_group_scales is not None
        fmt = _kv4_format(kv4_format)
        for x, cache, groups, scale in ((key, key_cache, key_group_scales, k_scale),
                                        (value, value_cache, value_group_scales, v_scale)):
            packed, gs = quantize_kv4(x, fmt, scale if scale is not None else 1.0)
            cache.view(num_blocks * block_size, h, d // 2).index_copy_(0, slot_mapping, packed)
            _raw(groups).view(num_blocks * block_size, h, -1).index_copy_(0, slot_mapping, _raw(gs))
        return
    kf = key_cache.view(num_blocks * block_size, h, d)
    vf = value_cache.view(num_blocks * block_size, h, d)
    _raw(kf).index_copy_(0, slot_mapping, _raw(quantize(key, key_cache.dtype, k_scale)))
    _raw(vf).index_copy_(0, slot_mapping, _raw(quantize(value, value_cache.dtype, v_scale)))


def read_blocks_unscaled(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    group_scales: torch.Tensor | None = None,
    fmt: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Blocks ``cache[blocks]`` as ``(x, factor)``: ``x`` is ``[*blocks.shape,
    block_size, num_kv_heads, head_dim]`` in ``dtype`` and the stored values are ``x *
    factor`` (``factor`` a 0-d fp32 tensor, or None for 1). An FP8 cache leaves its
    scale in ``factor`` so attention can fold it into the query or the output instead
    of a pass over the pages; a 4-bit cache applies it with its group scales. The FP8
    and 4-bit conversions are :mod:`kvpilot.kernels.fast_dequant`'s (exact)."""
    if fmt is not None:
        assert group_scales is not None, "a 4-bit cache needs its group scales"
        return dequantize_kv4_fast(gather_blocks(cache, blocks), gather_blocks(group_scales, blocks), fmt, scale,
                                   dtype), None
    if not is_quantized(cache.dtype):
        return gather_blocks(cache, blocks).to(dtype), None
    half = fp8_as_half(_raw(gather_blocks(cache, blocks)), cache.dtype)
    factor = torch.tensor(FP8_HALF_FACTOR[cache.dtype], dtype=torch.float32, device=cache.device)
    return half.to(dtype), factor if scale is None else factor * scale


def read_blocks(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    group_scales: torch.Tensor | None = None,
    fmt: str | None = None,
) -> torch.Tensor:
    """Blocks ``cache[blocks]`` dequantized to ``dtype``: ``[*blocks.shape, block_size,
    num_kv_heads, head_dim]``."""
    x, factor = read_blocks_unscaled(cache, blocks, dtype, scale, group_scales, fmt)
    return _times(x, factor)


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    group_scales: torch.Tensor | None = None,
    fmt: str | None = None,
) -> torch.Tensor:
    """The first ``length`` tokens of one sequence, ``[length, num_kv_heads, head_dim]``."""
    x, factor = gather_kv_unscaled(cache, block_table, length, dtype, scale, group_scales, fmt)
    return _times(x, factor)


def gather_kv_unscaled(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    dtype: torch.dtype,
    scale: torch.Tensor | None,
    group_scales: torch.Tensor | None = None,
    fmt: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`gather_kv` as ``(x, factor)`` (see :func:`read_blocks_unscaled`)."""
    block_size = cache.shape[1]
    nb = -(-length // block_size)
    x, factor = read_blocks_unscaled(cache, block_table[:nb].long(), dtype, scale, group_scales, fmt)
    return x.flatten(0, 1)[:length], factor


def _times(x: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """``x * factor`` in ``x``'s dtype (computed in fp32); ``x`` itself when ``factor`` is None."""
    return x if factor is None else (x.float() * factor).to(x.dtype)


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
    key_group_scales: torch.Tensor | None = None,
    value_group_scales: torch.Tensor | None = None,
    kv4_format: str | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole paged context.

    Whole blocks are gathered (a block is one contiguous copy) up to the longest
    sequence, and the query heads that share a KV head are folded into the query-length
    axis (``[S, Hkv, group, D]``), so K/V are never repeated per query head.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` context lengths (>= 1) including the query token.
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_len = int(seq_lens.max())
    nb = -(-max_len // block_size)
    blocks = block_tables[:, :nb].long()
    length = nb * block_size
    k, k_factor = read_blocks_unscaled(key_cache, blocks, q.dtype, k_scale, key_group_scales, kv4_format)
    v, v_factor = read_blocks_unscaled(value_cache, blocks, q.dtype, v_scale, value_group_scales, kv4_format)
    q = _times(q, k_factor)  # (q s) . k = q . (s k): the K scale folded into the query
    k = k.view(num_seqs, length, num_kv_heads, head_dim)
    v = v.view(num_seqs, length, num_kv_heads, head_dim)
    mask = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale
    )
    return _times(out.reshape(num_seqs, num_heads, head_dim), v_factor)  # and the V scale on the output


def _length_buckets(lens: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Group sequence indices by length so padding to a bucket's longest wastes at most
    ``max_waste`` of it (a decode batch of mixed lengths would otherwise gather and
    attend over the longest context for every sequence)."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and lens[i] >= (1 - max_waste) * lens[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    key_group_scales: torch.Tensor | None = None,
    value_group_scales: torch.Tensor | None = None,
    kv4_format: str | None = None,
) -> torch.Tensor:
    """A chunk of new tokens of one sequence: each attends to the cached prefix (no
    mask) and to the chunk causally.

    Args:
        q: ``[chunk_len, num_heads, head_dim]``; its tokens sit at positions
            ``seq_len - chunk_len .. seq_len - 1``.
        block_table: ``[>= ceil(seq_len / block_size)]`` block ids.
    Returns:
        ``[chunk_len, num_heads, head_dim]``.
    """
    chunk, num_heads, _ = q.shape
    num_kv_heads = key_cache.shape[2]
    k, k_factor = gather_kv_unscaled(key_cache, block_table, seq_len, q.dtype, k_scale, key_group_scales, kv4_format)
    v, v_factor = gather_kv_unscaled(value_cache, block_table, seq_len, q.dtype, v_scale, value_group_scales,
                                     kv4_format)
    q = _times(q, k_factor)
    if chunk == seq_len:
        return _times(causal_attention(q, k, v, scale), v_factor)
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, H, chunk, D]
    q_pos = torch.arange(seq_len - chunk, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
    return _times(out[0].transpose(0, 1), v_factor)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of one sequence's whole context (PyTorch's fused SDPA; GQA
    without repeating K/V).

    Args:
        q: ``[n, num_heads, head_dim]``; k, v: ``[n, num_kv_heads, head_dim]``.
    Returns:
        ``[n, num_heads, head_dim]``.
    """
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def paged_attention(
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
    key_group_scales: torch.Tensor | None = None,
    value_group_scales: torch.Tensor | None = None,
    kv4_format: str | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Varlen paged attention over a mixed batch of decodes and prefill chunks.

    ``sliding_window`` W: a query at position ``p`` sees keys ``j`` with
    ``p - W < j <= p`` (HF transformers' mask ``kv_idx > q_idx - sliding_window``);
    ``logit_softcap`` c: scores ``s = scale * q.k`` become ``c * tanh(s / c)`` before the
    mask and softmax (Gemma 2's ``attn_logit_softcapping``). Either one routes every
    sequence through :func:`masked_paged_attention` (explicit fp32 scores).

    Sequence ``i`` owns queries ``q[query_start_loc[i]:query_start_loc[i+1]]``, the last
    tokens of its ``seq_lens[i]``-token context. Single-token sequences are batched
    through :func:`paged_decode_attention` (in buckets of similar length); longer ones
    go one by one through :func:`paged_prefill_attention`.
    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    kv4 = KV4Args(key_group_scales=key_group_scales, value_group_scales=value_group_scales, kv4_format=kv4_format)
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if sliding_window is not None or logit_softcap is not None:
        for i in range(len(lens)):
            s, e = qsl[i], qsl[i + 1]
            if e > s:
                out[s:e] = masked_paged_attention(
                    q[s:e], key_cache, value_cache, block_tables[i], lens[i], scale, k_scale, v_scale,
                    sliding_window=sliding_window, logit_softcap=logit_softcap, **kv4,
                )
        return out
    qlens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    decode_idx = [i for i, n in enumerate(qlens) if n == 1]
    for bucket in _length_buckets([lens[i] for i in decode_idx]) if decode_idx else []:
        seqs = [decode_idx[j] for j in bucket]
        idx = torch.tensor(seqs, device=q.device)
        tok = torch.tensor([qsl[i] for i in seqs], device=q.device)
        out[tok] = paged_decode_attention(
            q[tok], key_cache, value_cache, block_tables[idx], seq_lens[idx], scale, k_scale, v_scale, **kv4
        )
    for i, n in enumerate(qlens):
        if n > 1:
            s = qsl[i]
            out[s : s + n] = paged_prefill_attention(
                q[s : s + n], key_cache, value_cache, block_tables[i], lens[i], scale, k_scale, v_scale, **kv4
            )
    return out


def masked_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    key_group_scales: torch.Tensor | None = None,
    value_group_scales: torch.Tensor | None = None,
    kv4_format: str | None = None,
) -> torch.Tensor:
    """The last ``len(q)`` tokens of one sequence attend causally, optionally within a
    sliding window and with soft-capped scores (explicit fp32 math, the reference for
    the kernels).

    Args:
        q: ``[chunk_len, num_heads, head_dim]``; its tokens sit at positions
            ``seq_len - chunk_len .. seq_len - 1``.
        block_table: ``[>= ceil(seq_len / block_size)]`` block ids. Only blocks holding a
            key inside some query's window are read (out-of-window blocks may be freed).
        sliding_window: W; query ``p`` sees keys ``p - W < j <= p`` (HF transformers'
            sliding mask). None: full causal.
        logit_softcap: c; scores ``s`` become ``c * tanh(s / c)`` before the mask (Gemma 2).
    Returns:
        ``[chunk_len, num_heads, head_dim]`` in ``q.dtype``.
    """
    chunk, num_heads, _ = q.shape
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    first = 0
    if sliding_window is not None:
        first = max(0, seq_len - chunk - sliding_window + 1) // block_size * block_size
    table = block_table[first // block_size :]
    k, k_factor = gather_kv_unscaled(key_cache, table, seq_len - first, q.dtype, k_scale, key_group_scales, kv4_format)
    v, v_factor = gather_kv_unscaled(value_cache, table, seq_len - first, q.dtype, v_scale, value_group_scales,
                                     kv4_format)
    qf = _times(q, k_factor).float().transpose(0, 1)  # [H, chunk, D]
    rep = num_heads // num_kv_heads
    kf = k.float().transpose(0, 1).repeat_interleave(rep, dim=0)  # [H, n, D]
    vf = v.float().transpose(0, 1).repeat_interleave(rep, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    q_pos = torch.arange(seq_len - chunk, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (k_pos > q_pos - sliding_window)
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf).transpose(0, 1).to(q.dtype)
    return _times(out, v_factor)
