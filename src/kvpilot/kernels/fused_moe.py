"""Fused Mixture-of-Experts expert computation in Triton (after vLLM's ``fused_moe``).

Steps (:func:`fused_moe`):

1. :func:`moe_align_block_size` sorts the ``T * k`` (token, slot) pairs by expert and pads
   each expert's run to a multiple of ``block_m`` (as vLLM's ``moe_align_block_size``), so
   every ``block_m`` rows of the sorted list belong to one expert; padding rows hold the
   invalid index ``T * k``. Experts that get no token get no block.
2. One grouped GEMM (:func:`_moe_gemm_kernel` with ``GATED``): for each block, the rows'
   tokens times that expert's gate and up rows of ``w13``, then ``silu(gate) * up``, into
   ``[T * k, inter]``.
3. A second grouped GEMM with the expert's ``w2``, each row multiplied by its routing
   weight, into ``[T * k, hidden]``; then the sum over the ``k`` slots (torch).

Accumulation is fp32; products of fp32 inputs use IEEE precision (no TF32). The torch
reference is :func:`kvpilot.engine.model.moe.moe_experts_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sort the flattened (token, slot) pairs by expert, each expert's run padded to ``block_m``.

    Args:
        topk_ids: ``[T, k]`` int expert ids.
        block_m: rows per GEMM block.
        num_experts: ``E``.
    Returns:
        ``(sorted_ids [P] int32, block_experts [P // block_m] int32, P)``: ``sorted_ids``
        are indices into the flattened ``[T * k]`` pairs, ``T * k`` on padding rows.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(padded, 0) - padded  # where each expert's run begins
    count_starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - count_starts[sorted_experts]
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[sorted_experts] + rank] = order.to(torch.int32)
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32),
                                            padded // block_m)
    return sorted_ids, block_experts, total


@triton.jit
def _moe_gemm_kernel(  # type: ignore[no-untyped-def]
                     a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, block_experts_ptr,
                     N, K, num_pairs, a_row_div,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                     GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``C[pair] = A[pair // a_row_div] @ B[expert].T``.

    ``GATED``: ``B`` rows ``n`` (gate) and ``n + N`` (up) are both read and the tile is
    ``silu(gate) * up``. ``MUL_WEIGHT``: each row times ``w[pair]``. Padding rows
    (``pair >= num_pairs``) are neither read nor written.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (pairs // a_row_div)[:, None] * stride_am
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + offs_n[None, :] * stride_bn + ks[:, None] * stride_bk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if GATED:
            b_up = tl.load(b_base + (offs_n + N)[None, :] * stride_bn + ks[:, None] * stride_bk,
                           mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc_up += tl.dot(a, b_up, input_precision="ieee")
            else:
                acc_up += tl.dot(a, b_up)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """The routing-weighted sum of each token's ``k`` experts' SwiGLU MLPs.

    Args:
        x: ``[T, hidden]`` fp32/bf16/fp16, contiguous rows.
        w13: ``[E, 2 * inter, hidden]`` gate rows then up rows; w2: ``[E, hidden, inter]``.
        topk_weights: ``[T, k]`` (cast to ``x``'s dtype first, as the reference does);
        topk_ids: ``[T, k]`` int.
        block_m, block_n, block_k: tile sizes (each >= 16 for ``tl.dot``).
    Returns:
        ``[T, hidden]`` in ``x``'s dtype; nothing is mutated.
    Raises:
        ValueError: shapes that do not agree, weights in another dtype or on another
            device than ``x``, or a tile below 16.
    """
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x must be [T, hidden], w13/w2 [E, ., .]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    if (w13.shape[2] != x.shape[1] or w2.shape[0] != w13.shape[0] or w2.shape[1] != x.shape[1]
            or w13.shape[1] != 2 * w2.shape[2]):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x "
                         f"{tuple(x.shape)}; expected [E, 2 * inter, hidden] and [E, hidden, inter]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, k]")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"fused_moe: {name} is {t.dtype} on {t.device}; x is {x.dtype} on {x.device}")
    if min(block_m, block_n, block_k) < 16:
        raise ValueError(f"fused_moe: tiles must be >= 16 (tl.dot); got {block_m}, {block_n}, {block_k}")
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return torch.zeros_like(x)
    sorted_ids, block_experts, total = moe_align_block_size(topk_ids, block_m, num_experts)
    weights = topk_weights.to(x.dtype).reshape(-1).contiguous()
    num_pairs = num_tokens * top_k
    act = torch.empty(num_pairs, inter, device=x.device, dtype=x.dtype)
    out = torch.empty(num_pairs, hidden, device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32
    blocks = total // block_m
    _moe_gemm_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w13, act, weights, sorted_ids, block_experts, inter, hidden, num_pairs, top_k,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), act.stride(1),
        GATED=True, MUL_WEIGHT=False, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    _moe_gemm_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, w2, out, weights, sorted_ids, block_experts, hidden, inter, num_pairs, 1,
        act.stride(0), act.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0), out.stride(1),
        GATED=False, MUL_WEIGHT=True, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
