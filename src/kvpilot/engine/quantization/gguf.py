"""GGUF's quantized tensors kept quantized in memory.

llama.cpp's GGUF files store a 2-D weight as rows of fixed-size blocks (ggml's
``block_q4_0`` ... ``block_q6_K`` in ``ggml-common.h``; the math in ``ggml-quants.c``'s
``dequantize_row_*`` and in gguf-py's ``gguf/quants.py``, which this module ports to torch
and is checked against). A tensor of ggml shape ``[K, N]`` is, in torch's order, an
``[N, K]`` matrix: ``N`` rows of ``K // block_values`` blocks each. Six types are served
quantized; the weight a tensor becomes, and its resident bytes against the file's:

====== ===================== =================================== ========= ========
type   file block            in memory                           bits/wt   vs file
====== ===================== =================================== ========= ========
Q4_0   32 values, 18 bytes   ``WNA16Weight`` 4-bit, group 32      5.0      1.11x
Q4_1   32 values, 20 bytes   ``WNA16Weight`` 4-bit, group 32      5.0      1.00x
Q8_0   32 values, 34 bytes   ``WNA16Weight`` 8-bit, group 32      9.0      1.06x
Q4_K   256 values, 144 bytes ``WNA16Weight`` 4-bit, group 32      5.0      1.11x
Q5_K   256 values, 176 bytes ``GGUFBlockWeight`` (the raw blocks) 5.5      1.00x
Q6_K   256 values, 210 bytes ``GGUFBlockWeight`` (the raw blocks) 6.5625   1.00x
====== ===================== =================================== ========= ========

The WNA16 ones (the canonical layout of :mod:`~kvpilot.engine.quantization.weights`) use
the engine's integer kernels; their scales and offsets are 16-bit (:func:`scale_dtype`).
Q5_K and Q6_K fit neither the 4- nor the 8-bit layout within 1.15x of the file, so their
blocks are kept as stored and dequantized a tile of rows at a time in torch. F32, F16 and
BF16 tensors are dense (the loader's business); every other quantized type is refused
(:func:`check_type`). Only little-endian files (every file llama.cpp writes) are read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvpilot.engine.quantization.weights import (
    QuantizedWeight,
    QuantizedWeightError,
    WNA16Weight,
    _check,
)

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
"""The quantized ggml types served quantized."""
DENSE_TYPES = ("F32", "F16", "BF16")
"""The float ggml types, loaded dense."""
WNA16_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
"""The kept types converted to :class:`~kvpilot.engine.quantization.weights.WNA16Weight`;
the others stay :class:`GGUFBlockWeight`."""

BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),   # fp16 d, 16 bytes of nibbles
    "Q4_1": (32, 20),   # fp16 d, fp16 m, 16 bytes of nibbles
    "Q8_0": (32, 34),   # fp16 d, 32 int8
    "Q4_K": (256, 144),  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    "Q5_K": (256, 176),  # as Q4_K plus 32 bytes of fifth bits (qh) before the nibbles
    "Q6_K": (256, 210),  # 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d
}
"""ggml type -> (values per block, bytes per block): gguf-py's ``GGML_QUANT_SIZES``."""

# The byte offsets of each block's fp16 factors (d, and dmin or m): checked finite.
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# ggml's type ids (enum ggml_type) of the types this module names.
_GGML_TYPE_IDS = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
                  30: "BF16"}
# Rows of codes unpacked at once while converting (bounds the temporaries to ~32 MiB).
_CONVERT_BYTES = 32 << 20


def ggml_type_name(qtype: Any) -> str:
    """The ggml type's name (``Q4_K``) from a ``gguf.GGMLQuantizationType``, its integer
    id or a name (any case)."""
    if isinstance(qtype, str):
        return qtype.upper()
    name = getattr(qtype, "name", None)
    if isinstance(name, str):
        return name
    if int(qtype) in _GGML_TYPE_IDS:
        return _GGML_TYPE_IDS[int(qtype)]
    try:
        import gguf

        return str(gguf.GGMLQuantizationType(int(qtype)).name)
    except (ImportError, ValueError):
        return f"ggml type {int(qtype)}"


