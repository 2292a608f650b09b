"""Multi-LoRA products over segments of a batch (SGMV): ``y += B[s] @ (A[s] @ x)``, each
segment of tokens with its own adapter slot, in two Triton kernels.

The design is Punica's SGMV (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") as
S-LoRA uses it (Sheng et al. 2023, "S-LoRA: Serving Thousands of Concurrent LoRA
Adapters"): the batch is cut into ``G`` contiguous segments of tokens, each served by one
adapter slot (or by none: slot ``-1``), and the low-rank product runs as two grouped
GEMMs, the shrink ``x @ A^T`` into a narrow fp32 intermediate and the expand ``s @ B^T``
added into the base layer's output. vLLM's ``lora_shrink``/``lora_expand`` Triton ops
follow the same plan; this code is our own.

Layout::

    x           [T, in_features]        activations (fp32/bf16/fp16)
    y           [T, out_features]       the base layer's output, same dtype; y += delta
    lora_a      [S, R, in_features]     S slots, R the padded width (rows past an
                                        adapter's rank are zero)
    lora_b      [S, out_features, R]    the adapter's scaling already folded in
    seg_starts  [G + 1] int32           segment g owns tokens seg_starts[g]:seg_starts[g+1]
    seg_slots   [G] int32               its slot, or -1 (the base model alone)
    ranks       [S] int32 (optional)    the used width of each slot (<= R)

Grid: one program per ``BLOCK_M`` tile of one segment's tokens (times the output blocks,
or the split of the reduction), so decode (segments of one token) and prefill (segments
of thousands) take the same kernels. The number of tiles, ``sum_g ceil(len_g / BLOCK_M)``,
is only known on the device; the grid is sized by the host bound ``min(T, ceil(T /
BLOCK_M) + G)`` and each program finds its segment with a scan of ``seg_starts`` (a
prefix sum of tile counts, :func:`_find_tile`): no device-to-host sync, so both launches
can be captured in a CUDA graph. Programs past the last tile, and tiles of slot ``-1``
or of a slot of rank 0, exit at once.

1. Shrink (:func:`_shrink_kernel`, grid ``(tiles, SPLIT_K)``): ``[BLOCK_M, BLOCK_R]`` of
   ``x @ A[slot]^T`` in fp32, the ``in_features`` reduction cut into ``SPLIT_K`` ranges
   when there are too few tiles to fill the device (decode). Each split writes its own
   fp32 partial sum ``[SPLIT_K, T, R]`` (no atomics: the result does not depend on the
   order programs run in).
2. Expand (:func:`_expand_kernel`, grid ``(tiles, out_features / BLOCK_N)``): the partial
   sums added up in registers, times ``B[slot]^T``, added to the tile of ``y`` in fp32
   and stored once in ``y``'s dtype.

Rows of ``A`` and columns of ``B`` past a slot's rank (``ranks``) are neither read nor
used. Products accumulate in fp32; fp32 inputs use IEEE products (no TF32). On the GPU
the 16-bit operands go to the tensor cores as they are; the fp32 intermediate is rounded
to the activation dtype as the expand's operand (as vLLM's expand does; a relative
``2^-9`` on the LoRA delta in bf16, below ``y``'s own rounding). Under the interpreter
every product is fp32 (:func:`~kvpilot.kernels.triton_utils.dot_dtype`) and the bf16
store is rounded to nearest first (:func:`_round_to_bf16_grid`), so on CPU the kernels
give the reference's bf16 values.

:func:`sgmv_lora_reference` is the torch oracle, a loop over the segments.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from .triton_utils import (
    FLOAT_DTYPES,
    INTERPRET,
    check,
    check_device,
    dot_dtype,
    dot_precision,
    num_sms,
)

# Launch settings a config may name (:func:`default_config`).
CONFIG_KEYS = frozenset(
    {"SHRINK_BLOCK_M", "BLOCK_K", "SPLIT_K", "EXPAND_BLOCK_M", "BLOCK_N", "BLOCK_G", "num_warps", "num_stages"}
)


@triton.jit
def _find_tile(seg_starts_ptr, num_segs, tile, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):  # type: ignore[no-untyped-def]
    """The segment that owns global tile ``tile`` and the tile's first token.

    Tiles are numbered segment by segment, ``ceil(len_g / BLOCK_M)`` for segment ``g``.
    Returns ``(seg, row0, seg_end)``; ``seg`` is -1 when ``tile`` is past the last tile.
    """
    seg = num_segs * 0 - 1
    row0 = num_segs * 0
    seg_end = num_segs * 0
    tiles_before = num_segs * 0  # tiles of the chunks already scanned
    for g0 in range(0, num_segs, BLOCK_G):
        gs = g0 + tl.arange(0, BLOCK_G)
        ok = gs < num_segs
        lo = tl.load(seg_starts_ptr + gs, mask=ok, other=0)
        hi = tl.load(seg_starts_ptr + gs + 1, mask=ok, other=0)
        count = tl.maximum(hi - lo + BLOCK_M - 1, 0) // BLOCK_M
        incl = tl.cumsum(count, 0) + tiles_before
        excl = incl - count
        hit = ok & (excl <= tile) & (tile < incl)  # at most one segment holds the tile
        seg = tl.maximum(seg, tl.max(tl.where(hit, gs, -1), 0))
        row0 += tl.sum(tl.where(hit, lo + (tile - excl) * BLOCK_M, 0), 0)
        seg_end += tl.sum(tl.where(hit, hi, 0), 0)
        tiles_before += tl.sum(count, 0)
    return seg, row0, seg_end


@triton.jit
def _round_to_bf16_grid(v):  # type: ignore[no-untyped-def]
    """fp32 ``v`` rounded to the nearest bfloat16, ties to even, still as fp32; so the cast
    that follows is exact. Interpreter only: its fp32 -> bf16 cast truncates (Triton 3.9),
    the GPU rounds to nearest even in hardware."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    a_ptr,
    s_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    ranks_ptr,
    num_segs,
    num_tokens,
    num_slots,
    in_features,
    rank_width,
    k_per_split,
    # x [T, in]; A [S, R, in]; partial sums s [SPLIT_K, T, R]
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ss,
    stride_st,
    stride_sr,
    HAS_RANKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Split ``program_id(1)`` of ``s[t, r] = sum_k x[t, k] * A[slot, r, k]`` over one
    tile's tokens, in fp32. Writes nothing for slot -1 or a slot of rank 0."""
    seg, row0, seg_end = _find_tile(seg_starts_ptr, num_segs, tl.program_id(0), BLOCK_M, BLOCK_G)
    if seg < 0:
        return
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0 or slot >= num_slots:
        return
    rank = rank_width
    if HAS_RANKS:
        rank = tl.minimum(tl.maximum(tl.load(ranks_ptr + slot), 0), rank_width)
    if rank == 0:
        return
    split = tl.program_id(1)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = (rows < seg_end) & (rows < num_tokens)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + rs[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k_hi
        x = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_rows + ks[:, None] * stride_ak, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x.to(DOT_DTYPE), a.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    out = s_ptr + split * stride_ss + rows.to(tl.int64)[:, None] * stride_st + rs[None, :] * stride_sr
    tl.store(out, acc, mask=row_ok[:, None] & (rs < rank_width)[None, :])


@triton.jit
def _expand_kernel(  # type: ignore[no-untyped-def]
    y_ptr,
    s_ptr,
    b_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    ranks_ptr,
    num_segs,
    num_tokens,
    num_slots,
    out_features,
    rank_width,
    num_splits,
    # y [T, out]; partial sums s [SPLIT_K, T, R]; B [S, out, R]
    stride_yt,
    stride_yn,
    stride_ss,
    stride_st,
    stride_sr,
    stride_bs,
    stride_bn,
    stride_br,
    HAS_RANKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """``y[t, n] += sum_r s[t, r] * B[slot, n, r]`` for one tile's tokens and one block of
    ``BLOCK_N`` outputs, ``s`` the sum of the shrink's splits; added in fp32, stored once."""
    seg, row0, seg_end = _find_tile(seg_starts_ptr, num_segs, tl.program_id(0), BLOCK_M, BLOCK_G)
    if seg < 0:
        return
    slot = tl.load(seg_slots_ptr + seg)
    if slot < 0 or slot >= num_slots:
        return
    rank = rank_width
    if HAS_RANKS:
        rank = tl.minimum(tl.maximum(tl.load(ranks_ptr + slot), 0), rank_width)
    if rank == 0:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = (rows < seg_end) & (rows < num_tokens)
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    s_tile = s_ptr + rows.to(tl.int64)[:, None] * stride_st + rs[None, :] * stride_sr
    s_mask = row_ok[:, None] & r_ok[None, :]
    s = tl.load(s_tile, mask=s_mask, other=0.0)
    for split in range(1, num_splits):
        s += tl.load(s_tile + split * stride_ss, mask=s_mask, other=0.0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < out_features
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + ns[None, :] * stride_bn + rs[:, None] * stride_br,
        mask=n_ok[None, :] & r_ok[:, None],
        other=0.0,
    )
    delta = tl.dot(s.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    y_tile = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + ns[None, :] * stride_yn
    y_mask = row_ok[:, None] & n_ok[None, :]
    out = tl.load(y_tile, mask=y_mask, other=0.0).to(tl.float32) + delta
    if ROUND_BF16:
        out = _round_to_bf16_grid(out)
    tl.store(y_tile, out.to(y_ptr.dtype.element_ty), mask=y_mask)


def _check_args(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor | None,
) -> None:
    """The shapes and dtypes of :func:`sgmv_lora`'s arguments (not the values in the
    index tensors: reading them would sync with the device)."""
    check(
        x.dim() == 2 and x.dtype in FLOAT_DTYPES,
        f"x must be [T, in_features] float32/float16/bfloat16; got {tuple(x.shape)} {x.dtype}",
    )
    num_tokens, in_features = x.shape
    check(
        lora_a.dim() == 3 and lora_a.shape[2] == in_features,
        f"lora_a must be [S, R, in_features={in_features}]; got {tuple(lora_a.shape)}",
    )
    num_slots, width, _ = lora_a.shape
    check(
        y.dim() == 2 and y.shape[0] == num_tokens,
        f"y must be [T={num_tokens}, out_features]; got {tuple(y.shape)}",
    )
    out_features = y.shape[1]
    check(
        lora_b.shape == (num_slots, out_features, width),
        f"lora_b must be [S={num_slots}, out_features={out_features}, R={width}]; got {tuple(lora_b.shape)}",
    )
    for name, t in (("y", y), ("lora_a", lora_a), ("lora_b", lora_b)):
        check(t.dtype == x.dtype, f"{name} is {t.dtype}; it must have x's dtype {x.dtype}")
    check(
        seg_starts.dim() == 1 and seg_starts.shape[0] >= 1 and seg_starts.dtype == torch.int32,
        f"seg_starts must be int32 [G + 1]; got {seg_starts.dtype} {tuple(seg_starts.shape)}",
    )
    num_segs = seg_starts.shape[0] - 1
    check(
        seg_slots.shape == (num_segs,) and seg_slots.dtype == torch.int32,
        f"seg_slots must be int32 [G={num_segs}] (one per segment of seg_starts); got "
        f"{seg_slots.dtype} {tuple(seg_slots.shape)}",
    )
    if ranks is not None:
        check(
            ranks.shape == (num_slots,) and ranks.dtype == torch.int32,
            f"ranks must be int32 [S={num_slots}]; got {ranks.dtype} {tuple(ranks.shape)}",
        )


def default_config(
    num_tokens: int, num_segs: int, in_features: int, width: int, device: torch.device
) -> dict[str, int]:
    """Tile sizes and launch settings for :func:`sgmv_lora`, from host-known sizes only.

    ``*_BLOCK_M`` follows the mean segment length (16 for decode, up to 64 for prefill);
    ``SPLIT_K`` cuts the ``in_features`` reduction when the shrink's tiles would leave
    most of the device idle; ``BLOCK_G`` is the chunk of segments each program scans at a
    time to find its tile (one chunk up to 1,024 segments). Not yet tuned on a GPU. Under
    the interpreter, tiles small enough that test sizes cover the loops and masks.
    """
    mean_len = num_tokens / max(num_segs, 1)
    block_m = 16 if mean_len <= 16 else 32 if mean_len <= 32 else 64
    block_k = 32 if INTERPRET else 128 if width <= 32 else 64
    tiles = min(num_tokens, triton.cdiv(num_tokens, 16) + num_segs)  # shrink tiles at BLOCK_M 16
    k_blocks = triton.cdiv(in_features, block_k)
    split_k = max(1, min(num_sms(device) // max(tiles, 1), k_blocks, 16))
    return {
        "SHRINK_BLOCK_M": 16,  # the shrink's tiles are narrow (R): more programs, same bytes of A
        "BLOCK_K": block_k,
        "SPLIT_K": split_k,
        "EXPAND_BLOCK_M": block_m,
        "BLOCK_N": 32 if INTERPRET else 128,
        "BLOCK_G": min(1024, max(16, triton.next_power_of_2(num_segs))),
        "num_warps": 4,
        "num_stages": 1 if INTERPRET else 3,
    }


def sgmv_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor | None = None,
) -> None:
    """Add each segment's LoRA product to ``y`` in place:
    ``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` for every token ``t`` of segment ``g`` with
    ``s = seg_slots[g] >= 0``; tokens of slot ``-1`` segments are left as they are.

    Args:
        y: ``[T, out_features]``, x's dtype; MUTATED (the only tensor written). Any strides
            (e.g. a column slice of a fused QKV output).
        x: ``[T, in_features]`` float32/float16/bfloat16, any strides.
        lora_a: ``[S, R, in_features]``, x's dtype; rows past a slot's rank are zero (or
            unread, with ``ranks``).
        lora_b: ``[S, out_features, R]``, x's dtype, the adapter's scaling folded in.
        seg_starts: ``[G + 1]`` int32 token offsets, ``seg_starts[0] == 0``, non-decreasing,
            ``seg_starts[G] == T`` (empty segments allowed).
        seg_slots: ``[G]`` int32, each in ``[-1, S)``.
        ranks: optional ``[S]`` int32 used width per slot, in ``[0, R]``: rows of ``A`` and
            columns of ``B`` from it on are not read (a slot of rank 0 adds nothing).
    The values of ``seg_starts``, ``seg_slots`` and ``ranks`` are not checked (that would
    sync with the device); out-of-range slots are skipped and ranks clamped to ``[0, R]``,
    so bad values give wrong sums, never out-of-bounds accesses of ``lora_a``/``lora_b``.
    :func:`sgmv_lora_reference` checks them.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, naming the argument; tensors
            off CUDA unless the Triton interpreter is on.
    """
    _check_args(y, x, lora_a, lora_b, seg_starts, seg_slots, ranks)
    cfg = default_config(x.shape[0], seg_slots.shape[0], x.shape[1], lora_a.shape[1], x.device)
    _launch(y, x, lora_a, lora_b, seg_starts, seg_slots, ranks, cfg)


def sgmv_lora_with_config(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor | None,
    config: dict[str, int],
) -> None:
    """:func:`sgmv_lora` with launch settings overridden (tests, tuning sweeps): the keys
    of :data:`CONFIG_KEYS` given in ``config`` replace :func:`default_config`'s.

    Raises:
        ValueError: as :func:`sgmv_lora`; an unknown key, a block below 16 or not a power
            of two, or ``SPLIT_K`` below 1.
    """
    _check_args(y, x, lora_a, lora_b, seg_starts, seg_slots, ranks)
    unknown = sorted(set(config) - CONFIG_KEYS)
    check(not unknown, f"config keys {unknown} are not among {sorted(CONFIG_KEYS)}")
    cfg = default_config(x.shape[0], seg_slots.shape[0], x.shape[1], lora_a.shape[1], x.device)
    cfg.update(config)
    for key in ("SHRINK_BLOCK_M", "BLOCK_K", "EXPAND_BLOCK_M", "BLOCK_N", "BLOCK_G"):
        v = cfg[key]
        check(v >= 16 and v & (v - 1) == 0, f"config {key} must be a power of two >= 16; got {v}")
    check(cfg["SPLIT_K"] >= 1, f"config SPLIT_K must be >= 1; got {cfg['SPLIT_K']}")
    _launch(y, x, lora_a, lora_b, seg_starts, seg_slots, ranks, cfg)


def _launch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor | None,
    cfg: dict[str, int],
) -> None:
    check_device(*(t for t in (y, x, lora_a, lora_b, seg_starts, seg_slots, ranks) if t is not None))
    num_tokens, in_features = x.shape
    num_slots, width, _ = lora_a.shape
    out_features = y.shape[1]
    num_segs = seg_slots.shape[0]
    if num_segs == 0 or num_tokens == 0 or num_slots == 0 or width == 0 or out_features == 0:
        return
    block_r = max(16, triton.next_power_of_2(width))
    k_blocks = triton.cdiv(in_features, cfg["BLOCK_K"])
    split_k = max(1, min(cfg["SPLIT_K"], k_blocks))
    k_per_split = triton.cdiv(k_blocks, split_k) * cfg["BLOCK_K"]
    partial = torch.empty((split_k, num_tokens, width), dtype=torch.float32, device=x.device)
    ranks_arg = ranks if ranks is not None else seg_slots  # never read without HAS_RANKS
    common = {
        "HAS_RANKS": ranks is not None,
        "BLOCK_R": block_r,
        "BLOCK_G": cfg["BLOCK_G"],
        "DOT_DTYPE": dot_dtype(x.dtype),
        "DOT_PRECISION": dot_precision(x.dtype),
        "num_warps": cfg["num_warps"],
        "num_stages": cfg["num_stages"],
    }

    def tiles(block_m: int) -> int:
        # sum_g ceil(len_g / block_m) <= ceil(T / block_m) + G, and a tile holds >= 1 token
        return min(num_tokens, int(triton.cdiv(num_tokens, block_m)) + num_segs)

    _shrink_kernel[(tiles(cfg["SHRINK_BLOCK_M"]), split_k)](
        x, lora_a, partial, seg_starts, seg_slots, ranks_arg,
        num_segs, num_tokens, num_slots, in_features, width, k_per_split,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        partial.stride(0), partial.stride(1), partial.stride(2),
        BLOCK_M=cfg["SHRINK_BLOCK_M"], BLOCK_K=cfg["BLOCK_K"], **common,
    )  # fmt: skip
    _expand_kernel[(tiles(cfg["EXPAND_BLOCK_M"]), triton.cdiv(out_features, cfg["BLOCK_N"]))](
        y, partial, lora_b, seg_starts, seg_slots, ranks_arg,
        num_segs, num_tokens, num_slots, out_features, width, split_k,
        y.stride(0), y.stride(1),
        partial.stride(0), partial.stride(1), partial.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        BLOCK_M=cfg["EXPAND_BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        ROUND_BF16=INTERPRET and y.dtype == torch.bfloat16, **common,
    )  # fmt: skip


def sgmv_lora_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor | None = None,
) -> None:
    """The torch oracle of :func:`sgmv_lora`, same arguments and effect (``y`` MUTATED),
    any device: per segment of slot ``s >= 0`` with rank ``r`` (``R`` without ``ranks``),
    ``y[seg] = dtype(fp32(y[seg]) + (fp32(x[seg]) @ fp32(A[s, :r])^T) @ fp32(B[s, :, :r])^T)``,
    the intermediate in fp32 and one rounding into ``y``'s dtype, as the kernels do.

    Raises:
        ValueError: as :func:`sgmv_lora` for shapes and dtypes, and for values: offsets
            not from 0 to T non-decreasing (``seg_starts``), a slot outside ``[-1, S)``
            (``seg_slots``), a rank outside ``[0, R]`` (``ranks``).
    """
    _check_args(y, x, lora_a, lora_b, seg_starts, seg_slots, ranks)
    num_tokens = x.shape[0]
    num_slots, width, _ = lora_a.shape
    starts = seg_starts.tolist()
    slots = seg_slots.tolist()
    check(
        starts[0] == 0 and starts[-1] == num_tokens and all(a <= b for a, b in itertools.pairwise(starts)),
        f"seg_starts must rise from 0 to T={num_tokens} without decreasing; got {starts}",
    )
    check(all(-1 <= s < num_slots for s in slots), f"seg_slots must be in [-1, {num_slots}); got {slots}")
    widths = [width] * num_slots if ranks is None else ranks.tolist()
    check(all(0 <= r <= width for r in widths), f"ranks must be in [0, R={width}]; got {widths}")
    for g, slot in enumerate(slots):
        lo, hi = starts[g], starts[g + 1]
        if slot < 0 or hi == lo or widths[slot] == 0:
            continue
        r = widths[slot]
        s = x[lo:hi].float() @ lora_a[slot, :r].float().T
        y[lo:hi] = (y[lo:hi].float() + s @ lora_b[slot, :, :r].float().T).to(y.dtype)
