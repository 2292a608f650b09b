"""Key rotation for FP8 KV caches: an orthogonal matrix applied to every K head before it
is quantized and to every Q head before attention.

Why: attention logits are ``q . k``. Some key channels carry most of the magnitude
(outlier channels); FP8 rounds each element to 3 (E4M3) or 2 (E5M2) mantissa bits, so
the error of a logit dominated by one channel is that channel's full relative error. A
normalized Hadamard matrix ``R`` (``R @ R.T = I``) spreads every channel over all of them;
``(q R) . (k R) = q . k`` exactly, and the rounding errors of the now similar-sized
elements average out over the head dimension (QuaRot, Ashkboos et al. 2024,
arXiv:2404.00456). Values are not rotated: their error is averaged by the softmax
weights already, and rotating them would need an inverse rotation of the output.

Scales are unchanged (per-tensor, per layer); only what is stored differs. Measured on
SmolLM2-135M: see docs/kernels.md.
"""

from __future__ import annotations

import torch


def hadamard_matrix(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The ``n x n`` Sylvester-Hadamard matrix divided by ``sqrt(n)`` (orthogonal).

    Raises:
        ValueError: ``n`` is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two size; got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    norm: float = n**0.5
    return (h / norm).to(dtype=dtype, device=device)


def key_rotation_matrix(
    head_dim: int, dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[head_dim, head_dim]`` orthogonal matrix for key rotation: Hadamard for powers of
    two (every model we run), else a fixed random orthogonal matrix (QR of a Gaussian
    with seed 0, the same in every process)."""
    if head_dim & (head_dim - 1) == 0:
        return hadamard_matrix(head_dim, dtype, device)
    gen = torch.Generator().manual_seed(0)
    qmat, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    qmat = qmat * torch.sign(torch.diagonal(r))[None, :]
    rotation: torch.Tensor = qmat.to(dtype=dtype, device=device)  # linalg.qr is untyped
    return rotation


def rotate_heads(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x @ rotation`` over the last (head_dim) axis: ``[tokens, heads, head_dim]`` in,
    the same shape out (contiguous, x's dtype)."""
    return torch.matmul(x, rotation.to(x.dtype))
