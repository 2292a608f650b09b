"""Fused elementwise layer ops on CPU (C++, ``csrc/layer_ops_cpu.cpp``).

RMSNorm with and without the residual add, rotary embedding in place, and SiLU-and-mul:
one pass over each token's row instead of one pass (and one allocation) per torch
operator. Built and cached with the paged decode kernel by
:func:`kvpilot.kernels.cpu_attention.load`; the torch formulation they replace is
:class:`kvpilot.engine.model.layer_ops.TorchLayerOps`.
"""

from __future__ import annotations

import torch

from .cpu_attention import load


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))`` in fp32, rounded to ``x.dtype`` as torch would.

    Args:
        x: ``[num_tokens, hidden]`` fp32/bf16/fp16, rows contiguous (CPU).
        weight: ``[hidden]``, ``x.dtype``.
    Returns:
        a new ``[num_tokens, hidden]`` tensor.
    Raises:
        RuntimeError: kernels unavailable, or shapes/dtypes as above not met.
    """
    load()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ops.kvpilot_cpu.rms_norm(out, x, weight, float(eps))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``residual += x`` then ``x = rms_norm(residual)``, both in place (vLLM's
    ``fused_add_rms_norm`` contract).

    Args:
        x, residual: ``[num_tokens, hidden]``, same dtype, rows contiguous. Mutated.
        weight: ``[hidden]``.
    """
    load()
    torch.ops.kvpilot_cpu.fused_add_rms_norm(x, residual, weight, float(eps))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Rotate-half RoPE of ``q`` and ``k`` in place.

    Args:
        positions: ``[num_tokens]`` int64, each in ``[0, max_positions)``.
        q, k: ``[num_tokens, heads, head_dim]`` (token rows may be strided views of a fused
            QKV output; heads x head_dim contiguous). Mutated.
        cos, sin: ``[max_positions, head_dim]`` fp32 tables
            (:class:`kvpilot.engine.model.rotary.RotaryEmbedding`).
    Raises:
        RuntimeError: a position outside the table, or layouts as above not met.
    """
    load()
    torch.ops.kvpilot_cpu.rotary_embedding(positions.contiguous(), q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[num_tokens, 2I]``; a new ``[num_tokens, I]``."""
    load()
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    torch.ops.kvpilot_cpu.silu_and_mul(out, x)
    return out
