"""4-bit micro-scaled KV cache formats: FP4 E2M1 and symmetric INT4, a scale per 16 values.

Torch reference of the encoding (the oracle for the Triton store, decode and prefill
kernels, and the ``torch`` attention backend's own path). Imports torch only.

Two-level scaling, as NVIDIA's NVFP4 does it (OCP MX v1.0 has one level, a power-of-two
E8M0 scale per 32 values; NVFP4 uses an FP8 E4M3 scale per 16 values under an fp32
per-tensor scale, which keeps more precision per group)::

    x  ~=  code  x  group_scale (E4M3, one per 16 values along head_dim)  x  tensor_scale
                                                                           (fp32, per layer,
                                                                            k_scale / v_scale)

Encoding one group ``g`` of 16 values of one token and head (``y = x / tensor_scale``)::

    s_g   = e4m3(min(amax(|y_g|) / QMAX, 448))          round to nearest even
    code  = encode(clamp(y / s_g, -QMAX, QMAX))          0 when s_g == 0
            fp4_e2m1: QMAX 6, nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} (ties to the even
                      code), sign in bit 3 (the OCP E2M1 bit pattern s.ee.m)
            int4:     QMAX 7, round half to even to -7..7, stored as code + 8 (offset
                      binary, symmetric: 0 unused), the symmetric per-group integer
                      format of KIVI / Atom-style KV quantization

Storage layout (``D = head_dim``, a multiple of 32)::

    packed        [..., D // 2] uint8   byte j = code[j] | code[j + D/2] << 4
    group_scales  [..., D // 16] float8_e4m3fn, group g covers dims [16 g, 16 g + 16)

The low nibble holds the first half of head_dim and the high nibble the second half
(not adjacent pairs): a kernel unpacks a tile into two contiguous halves with one mask
and one shift each, and computes ``q . k`` and ``p @ v`` as two half-width dots, with no
interleave of registers. A group never straddles the halves because ``D / 2`` is a
multiple of 16.

Bytes per value: 0.5 + 1/16 = 0.5625, so a bf16 cache's memory holds 16 / 4.5 = 3.56x the
tokens (the per-layer fp32 tensor scales are a few bytes and not counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

GROUP_SIZE = 16
GROUP_SCALE_DTYPE = torch.float8_e4m3fn
GROUP_SCALE_MAX = 448.0  # E4M3 finite max


@dataclass(frozen=True)
class KV4Format:
    """One 4-bit value format: its name (the ``--kv-cache-dtype`` spelling) and the
    largest magnitude a code represents (in units of the group scale)."""

    name: str
    qmax: float


class KV4Args(TypedDict):
    """The 4-bit keyword arguments of every store, decode and prefill function (the
    Triton launchers and the torch references), all None for a cache that is not 4-bit.

    Splatted into a call (``store_kv(..., **kv4)``); mypy checks each key against the
    callee's parameter of the same name.

    Attributes:
        key_group_scales, value_group_scales: the E4M3 scales, one per 16 values,
            ``[num_blocks, block_size, num_kv_heads, head_dim // 16]``.
        kv4_format: ``fp4_e2m1`` or ``int4``.
    """

    key_group_scales: torch.Tensor | None
    value_group_scales: torch.Tensor | None
    kv4_format: str | None


KV4_FORMATS = {
    "fp4_e2m1": KV4Format("fp4_e2m1", 6.0),
    "int4": KV4Format("int4", 7.0),
}

# E2M1 code (sign bit 3, exponent bits 2-1, mantissa bit 0) -> value.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor([*_E2M1_MAGNITUDES, *(-m for m in _E2M1_MAGNITUDES)])
# |v| above threshold i (or at it, for the ">=" ones) rounds to magnitude code > i; the
# ties go to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, ...).
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def kv4_format(name: str) -> KV4Format:
    """Look a format up by name. Raises ValueError naming the allowed ones."""
    if name not in KV4_FORMATS:
        raise ValueError(f"4-bit KV format must be one of {', '.join(KV4_FORMATS)}; got {name!r}")
    return KV4_FORMATS[name]


def check_kv4_head_dim(head_dim: int, name: str = "4-bit") -> None:
    """Raise ValueError unless ``head_dim`` is a positive multiple of 32 (groups of 16
    in each nibble half)."""
    if head_dim <= 0 or head_dim % (2 * GROUP_SIZE):
        raise ValueError(
            f"a {name} KV cache needs head_dim to be a multiple of {2 * GROUP_SIZE} (groups of "
            f"{GROUP_SIZE} values in each half of head_dim); got {head_dim}"
        )


def kv4_shapes(head_dim: int, name: str = "4-bit") -> tuple[int, int]:
    """(packed bytes, group scales) per token and head. Raises ValueError for a head_dim
    the format cannot hold."""
    check_kv4_head_dim(head_dim, name)
    return head_dim // 2, head_dim // GROUP_SIZE


def _encode(v: torch.Tensor, fmt: KV4Format) -> torch.Tensor:
    """Codes 0..15 (uint8) of ``v`` in units of the group scale."""
    if fmt.name == "int4":
        return (v.clamp(-fmt.qmax, fmt.qmax).round() + 8).to(torch.uint8)
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for t, inclusive in E2M1_THRESHOLDS:
        mag += (a >= t if inclusive else a > t).to(torch.uint8)
    return mag | ((v < 0).to(torch.uint8) << 3)


def _decode(codes: torch.Tensor, fmt: KV4Format) -> torch.Tensor:
    """fp32 values of codes 0..15."""
    if fmt.name == "int4":
        return codes.float() - 8.0
    return E2M1_VALUES.to(codes.device)[codes.long()]


def quantize_kv4(x: torch.Tensor, fmt: KV4Format | str, tensor_scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x [..., head_dim]`` (any float dtype).

    Returns:
        ``(packed [..., head_dim // 2] uint8, group_scales [..., head_dim // 16] float8_e4m3fn)``.
    Raises:
        ValueError: head_dim not a multiple of 32, an unknown format.
    """
    fmt = kv4_format(fmt) if isinstance(fmt, str) else fmt
    d = x.shape[-1]
    check_kv4_head_dim(d, fmt.name)
    # Divisors are tensors on x's device: CUDA torch turns ``a / python_float`` (and a
    # division by a CPU scalar) into ``a * (1 / b)``, which rounds differently from the
    # kernels' correctly rounded division and moved codes across rounding boundaries.
    y = x.float() / torch.as_tensor(tensor_scale, dtype=torch.float32, device=x.device)
    groups = torch.unflatten(y, -1, (d // GROUP_SIZE, GROUP_SIZE))
    amax = groups.abs().amax(-1)
    s = (amax / torch.full_like(amax, fmt.qmax)).clamp_(max=GROUP_SCALE_MAX).to(GROUP_SCALE_DTYPE)
    sf = s.float()[..., None]
    v = torch.where(sf > 0, groups / torch.where(sf > 0, sf, 1.0), 0.0).flatten(-2)
    codes = _encode(v, fmt)
    packed = codes[..., : d // 2] | (codes[..., d // 2 :] << 4)
    return packed, s


def dequantize_kv4(
    packed: torch.Tensor,
    group_scales: torch.Tensor,
    fmt: KV4Format | str,
    tensor_scale: torch.Tensor | float | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode ``packed [..., D/2]`` with ``group_scales [..., D/16]`` to ``[..., D]`` in
    ``dtype`` (times ``tensor_scale`` when given)."""
    fmt = kv4_format(fmt) if isinstance(fmt, str) else fmt
    codes = torch.cat([packed & 15, packed >> 4], dim=-1)
    vals = _decode(codes, fmt)
    d = vals.shape[-1]
    scales = group_scales.float().repeat_interleave(GROUP_SIZE, dim=-1)
    assert scales.shape[-1] == d, f"group_scales {tuple(group_scales.shape)} do not cover head_dim {d}"
    out = vals * scales
    if tensor_scale is not None:
        out = out * tensor_scale
    return out.to(dtype)
