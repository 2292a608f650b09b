"""Turning a quantized checkpoint's tensors into the canonical layouts of
:mod:`kvpilot.engine.quantization.weights`.

:func:`group_quantized` sits between the safetensors reader and a model's
``load_weights``: tensors of modules the checkpoint leaves unquantized pass through; the
parts of each quantized module (``weight_packed``, ``weight_scale``, ``qweight``,
``qzeros``, ...) are collected and converted, once all are read, into one
:class:`~kvpilot.engine.quantization.weights.QuantizedWeight` emitted as
``<module>.weight``. A part missing at the end, or a part whose shape or dtype does not
fit, is refused naming the tensor.

Layouts (the libraries' own code is the source of each):

- compressed-tensors ``pack-quantized``: ``weight_packed`` int32 ``[N, ceil(K * bits / 32)]``,
  signed values plus ``2**(bits - 1)``, packed densely from bit 0 (``pack_to_int32``: for 4
  and 8 bits the little-endian bytes are the canonical layout already); ``weight_scale``
  ``[N, K / g]`` (``[N, 1]`` per channel); ``weight_zero_point`` int32 packed along the
  output dimension (``packed_dim=0``); ``weight_shape`` ``[N, K]``; ``weight_g_idx`` ``[K]``.
  ``w = (q - z) * s``.
- compressed-tensors ``float-quantized`` / ``int-quantized`` / ``naive-quantized``:
  ``weight`` (float8_e4m3fn or int8) ``[N, K]``, ``weight_scale`` ``[N, 1]``, ``[1]`` or
  ``[N / bn, K / bk]``, ``input_scale`` ``[1]`` when static.
- GPTQ (AutoGPTQ v1, GPTQModel v2): ``qweight`` int32 ``[K * bits / 32, N]`` packed along
  ``K``; ``qzeros`` int32 ``[K / g, N * bits / 32]`` packed along ``N``, storing
  ``zero - 1`` in v1; ``scales`` ``[K / g, N]``; ``g_idx`` ``[K]``. ``w = (q - z) * s``.
- AWQ GEMM: ``qweight`` int32 ``[K, N / 8]`` packed along ``N`` in the order
  ``0, 2, 4, 6, 1, 3, 5, 7``; ``qzeros`` the same ``[K / g, N / 8]``; ``scales`` ``[K / g, N]``.
- transformers ``fp8``: ``weight`` float8_e4m3fn, ``weight_scale_inv`` ``[N / bn, K / bk]``
  (block; despite the name the weight is multiplied by it) or ``weight_scale`` and
  ``input_scale`` scalars (per-tensor).

Act-order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``): ``g_idx[k]`` is
column ``k``'s group. The columns are sorted by group at load (a stable sort: each group
must then be ``g`` consecutive columns, else the checkpoint is refused) and the layer
permutes its input the same way (ExLlama's and vLLM's reordering).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kvpilot.engine.quantization.config import CheckpointQuantization, LinearScheme
from kvpilot.engine.quantization.weights import (
    FP8Weight,
    Int8Weight,
    QuantizedWeight,
    QuantizedWeightError,
    WNA16Weight,
    quantize_fp8_weight,
)

PARTS = frozenset({
    "weight", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
    "input_scale", "input_zero_point", "qweight", "qzeros", "scales", "g_idx", "weight_scale_inv",
})
"""Tensor suffixes that belong to a quantized linear (``bias`` stays the model's)."""

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def required_parts(scheme: LinearScheme) -> frozenset[str]:
    """The tensors a module of ``scheme`` must have (optional ones are taken when present)."""
    layout = scheme.layout
    if layout == "online":
        need = {"weight"}
    elif layout in ("gptq", "gptq_v2", "awq"):
        need = {"qweight", "qzeros", "scales"} | ({"g_idx"} if scheme.act_order else set())
    elif layout == "fp8":
        need = {"weight", "weight_scale" if scheme.block is None else "weight_scale_inv"}
    elif layout == "compressed-tensors" and scheme.kind == "wna16":
        need = {"weight_packed", "weight_scale", "weight_shape"}
        need |= set() if scheme.symmetric else {"weight_zero_point"}
        need |= {"weight_g_idx"} if scheme.act_order else set()
    else:
        need = {"weight", "weight_scale"}
        if scheme.kind == "wna16" and not scheme.symmetric:
            need.add("weight_zero_point")
    if scheme.act == "static":
        need.add("input_scale")
    return frozenset(need)


def group_quantized(weights: Iterator[tuple[str, torch.Tensor]], quant: CheckpointQuantization,
                    modules: set[str]) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Pass unquantized tensors through; convert each quantized module's parts into one
    ``(<module>.weight, QuantizedWeight)``, after the last tensor is read (a module's
    parts may sit in different safetensors shards).

    Args:
        weights: ``(checkpoint name, tensor)`` pairs.
        quant: the checkpoint's quantization.
        modules: the checkpoint modules the model built quantized (its linears; norms and
            other tensors named ``weight`` pass through).
    Raises:
        QuantizedWeightError: a module missing a part (named), parts that do not fit, or
            quantized parts of a module the model keeps dense (MoE experts).
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if module not in modules or part not in PARTS:
            if part in PARTS and part != "weight" and quant.scheme_for(module) is not None:
                raise QuantizedWeightError(
                    f"{name}: a quantized tensor of {module}, which kvpilot keeps in the model dtype (quantized "
                    "MoE experts are not supported yet: keep them unquantized in the checkpoint)")
            yield name, tensor
            continue
        pending.setdefault(module, {})[part] = tensor
    for module, parts in pending.items():
        scheme = quant.scheme_for(module)
        if scheme is None:
            raise QuantizedWeightError(f"{module}: the model holds it quantized but the checkpoint's quantization "
                                       f"config does not quantize it ({', '.join(sorted(parts))})")
        missing = sorted(required_parts(scheme) - parts.keys())
        if missing:
            raise QuantizedWeightError(
                f"{module}.{missing[0]}: missing from the checkpoint; {module} is {scheme.describe()} and needs "
                f"{', '.join(sorted(required_parts(scheme)))} (found {', '.join(sorted(parts))})")
        yield f"{module}.weight", convert(module, parts, scheme)


def convert(module: str, parts: dict[str, torch.Tensor], scheme: LinearScheme) -> QuantizedWeight:
    """One module's checkpoint tensors -> its canonical weight.

    Args:
        module: the checkpoint module name (for errors).
        parts: suffix -> tensor (``weight_packed``, ``weight_scale``, ...).
        scheme: from the checkpoint's config.
    Raises:
        QuantizedWeightError: naming the tensor whose shape, dtype or values do not fit.
    """
    layout = scheme.layout
    if layout == "online":
        return quantize_fp8_weight(parts["weight"], name=f"{module}.weight")
    if layout in ("gptq", "gptq_v2"):
        return _gptq(module, parts, scheme)
    if layout == "awq":
        return _awq(module, parts, scheme)
    if scheme.kind == "fp8":
        return _fp8(module, parts, scheme)
    if scheme.kind == "int8":
        return _int8(module, parts, scheme)
    if layout == "compressed-tensors":
        return _ct_packed(module, parts, scheme)
    return _ct_unpacked(module, parts, scheme)


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise QuantizedWeightError(f"{name}: {message}")


def _dtype(t: torch.Tensor, name: str, *allowed: torch.dtype) -> None:
    _check(t.dtype in allowed, name, f"dtype {t.dtype}; expected {' or '.join(str(d) for d in allowed)}")


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` (values < 16) -> the canonical 4-bit bytes ``[N, K / 2]``."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Bytes ``[R, C]`` -> codes ``[R, 2C]`` (low nibble first)."""
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], -1)


def _int32_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """An int32 tensor's little-endian bytes, ``[R, 4 * C]`` uint8."""
    _dtype(t, name, torch.int32)
    _check(t.dim() == 2, name, f"shape {tuple(t.shape)}; expected 2-D")
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def _codes_from_bytes(b: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """uint8 codes ``[R, count]`` from rows of packed bytes (4 or 8 bits)."""
    return (_unpack_nibbles(b) if bits == 4 else b)[:, :count]


def _act_order(g_idx: torch.Tensor, k: int, group: int, name: str) -> torch.Tensor | None:
    """The column permutation that makes ``g_idx``'s groups contiguous, None when it is
    the identity.

    Raises:
        QuantizedWeightError: ``g_idx`` of the wrong length, or groups not of ``group``
            columns each.
    """
    _check(tuple(g_idx.shape) == (k,), name, f"shape {tuple(g_idx.shape)}; expected [{k}]")
    g = g_idx.to(torch.int64)
    perm = torch.sort(g, stable=True).indices
    want = torch.arange(k) // group
    _check(torch.equal(g[perm], want), name,
           f"groups are not {group} columns each (act-order needs equal groups; found group sizes "
           f"{torch.bincount(g).tolist()[:8]}...)")
    return None if torch.equal(perm, torch.arange(k)) else perm


def _wna16(module: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | float, bits: int,
           group: int, perm: torch.Tensor | None) -> WNA16Weight:
    """Canonical WNA16 from codes ``[N, K]`` uint8, scales ``[N, G]`` and unsigned zero
    points (``[N, G]`` or one number): ``w = (q - z) * s``."""
    n, k = codes.shape
    if perm is not None:
        codes = codes[:, perm]
    qweight = _pack_nibbles(codes) if bits == 4 else codes.contiguous()
    s = scales.contiguous()
    z = zeros.to(torch.float32) if isinstance(zeros, torch.Tensor) else torch.tensor(float(zeros))
    offsets = (-(z * s.float())).to(s.dtype)
    return WNA16Weight(qweight, s, offsets.expand(n, s.shape[1]).contiguous(), bits, group, k, perm,
                       f"{module}.weight")


def _ct_packed(module: str, p: dict[str, torch.Tensor], scheme: LinearScheme) -> WNA16Weight:
    bits = scheme.bits
    shape = p["weight_shape"].reshape(-1).tolist()
    _check(len(shape) == 2, f"{module}.weight_shape", f"{shape}; expected [out, in]")
    n, k = (int(v) for v in shape)
    packed = p["weight_packed"]
    words = math.ceil(k * bits / 32)
    _check(tuple(packed.shape) == (n, words), f"{module}.weight_packed",
           f"shape {tuple(packed.shape)} does not match weight_shape {[n, k]} at {bits} bits: expected [{n}, {words}]")
    _check(bits == 8 or k % 2 == 0, f"{module}.weight_shape", f"{[n, k]}: 4-bit rows need an even input dimension")
    codes = _codes_from_bytes(_int32_bytes(packed, f"{module}.weight_packed"), bits, k)
    group = scheme.group_size or k
    _check(k % group == 0, module, f"group size {group} does not divide the input dimension {k}")
    scale = p["weight_scale"]
    _check(tuple(scale.shape) == (n, k // group), f"{module}.weight_scale",
           f"shape {tuple(scale.shape)} does not match the weight {[n, k]} with group size {group}: "
           f"expected [{n}, {k // group}]")
    zeros: torch.Tensor | float = float(1 << (bits - 1))
    if not scheme.symmetric:
        zp = p["weight_zero_point"]
        name = f"{module}.weight_zero_point"
        want = (math.ceil(n * bits / 32), k // group)
        _check(tuple(zp.shape) == want, name, f"shape {tuple(zp.shape)}; expected {list(want)} (packed along "
                                              "the output dimension)")
        zeros = _codes_from_bytes(_int32_bytes(zp.t(), name), bits, n).t()
    perm = _act_order(p["weight_g_idx"], k, group, f"{module}.weight_g_idx") if scheme.act_order else None
    return _wna16(module, codes, scale, zeros, bits, group, perm)


def _ct_unpacked(module: str, p: dict[str, torch.Tensor], scheme: LinearScheme) -> WNA16Weight:
    """compressed-tensors' int8 weights stored one per byte (``naive-quantized``)."""
    w = p["weight"]
    _dtype(w, f"{module}.weight", torch.int8)
    _check(scheme.bits == 8, f"{module}.weight", f"{scheme.bits}-bit weights stored unpacked; expected 8")
    n, k = w.shape
    group = scheme.group_size or k
    _check(k % group == 0, module, f"group size {group} does not divide the input dimension {k}")
    scale = p["weight_scale"]
    _check(tuple(scale.shape) == (n, k // group), f"{module}.weight_scale",
           f"shape {tuple(scale.shape)} does not match the weight {[n, k]}: expected [{n}, {k // group}]")
    codes = (w.to(torch.int16) + 128).to(torch.uint8)
    zeros: torch.Tensor | float = 128.0
    if not scheme.symmetric:
        zp = p["weight_zero_point"]
        _check(tuple(zp.shape) == (n, k // group), f"{module}.weight_zero_point",
               f"shape {tuple(zp.shape)}; expected [{n}, {k // group}]")
        zeros = zp.to(torch.float32) + 128.0
    return _wna16(module, codes, scale, zeros, 8, group, None)


def _scalar(t: torch.Tensor, name: str) -> float:
    _check(t.numel() == 1, name, f"shape {tuple(t.shape)}; expected one value (per-tensor)")
    v = float(t.float().reshape(-1)[0])
    _check(math.isfinite(v) and v > 0, name, f"value {v}; expected a positive finite scale")
    return v


def _channel_scale(t: torch.Tensor, n: int, per_tensor: bool, name: str) -> torch.Tensor:
    """A weight scale as ``[N]`` float32 (a per-tensor one expanded)."""
    if per_tensor or t.numel() == 1:
        return torch.full((n,), _scalar(t, name))
    _check(tuple(t.shape) in ((n,), (n, 1)), name, f"shape {tuple(t.shape)} does not match the weight's {n} rows: "
                                                   f"expected [{n}, 1]")
    return t.reshape(n).float()


def _fp8(module: str, p: dict[str, torch.Tensor], scheme: LinearScheme) -> FP8Weight:
    w = p["weight"]
    _dtype(w, f"{module}.weight", torch.float8_e4m3fn)
    _check(w.dim() == 2, f"{module}.weight", f"shape {tuple(w.shape)}; expected [out, in]")
    n, k = w.shape
    if scheme.block is not None:
        key = "weight_scale_inv" if scheme.layout == "fp8" else "weight_scale"
        scale = p[key].float()
        bn, bk = scheme.block
        want = (math.ceil(n / bn), math.ceil(k / bk))
        _check(tuple(scale.shape) == want, f"{module}.{key}",
               f"shape {tuple(scale.shape)} does not match the weight {[n, k]} in {bn}x{bk} blocks: "
               f"expected {list(want)}")
    else:
        scale = _channel_scale(p["weight_scale"], n, scheme.per_tensor, f"{module}.weight_scale")
    inp = _scalar(p["input_scale"], f"{module}.input_scale") if scheme.act == "static" else None
    return FP8Weight(w.contiguous(), scale, scheme.act, inp, scheme.block, f"{module}.weight")


def _int8(module: str, p: dict[str, torch.Tensor], scheme: LinearScheme) -> Int8Weight:
    w = p["weight"]
    _dtype(w, f"{module}.weight", torch.int8)
    n = w.shape[0]
    for zp in ("weight_zero_point", "input_zero_point"):
        if zp in p:
            _check(not bool(p[zp].any()), f"{module}.{zp}", "nonzero zero points; INT8 W8A8 is symmetric")
    scale = _channel_scale(p["weight_scale"], n, scheme.per_tensor, f"{module}.weight_scale")
    inp = _scalar(p["input_scale"], f"{module}.input_scale") if scheme.act == "static" else None
    return Int8Weight(w.contiguous(), scale, scheme.act, inp, f"{module}.weight")


def _gptq(module: str, p: dict[str, torch.Tensor], scheme: LinearScheme) -> WNA16Weight:
    bits = scheme.bits
    qweight, scales, qzeros = p["qweight"], p["scales"], p["qzeros"]
    per_word = 32 // bits
    _dtype(qweight, f"{module}.qweight", torch.int32)
    _check(qweight.dim() == 2, f"{module}.qweight", f"shape {tuple(qweight.shape)}; expected [in * {bits} / 32, out]")
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    group = scheme.group_size or k
    _check(k % group == 0, module, f"group size {group} does not divide the input dimension {k}")
    groups = k // group
    _check(tuple(scales.shape) == (groups, n), f"{module}.scales",
           f"shape {tuple(scales.shape)} does not match qweight {tuple(qweight.shape)} (in {k}, out {n}, group "
           f"size {group}): expected [{groups}, {n}]")
    _check(tuple(qzeros.shape) == (groups, n // per_word), f"{module}.qzeros",
           f"shape {tuple(qzeros.shape)}; expected [{groups}, {n // per_word}]")
    codes = _codes_from_bytes(_int32_bytes(qweight.t(), f"{module}.qweight"), bits, k)  # [N, K]
    zeros = _codes_from_bytes(_int32_bytes(qzeros, f"{module}.qzeros"), bits, n).t().float()  # [N, G]
    if scheme.layout == "gptq":
        zeros = zeros + 1.0  # v1 stores zero - 1 (AutoGPTQ's dequantization adds it back)
    perm = None
    if "g_idx" in p:
        perm = _act_order(p["g_idx"], k, group, f"{module}.g_idx")
    return _wna16(module, codes, scales.t(), zeros, bits, group, perm)


def _awq(module: str, p: dict[str, torch.Tensor], scheme: LinearScheme) -> WNA16Weight:
    qweight, scales, qzeros = p["qweight"], p["scales"], p["qzeros"]
    _dtype(qweight, f"{module}.qweight", torch.int32)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = scheme.group_size or k
    _check(k % group == 0, module, f"group size {group} does not divide the input dimension {k}")
    groups = k // group
    _check(tuple(scales.shape) == (groups, n), f"{module}.scales",
           f"shape {tuple(scales.shape)} does not match qweight {tuple(qweight.shape)} (in {k}, out {n}): "
           f"expected [{groups}, {n}]")
    _check(tuple(qzeros.shape) == (groups, n // 8), f"{module}.qzeros",
           f"shape {tuple(qzeros.shape)}; expected [{groups}, {n // 8}]")

    def unpack(t: torch.Tensor) -> torch.Tensor:
        nib = torch.stack([(t >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # nibble i = column _AWQ_ORDER[i]
        cols = torch.empty_like(nib)
        cols[..., list(_AWQ_ORDER)] = nib
        return cols.reshape(t.shape[0], -1).to(torch.uint8)

    _dtype(qzeros, f"{module}.qzeros", torch.int32)
    codes = unpack(qweight).t().contiguous()  # [N, K]
    zeros = unpack(qzeros).t().float()  # [N, G]
    return _wna16(module, codes, scales.t(), zeros, 4, group, None)

