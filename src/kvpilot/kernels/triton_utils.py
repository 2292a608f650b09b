"""What the Triton launchers share: interpreter detection, FP8 format constants, the SM
count, the dot-operand dtype, exact FP8 rounding under the interpreter, and argument
checks that raise errors a person can act on.

Importing this module imports triton; the engine imports it only through the ``triton``
attention backend, so CPU installs without a GPU never need it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The interpreter is chosen when ``@triton.jit`` runs, i.e. when a kernel module is
# imported, so reading the variable once here matches what the kernels were built with.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off")

# SM count assumed under the interpreter: small, so CPU tests still exercise KV splits.
INTERPRETER_NUM_SMS = 4


@dataclass(frozen=True)
class FP8Format:
    """Constants of one FP8 format: finite maximum, mantissa bits, smallest normal
    exponent (for the interpreter's exact rounding, see ``store_kv``)."""

    max: float
    mantissa_bits: int
    min_normal_exp: int


FP8_FORMATS = {
    torch.float8_e4m3fn: FP8Format(448.0, 3, -6),
    torch.float8_e5m2: FP8Format(57344.0, 2, -14),
}

# Float dtypes the caches and activations may have.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_FORMATS


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of ``tl.dot`` for activations of ``dtype``.

    On the GPU the activation dtype itself (bf16/fp16 tensor cores, fp32 as IEEE fp32).
    Under the interpreter always fp32: its ``tl.dot`` and arithmetic on bfloat16 operate
    on the raw 16-bit patterns as integers (triton 3.x), so bf16 operands are widened
    first (exact) and the products are the ones the GPU's bf16 x bf16 -> fp32 MMA forms.
    """
    if INTERPRET or dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: IEEE for fp32 (no silent TF32), else the
    default (ignored for 16-bit operands)."""
    return "ieee" if INTERPRET or dtype == torch.float32 else "tf32"


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a nominal 4 on CPU/interpreter)."""
    if device.type == "cuda":
        return _cuda_num_sms(
            device.index if device.index is not None else torch.cuda.current_device()
        )
    return INTERPRETER_NUM_SMS


def check(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``."""
    if not condition:
        raise ValueError(message)


def check_device(*tensors: torch.Tensor) -> None:
    """All on one device, and a CUDA device unless running under the interpreter."""
    dev = tensors[0].device
    for t in tensors:
        check(t.device == dev, f"tensors are on different devices: {t.device} and {dev}")
    check(
        dev.type == "cuda" or INTERPRET,
        f"Triton kernels need CUDA tensors (got {dev}); set TRITON_INTERPRET=1 before "
        "importing kvpilot.kernels to run them on CPU (slow, for tests)",
    )


def check_cache_pair(
    key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int, int, int]:
    """K and V caches: same shape/dtype/strides, ``[num_blocks, block_size, heads, dim]``
    with a unit stride on ``dim``. Returns the shape."""
    check(
        key_cache.dim() == 4,
        f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim]; got {tuple(key_cache.shape)}",
    )
    check(
        value_cache.shape == key_cache.shape and value_cache.dtype == key_cache.dtype,
        f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} must match key_cache "
        f"{tuple(key_cache.shape)} {key_cache.dtype}",
    )
    check(
        value_cache.stride() == key_cache.stride(),
        f"key_cache and value_cache strides differ: {key_cache.stride()} vs {value_cache.stride()}",
    )
    check(
        key_cache.stride(3) == 1,
        f"the cache's head_dim axis must be contiguous; strides {key_cache.stride()}",
    )
    check(
        key_cache.dtype in FLOAT_DTYPES or is_fp8(key_cache.dtype),
        f"cache dtype {key_cache.dtype} is not supported; use float32/float16/bfloat16 or "
        "float8_e4m3fn/float8_e5m2",
    )
    return tuple(key_cache.shape)  # type: ignore[return-value]


def check_scale(
    name: str, scale: torch.Tensor | None, quantized: bool, device: torch.device
) -> torch.Tensor | None:
    """A quantized cache needs a one-element fp32 scale tensor on the cache's device."""
    if not quantized:
        return None
    check(scale is not None, f"{name} is required for an FP8 cache (x is stored as x / {name})")
    assert scale is not None
    check(
        scale.numel() == 1 and scale.dtype == torch.float32 and scale.device == device,
        f"{name} must be a one-element float32 tensor on {device}; got shape "
        f"{tuple(scale.shape)} {scale.dtype} on {scale.device}",
    )
    return scale


@triton.jit
def round_to_fp8_grid(y, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):  # type: ignore[no-untyped-def]
    """Round fp32 ``y`` (already clamped to the format's range) to the nearest value of
    an FP8 format, ties to even, so the cast that follows is exact.

    Used only under the interpreter: its fp32 -> fp8 cast truncates, rounds ties up and
    drops the carry into the exponent (1.97 -> 1.0 in e4m3). The GPU casts in hardware.
    Normal range: add half an ulp (minus one, plus the kept lsb) to the bit pattern and
    cut. Subnormal range: the step is fixed, so add and subtract 1.5 * 2^k, where k puts
    the fp32 ulp of that constant at the FP8 subnormal step.
    """
    SHIFT: tl.constexpr = 23 - MANTISSA_BITS
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> SHIFT) & 1
    bits = (bits + ((1 << (SHIFT - 1)) - 1) + lsb) & (-(1 << SHIFT))
    normal = bits.to(tl.float32, bitcast=True)
    MAGIC: tl.constexpr = 1.5 * 2.0 ** (MIN_NORMAL_EXP - MANTISSA_BITS + 23)
    sign = y.to(tl.int32, bitcast=True) & (-2147483648)  # keeps -0.0 negative
    subnormal = ((tl.abs(y) + MAGIC) - MAGIC).to(tl.int32, bitcast=True) | sign
    MIN_NORMAL: tl.constexpr = 2.0**MIN_NORMAL_EXP
    return tl.where(tl.abs(y) < MIN_NORMAL, subnormal.to(tl.float32, bitcast=True), normal)
