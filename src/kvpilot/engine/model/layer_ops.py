"""The elementwise ops of a decoder layer (RMSNorm with the residual add, rotary
embedding, SiLU-and-mul), as one interface with two implementations.

:class:`TorchLayerOps` is the reference: plain torch operators, one pass and one new
tensor per operator, on any device. :class:`CpuLayerOps` runs the same math through the
fused C++ kernels of :mod:`kvpilot.kernels.cpu_layer_ops` (one pass per op, in place
where vLLM's kernels are in place). The attention backend carries the ops that go with
it (``AttentionBackend.layer_ops``): the ``cpu`` backend the fused ones, every other
backend (and the start-up KV-scale calibration pass, which always runs the torch
backend) the reference.

Residual stream, as vLLM's Llama: ``add_rms_norm(x, residual)`` returns
``(rms_norm(x + residual), x + residual)``; the first layer starts from
``residual = embeddings``. The sums are the same additions as ``h = h + f(h)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvpilot.engine.model.rotary import apply_rotary


class TorchLayerOps:
    """Reference implementation (torch operators, any device; inputs never mutated)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x / sqrt(mean(x^2) + eps))``, computed in fp32 (Zhang & Sennrich
        2019). ``x`` ``[num_tokens, hidden]``; returns a new tensor of ``x.dtype``."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``; new tensors."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rotary_tables(self, rotary: Any, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """Per-step state for :meth:`rotary`: the cos/sin rows of ``positions`` in ``dtype``."""
        return rotary.cos_sin(positions, dtype)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, tables: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]``; new tensors."""
        cos, sin = tables
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` for ``x = [gate | up]`` ``[T, 2I]`` (Shazeer 2020)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """GeGLU's ``gelu_tanh(gate) * up`` for ``x = [gate | up]`` ``[T, 2I]`` (Shazeer 2020;
        Gemma's MLP): GELU with the tanh approximation, as transformers' ``gelu_pytorch_tanh``
        (``F.gelu(approximate="tanh")``). Returns a new ``[T, I]`` tensor of ``x.dtype``;
        the cpu ops inherit this one."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class CpuLayerOps(TorchLayerOps):
    """The fused C++ kernels (CPU tensors, fp32/bf16/fp16). ``add_rms_norm`` and
    ``rotary`` mutate their inputs (the caller owns them: fresh outputs of a projection).

    Raises:
        RuntimeError: from the kernels, when unavailable or given other layouts.
    """

    name = "cpu"

    def __init__(self) -> None:
        from kvpilot.kernels import cpu_layer_ops

        self._k = cpu_layer_ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._k.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rotary_tables(self, rotary: Any, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return positions, rotary.cos, rotary.sin

    def rotary(self, q: torch.Tensor, k: torch.Tensor, tables: Any) -> tuple[torch.Tensor, torch.Tensor]:
        positions, cos, sin = tables
        self._k.rotary_embedding(positions, q, k, cos, sin)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.silu_and_mul(x)


TORCH_LAYER_OPS = TorchLayerOps()