def check_type(qtype: Any, name: str) -> str:
    """The type's name when it is dense or kept quantized.

    Raises:
        QuantizedWeightError: another type, naming tensor ``name``, the type and the
            supported ones.
    """
    t = ggml_type_name(qtype)
    _check(t in KEPT_TYPES or t in DENSE_TYPES, name,
           f"GGUF tensor type {t} is not supported; quantized weights are served as {', '.join(KEPT_TYPES)} "
           f"(kept quantized) and {', '.join(DENSE_TYPES)} (dense); requantize the model to one of those "
           "(llama.cpp's llama-quantize)")
    return t


# ------------------------------------------------------------------- block math
def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian fp16 at byte ``at`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles_halves(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0/Q4_1 codes: byte ``i`` holds value ``i`` (low nibble) and ``i + 16`` (high);
    uint8 ``[n, 16]`` -> ``[n, 32]`` in value order."""
    return torch.cat((qs & 0xF, qs >> 4), dim=1)


def _nibbles_k(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K low nibbles: 32-byte chunk ``c`` holds sub-block ``2c`` in its low
    nibbles and ``2c + 1`` in its high ones; uint8 ``[n, 128]`` -> ``[n, 8, 32]``."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat((q & 0xF, q >> 4), dim=2).reshape(-1, 8, 32)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins (ggml's ``get_scale_min_k4``; gguf-py
    ``Q4_K.get_scale_min``): uint8 ``[n, 12]`` -> (``sc``, ``m``) uint8 ``[n, 8]``."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles_halves(b[:, 2:18]).to(torch.int16) - 8
    return _f16(b, 0) * q.float()


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles_halves(b[:, 4:20]).float() + _f16(b, 2)


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float())[..., None]
    dm = (_f16(b, 2) * mn.float())[..., None]
    return (d * _nibbles_k(b[:, 16:144]).float() - dm).reshape(-1, 256)


_BITS8 = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
_SHIFT_2BIT = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
_SHIFT_NIBBLE = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float())[..., None]
    dm = (_f16(b, 2) * mn.float())[..., None]
    qh = (b[:, 16:48].reshape(-1, 1, 32) >> _BITS8.to(b.device)) & 1  # sub-block s: bit s
    q = _nibbles_k(b[:, 48:176]) | (qh << 4)
    return (d * q.float() - dm).reshape(-1, 256)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = (b[:, 0:128].reshape(n, 2, 1, 64) >> _SHIFT_NIBBLE.to(b.device)) & 0xF  # [n, 2, 2, 64]
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2BIT.to(b.device)) & 3  # [n, 2, 4, 32]
    q = (ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)).to(torch.int16) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = (_f16(b, 208) * scales)[..., None]
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


DEQUANTIZE_BLOCKS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _deq_q4_0, "Q4_1": _deq_q4_1, "Q8_0": _deq_q8_0,
    "Q4_K": _deq_q4_k, "Q5_K": _deq_q5_k, "Q6_K": _deq_q6_k,
}
"""ggml type -> blocks uint8 ``[n, block_bytes]`` -> float32 ``[n, block_values]``: gguf-py
``quants.py``'s ``dequantize_blocks`` in torch, the same float32 operations in the same
order (so equal to it bit for bit), on any device."""


def dequantize_blocks(blocks: torch.Tensor, qtype: Any) -> torch.Tensor:
    """Blocks of one kept type, uint8 ``[n, block_bytes]``, as float32 ``[n, block_values]``."""
    return DEQUANTIZE_BLOCKS[ggml_type_name(qtype)](blocks)


# ------------------------------------------------------------ GGUFBlockWeight
class GGUFBlockWeight(QuantizedWeight):
    """One ``[N, K]`` matrix as GGUF stores it: each row's blocks, raw (the serving form
    of Q5_K and Q6_K; for the other kept types the reference the WNA16 conversion is
    tested against).

    The product dequantizes a tile of output rows at a time
    (:data:`~kvpilot.engine.quantization.weights.TILE_BYTES` of float32) and multiplies, in
    float32 for float32 activations and in the activations' dtype otherwise; the matrix is
    never held dequantized.

    Args:
        blocks: uint8 ``[N, K // block_values * block_bytes]`` (:data:`BLOCKS`), row-major
            as in the file; held, not copied.
        qtype: one of :data:`KEPT_TYPES` (name, id or ``gguf.GGMLQuantizationType``).
        in_features: ``K``, a multiple of the type's block values.
        name: the checkpoint tensor, for errors and logs.
    Raises:
        QuantizedWeightError: another type, a ``K`` not a multiple of the block, or a
            blocks tensor whose dtype or shape does not fit.
    """

    def __init__(self, blocks: torch.Tensor, qtype: Any, in_features: int, name: str = "weight") -> None:
        self.name = name
        t = ggml_type_name(qtype)
        _check(t in KEPT_TYPES, name, f"GGUF type {t} has no block form here; supported: {', '.join(KEPT_TYPES)}")
        bs, ts = BLOCKS[t]
        _check(in_features > 0 and in_features % bs == 0, name,
               f"row length {in_features} is not a multiple of the {t} block of {bs} values")
        want = in_features // bs * ts
        _check(blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[1] == want, name,
               f"blocks {blocks.dtype} {tuple(blocks.shape)}; expected uint8 [N, {want}] for {t} rows of "
               f"{in_features} values")
        self.blocks, self.qtype = blocks, t
        self.format = f"gguf:{t}"
        self.out_features, self.in_features = blocks.shape[0], in_features

    @property
    def bits_per_weight(self) -> float:
        bs, ts = BLOCKS[self.qtype]
        return 8.0 * ts / bs

    def params(self) -> tuple[object, ...]:
        return (self.qtype, self.in_features)

    def describe(self) -> str:
        return f"GGUF {self.qtype} blocks ({self.bits_per_weight:g} bits per weight), dequantized per tile"

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"blocks": self.blocks}

    def _replace(self, **t: torch.Tensor | None) -> GGUFBlockWeight:
        blocks = t.get("blocks", self.blocks)
        assert blocks is not None
        return GGUFBlockWeight(blocks, self.qtype, self.in_features, self.name)

    def cat(self, parts: Sequence[QuantizedWeight], name: str) -> GGUFBlockWeight:
        ps = [p for p in parts if isinstance(p, GGUFBlockWeight)]
        return GGUFBlockWeight(torch.cat([p.blocks for p in ps]), self.qtype, self.in_features, name)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        b = self.blocks if rows is None else self.blocks.index_select(0, rows)
        n = b.shape[0]
        ts = BLOCKS[self.qtype][1]
        return DEQUANTIZE_BLOCKS[self.qtype](b.reshape(-1, ts)).reshape(n, self.in_features).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._tiled(x, bias, torch.float32 if x.dtype == torch.float32 else x.dtype)


# ------------------------------------------------------------------ conversion
def scale_dtype(*values: torch.Tensor) -> torch.dtype:
    """The 16-bit dtype WNA16 scales and offsets are stored in: float16 unless its summed
    absolute rounding error over ``values`` (float32, exact) exceeds bfloat16's.

    Why 16 bits: float32 scales and offsets would add 2 bits per weight (Q4_K: 6 bits
    against the file's 4.5, 1.33x; the budget is 1.15x). Why float16 first: 11
    significant bits against bfloat16's 8, so it is exact for Q4_0, Q4_1 and Q8_0 (``d``,
    ``m`` are fp16 in the file; ``-8 d`` and ``-128 d`` are exact) and rounds Q4_K's
    ``d * sc`` and ``dmin * m`` (up to 17 bits) to 2**-11 relative. bfloat16 is taken
    when float16 would overflow (a value past 65504, e.g. a Q8_0 ``d`` over 511) or lose
    more in its subnormal range than bfloat16 loses everywhere; its rounding is 2**-9
    relative (dequantized weights within about 4e-3 of the file's; logits within 1e-2).
    """
    err = {}
    for dt in (torch.float16, torch.bfloat16):
        total = 0.0
        for v in values:
            total += float((v.to(dt).float() - v).abs().sum())
        err[dt] = total
    return torch.float16 if err[torch.float16] <= err[torch.bfloat16] else torch.bfloat16


def _pack_nibble_pairs(qs: torch.Tensor) -> torch.Tensor:
    """GGML's "value ``i`` low, value ``i + h`` high" nibbles (Q4_0/Q4_1 with ``h = 16``;
    a Q4_K 32-byte chunk with ``h = 32``), uint8 ``[n, h]``, re-laid out as the canonical
    pairs: ``[n, h]`` bytes whose byte ``j`` holds values ``2j`` (low) and ``2j + 1``
    (high) of the ``2h`` values, without unpacking the codes."""
    even, odd = qs[:, 0::2], qs[:, 1::2]
    return torch.cat(((even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)), dim=1)


def _wna16_parts(t: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks uint8 ``[n, block_bytes]`` -> (the canonical ``qweight`` bytes ``[n,
    block_values // 2]`` (4 bits) or ``[n, block_values]`` (8 bits), scales and offsets
    float32 ``[n, block_values // 32]``) with ``w = code * scale + offset``."""
    if t == "Q4_0":
        d = _f16(b, 0)
        return _pack_nibble_pairs(b[:, 2:18]), d, -8.0 * d
    if t == "Q4_1":
        return _pack_nibble_pairs(b[:, 4:20]), _f16(b, 0), _f16(b, 2)
    if t == "Q8_0":
        d = _f16(b, 0)
        return b[:, 2:34] ^ 0x80, d, -128.0 * d  # int8 q + 128 as uint8
    assert t == "Q4_K", t
    sc, mn = k_scale_min(b[:, 4:16])
    chunks = b[:, 16:144].reshape(-1, 32)  # 4 chunks: sub-blocks 2c (low nibbles), 2c + 1 (high)
    packed = _pack_nibble_pairs(chunks).reshape(-1, 128)
    return packed, _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float())


def _check_finite(t: str, blocks: torch.Tensor, name: str) -> None:
    """Refuse blocks whose fp16 factors are inf or NaN (exponent bits all ones)."""
    for at in _FP16_FIELDS[t]:
        bad = (blocks[..., at + 1] & 0x7C) == 0x7C
        if bool(bad.any()):
            row, col = (int(i) for i in bad.reshape(blocks.shape[0], -1).nonzero()[0])
            raise QuantizedWeightError(
                f"{name}: {t} block {col} of row {row} has a non-finite fp16 factor (inf or NaN at byte {at}); "
                "the file is damaged")


def gguf_blocks(data: Any, qtype: Any, shape: Sequence[int], name: str) -> torch.Tensor:
    """A GGUF tensor's bytes as uint8 ``[N, K // block_values * block_bytes]``, checked.

    Args:
        data: the raw bytes (``gguf.ReaderTensor.data``: a numpy array, any shape; or a
            torch tensor); copied.
        qtype: the ggml type (one of :data:`KEPT_TYPES`).
        shape: ``[N, K]`` in torch's order (ggml's reversed).
        name: the tensor, for errors.
    Raises:
        QuantizedWeightError: an unsupported type, a shape other than 2-D, ``K`` not a
            multiple of the block, a byte count other than the shape's, or a block with a
            non-finite fp16 factor.
    """
    t = check_type(qtype, name)
    _check(t in KEPT_TYPES, name, f"{t} is a dense type, not a quantized one; supported: {', '.join(KEPT_TYPES)}")
    dims = [int(s) for s in shape]
    _check(len(dims) == 2, name, f"shape {dims}; a quantized GGUF weight must be 2-D ([N, K])")
    n, k = dims
    bs, ts = BLOCKS[t]
    _check(k > 0 and k % bs == 0, name,
           f"row length {k} is not a multiple of the {t} block of {bs} values; the tensor cannot be {t}")
    if isinstance(data, torch.Tensor):
        raw = data.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
    else:
        raw = torch.from_numpy(data.copy(order="C")).reshape(-1).view(torch.uint8)
    want = n * (k // bs) * ts
    _check(raw.numel() == want, name,
           f"{raw.numel()} bytes do not match the shape [{n}, {k}] as {t}: expected {want} "
           f"({n} rows of {k // bs} blocks of {ts} bytes)")
    blocks = raw.view(n, k // bs * ts)
    _check_finite(t, blocks.view(n, k // bs, ts), name)
    return blocks


def gguf_weight(data: Any, qtype: Any, shape: Sequence[int], name: str, raw: bool = False) -> QuantizedWeight:
    """One GGUF tensor as the engine's quantized weight (table in the module docstring).

    Args:
        data, qtype, shape, name: as :func:`gguf_blocks` (``shape`` is torch's ``[N, K]``).
        raw: keep the blocks as stored (:class:`GGUFBlockWeight`) for every type: the
            reference the WNA16 conversion is tested against.
    Returns:
        A :class:`~kvpilot.engine.quantization.weights.WNA16Weight` for Q4_0, Q4_1 (4 bits,
        group 32), Q8_0 (8 bits, group 32, codes ``q + 128``) and Q4_K (4 bits, group 32:
        scale ``d * sc_j``, offset ``-dmin * m_j`` per sub-block), its scales and offsets
        in :func:`scale_dtype`; a :class:`GGUFBlockWeight` for Q5_K and Q6_K. The values
        Q4_0, Q4_1 and Q8_0 dequantize to equal gguf-py's exactly.
    Raises:
        QuantizedWeightError: as :func:`gguf_blocks`.
    """
    blocks = gguf_blocks(data, qtype, shape, name)
    t = ggml_type_name(qtype)
    n, k = (int(s) for s in shape)
    if raw or t not in WNA16_TYPES:
        return GGUFBlockWeight(blocks, t, k, name)
    ts = BLOCKS[t][1]
    bits = 8 if t == "Q8_0" else 4
    qweight = torch.empty(n, k * bits // 8, dtype=torch.uint8)
    scales = torch.empty(n, k // 32)
    offsets = torch.empty(n, k // 32)
    step = max(1, _CONVERT_BYTES // k)
    for r in range(0, n, step):
        e = min(n, r + step)
        packed, s, o = _wna16_parts(t, blocks[r:e].reshape(-1, ts))
        qweight[r:e] = packed.reshape(e - r, -1)
        scales[r:e] = s.reshape(e - r, -1)
        offsets[r:e] = o.reshape(e - r, -1)
    dt = scale_dtype(scales, offsets)
    return WNA16Weight(qweight, scales.to(dt), offsets.to(dt), bits, 32, k, name=name)


def gguf_tensor_weight(tensor: Any, name: str | None = None, raw: bool = False) -> QuantizedWeight:
    """:func:`gguf_weight` of a ``gguf.GGUFReader`` tensor (``.data``, ``.tensor_type``,
    ``.shape`` in ggml's order, ``.name``); ``name`` overrides the tensor's for errors."""
    return gguf_weight(tensor.data, tensor.tensor_type, [int(s) for s in reversed(list(tensor.shape))],
                       name or str(tensor.name), raw=raw)


def file_bytes(qtype: Any, shape: Sequence[int]) -> int:
    """Bytes a tensor of ``shape`` (any order) takes in a GGUF file as ``qtype``."""
    t = ggml_type_name(qtype)
    numel = 1
    for s in shape:
        numel *= int(s)
    if t in BLOCKS:
        bs, ts = BLOCKS[t]
        return numel // bs * ts
    return numel * {"F32": 4, "F16": 2, "BF16": 2}[t]


# --------------------------------------------------------------- the file's view
@dataclass(frozen=True)
class GGUFQuantization:
    """Which of a GGUF model's modules are served quantized, for the model builder (which
    modules become quantized linears and embeddings), logs and the format table.

    Attributes:
        modules: HF module name (``model.layers.0.self_attn.q_proj``, ``model.embed_tokens``,
            ``lm_head``) -> ggml type, for every weight the loader yields as a
            :class:`~kvpilot.engine.quantization.weights.QuantizedWeight`.
        tensor_types: every GGUF tensor name -> its ggml type (dense ones included).
    """

    method: ClassVar[str] = "gguf"
    modules: Mapping[str, str]
    tensor_types: Mapping[str, str]

    def is_quantized(self, module: str) -> bool:
        """Whether the loader yields ``module``'s weight quantized (a trailing
        ``.weight`` is ignored)."""
        return module.removesuffix(".weight") in self.modules

    def weight_type(self, module: str) -> str | None:
        """The ggml type of a quantized module's weight, None when it is dense."""
        return self.modules.get(module.removesuffix(".weight"))

    def type_counts(self) -> dict[str, int]:
        """ggml type -> how many of the file's tensors have it, most first."""
        return dict(Counter(self.tensor_types.values()).most_common())

    def summary(self) -> str:
        """One line for logs: ``gguf: 211 weights kept quantized (Q4_1 x210, Q8_0 x1); 61
        dense (F32 x61)``."""
        kept = Counter(self.modules.values())
        dense = Counter(t for n, t in self.tensor_types.items() if t in DENSE_TYPES)
        other = sum(self.type_counts().values()) - sum(dense.values()) - sum(kept.values())

        def fmt(c: Counter[str]) -> str:
            return ", ".join(f"{t} x{k}" for t, k in c.most_common())

        line = f"gguf: {sum(kept.values())} weights kept quantized ({fmt(kept)}); {sum(dense.values())} dense ({fmt(dense)})"
        if other:
            line += f"; {other} quantized tensors dequantized to float32 (MoE experts, routers)"
        return line
