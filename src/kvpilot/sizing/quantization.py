"""Weight bytes of quantized checkpoints (standard library only).

A quantized checkpoint stores the weights of its linear layers (attention q/k/v/o, the MLP
or the experts) in fewer bits, plus scales (and zero points) shared by a group of
weights. The rest stays in the model dtype: embeddings, the LM head, norms, biases and a
MoE router, except in GGUF, which quantizes the embeddings and the LM head too.
:data:`WEIGHT_FORMATS` is the table, one :class:`WeightFormat` per format, named as
``kvpilot kv-calc --quantization`` and the operator's ``spec.model.quantization`` take
them; :attr:`WeightFormat.vllm` is vLLM's ``--quantization`` value for the engine.

Bytes of one quantized ``[out_features, in_features]`` weight
(:meth:`WeightFormat.linear_bytes`)::

    in x out x bits / 8  +  scales x (scale_bytes + zero_bits / 8)

    scales = 1                          per tensor
           = out                        per output channel (row)
           = out x cdiv(in, group)      per group of ``group`` weights along a row
           = cdiv(out, b) x cdiv(in, b) per b x b block

So W4A16 at group 128 with a bf16 scale is 4 + 16/128 = 4.125 bits per weight; GPTQ and
AWQ 4-bit at group 128 add a packed 4-bit zero point: 4 + 20/128 = 4.15625; FP8 per
channel is 8 bits plus an fp32 scale per row, 8 + 32/in (8.0078 for in = 4096). GGUF's
block formats fit the same form, their per-block bytes (scales, mins) as the scale:
Q8_0 8.5, Q4_0 4.5, Q4_1 5.0, Q4_K 4.5, Q5_K 5.5 and Q6_K 6.5625 bits per weight.

What is counted is the checkpoint's layout as the engine keeps it: scales are fp32 where
vLLM keeps them so (FP8 and INT8 per-tensor/per-channel/per-block), the stored dtype
elsewhere (bf16 for compressed-tensors groups, fp16 for GPTQ and AWQ). Not counted: GPTQ's
``g_idx`` (one int32 per input row, under 0.01 bit per weight) and activation scales
(a few bytes per layer).

:func:`weight_bytes` adds up a model; :func:`format_from_hf_config` names the format of a
HF ``config.json``'s ``quantization_config``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO", "VLLM_QUANTIZATIONS", "WEIGHT_FORMATS", "WeightBytes", "WeightFormat",
           "format_from_hf_config", "weight_bytes", "weight_format"]

# "Read the format from the checkpoint": kv-calc's default (the preset's or the folder's
# format, else none) and spec.model.quantization's.
AUTO = "auto"
SCHEMES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class WeightFormat:
    """How one format stores a linear layer's weight.

    Attributes:
        name: kvpilot's name (``--quantization`` of kv-calc, ``spec.model.quantization``).
        vllm: vLLM's ``--quantization`` value for a checkpoint in this format.
        bits: bits per stored weight value.
        scheme: what shares a scale: ``tensor``, ``channel`` (an output row), ``group``
            (``group`` weights along a row) or ``block`` (a ``group`` x ``group`` tile).
        group: weights per group, or the block's edge.
        scale_bytes: bytes of scale (and, for GGUF, of mins and sub-block scales) per
            scale.
        zero_bits: bits of zero point per scale (GPTQ and AWQ pack one per group).
        quantizes_embeddings: the token embeddings and the LM head are stored in the
            format too (GGUF); otherwise they stay in the model dtype.
        summary: one line for the docs and ``kv-calc --list``.
    """

    name: str
    vllm: str
    bits: int
    scheme: str
    group: int = 0
    scale_bytes: int = 0
    zero_bits: int = 0
    quantizes_embeddings: bool = False
    summary: str = ""

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES or (self.scheme in ("group", "block")) != (self.group > 0):
            raise ValueError(f"weight format {self.name!r}: scheme {self.scheme!r} with"
                             f" group {self.group}")  # pragma: no cover - a table typo

    def scales(self, in_features: int, out_features: int) -> int:
        """Scales (and zero points) of one ``[out_features, in_features]`` weight."""
        if self.scheme == "tensor":
            return 1
        if self.scheme == "channel":
            return out_features
        if self.scheme == "group":
            return out_features * math.ceil(in_features / self.group)
        return math.ceil(out_features / self.group) * math.ceil(in_features / self.group)

    def linear_bytes(self, in_features: int, out_features: int) -> float:
        """Bytes of one ``[out_features, in_features]`` weight: the values plus the
        scales and zero points."""
        values = in_features * out_features * self.bits / 8
        return values + self.scales(in_features, out_features) * (self.scale_bytes
                                                                   + self.zero_bits / 8)

    def bits_per_weight(self, in_features: int, out_features: int) -> float:
        """Stored bits per weight of one ``[out_features, in_features]`` weight, scales
        and zero points included."""
        return self.linear_bytes(in_features, out_features) * 8 / (in_features * out_features)


def _ct(name: str, bits: int, scheme: str, group: int, scale_bytes: int, summary: str) -> WeightFormat:
    return WeightFormat(name, "compressed-tensors", bits, scheme, group, scale_bytes,
                        summary=summary)


def _gguf(name: str, bits: int, block: int, block_bytes: int, summary: str) -> WeightFormat:
    return WeightFormat(f"gguf-{name}", "gguf", bits, "group", block, block_bytes,
                        quantizes_embeddings=True, summary=summary)


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("fp8", "fp8", 8, "tensor", scale_bytes=4,
                     summary="FP8 E4M3, one fp32 scale per tensor (vLLM's fp8: a checkpoint"
                     " serialized per tensor, or one quantized at load)"),
        WeightFormat("fp8-block128", "fp8", 8, "block", 128, 4,
                     summary="FP8 E4M3, one fp32 scale per 128x128 block (transformers'"
                     " fp8 with weight_block_size [128, 128]: Qwen3-FP8, DeepSeek-V3)"),
        _ct("w8a8-fp8", 8, "tensor", 0, 4,
            "compressed-tensors FP8 E4M3, one fp32 scale per tensor (W8A8 or W8A16)"),
        _ct("w8a8-fp8-channel", 8, "channel", 0, 4,
            "compressed-tensors FP8 E4M3, one fp32 scale per output channel (FP8 dynamic)"),
        _ct("w8a8-int8", 8, "channel", 0, 4,
            "compressed-tensors INT8, one fp32 scale per output channel (W8A8 or W8A16)"),
        *(_ct(f"w{bits}a16-g{group}", bits, "group", group, 2,
              f"compressed-tensors pack-quantized INT{bits}, symmetric, one bf16 scale per"
              f" {group} weights")
          for bits in (4, 8) for group in (32, 64, 128)),
        WeightFormat("gptq-int4", "gptq", 4, "group", 128, 2, 4,
                     summary="GPTQ 4-bit, one fp16 scale and one packed 4-bit zero per 128"
                     " weights"),
        WeightFormat("gptq-int8", "gptq", 8, "group", 128, 2, 8,
                     summary="GPTQ 8-bit, one fp16 scale and one packed 8-bit zero per 128"
                     " weights"),
        WeightFormat("awq", "awq", 4, "group", 128, 2, 4,
                     summary="AWQ 4-bit, one fp16 scale and one packed 4-bit zero per 128"
                     " weights"),
        _gguf("q8_0", 8, 32, 2, "GGUF Q8_0: blocks of 32, an fp16 scale each (8.5 bits)"),
        _gguf("q4_0", 4, 32, 2, "GGUF Q4_0: blocks of 32, an fp16 scale each (4.5 bits)"),
        _gguf("q4_1", 4, 32, 4, "GGUF Q4_1: blocks of 32, an fp16 scale and min each (5.0 bits)"),
        _gguf("q4_k", 4, 256, 16, "GGUF Q4_K: super-blocks of 256, 16 B of scales and mins"
              " each (4.5 bits)"),
        _gguf("q5_k", 5, 256, 16, "GGUF Q5_K: super-blocks of 256, 16 B of scales and mins"
              " each (5.5 bits)"),
        _gguf("q6_k", 6, 256, 18, "GGUF Q6_K: super-blocks of 256, 18 B of scales each"
              " (6.5625 bits)"),
    )
}
# vLLM's --quantization values the table maps to.
VLLM_QUANTIZATIONS: tuple[str, ...] = tuple(dict.fromkeys(f.vllm for f in WEIGHT_FORMATS.values()))


def weight_format(name: str, what: str = "quantization") -> WeightFormat:
    """Look a format up by name; ValueError names ``what`` (the flag or field), the value
    and the allowed names."""
    try:
        return WEIGHT_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{what} must be one of {', '.join(WEIGHT_FORMATS)}; got {name!r}") from None


@dataclass(frozen=True)
class WeightBytes:
    """A model's weights in memory, by part.

    Attributes:
        quantization: the format's name, or None for the model dtype throughout.
        linear_params, linear_bytes: the linear layers a format quantizes.
        embedding_params, embedding_bytes: token embeddings and LM head (one tensor when
            tied).
        other_params, other_bytes: the rest (norms, biases, a MoE router), in the model
            dtype.
    """

    quantization: str | None
    linear_params: int
    linear_bytes: float
    embedding_params: int
    embedding_bytes: float
    other_params: int
    other_bytes: float

    @property
    def total(self) -> float:
        return self.linear_bytes + self.embedding_bytes + self.other_bytes

    @property
    def linear_bits_per_weight(self) -> float:
        """Stored bits per weight of the linear layers, scales and zero points included."""
        return self.linear_bytes * 8 / self.linear_params if self.linear_params else 0.0


Layers = Iterable[tuple[int, int, int]]


def _bytes(layers: Layers, fmt: WeightFormat | None, dtype_bytes: float) -> tuple[int, float]:
    params, total = 0, 0.0
    for in_features, out_features, count in layers:
        params += in_features * out_features * count
        if fmt is None:
            total += in_features * out_features * count * dtype_bytes
        else:
            total += fmt.linear_bytes(in_features, out_features) * count
    return params, total


def weight_bytes(linear_layers: Layers, embedding_layers: Layers, other_params: int,
                 dtype_bytes: float, quantization: str | None = None) -> WeightBytes:
    """A model's weight bytes: ``linear_layers`` in the format named ``quantization``,
    ``embedding_layers`` too when the format quantizes embeddings (else in the model
    dtype), ``other_params`` in the model dtype (``dtype_bytes`` per parameter). Layers
    are ``(in_features, out_features, count)``. Raises ValueError on an unknown name."""
    fmt = None if quantization is None else weight_format(quantization)
    if other_params < 0:
        raise ValueError(f"other_params must be >= 0; got {other_params}")
    linear_params, linear = _bytes(linear_layers, fmt, dtype_bytes)
    emb_fmt = fmt if fmt is not None and fmt.quantizes_embeddings else None
    embedding_params, embedding = _bytes(embedding_layers, emb_fmt, dtype_bytes)
    return WeightBytes(quantization, linear_params, linear, embedding_params, embedding,
                       other_params, other_params * dtype_bytes)


def _compressed_tensors(qc: Mapping[str, Any]) -> str | None:
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, Mapping)]
    schemes = {repr(g.get("weights")) for g in groups}
    if len(schemes) != 1:
        return None  # none, or a mix of schemes by layer
    w = groups[0].get("weights")
    if not isinstance(w, Mapping):
        return None  # activations only
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if not w.get("symmetric", True):
        return None  # asymmetric: zero points the table does not count
    if kind == "float" and bits == 8 and strategy in ("tensor", "channel"):
        return "w8a8-fp8" if strategy == "tensor" else "w8a8-fp8-channel"
    if kind == "int" and bits == 8 and strategy == "channel":
        return "w8a8-int8"
    if kind == "int" and bits in (4, 8) and strategy == "group":
        name = f"w{bits}a16-g{w.get('group_size')}"
        return name if name in WEIGHT_FORMATS else None
    return None


def format_from_hf_config(qc: Mapping[str, Any]) -> str | None:
    """The name of the format a HF ``config.json``'s ``quantization_config`` describes,
    or None when it is none of the table's: transformers' ``fp8`` (per tensor, or blocks
    of 128x128), compressed-tensors (one symmetric weight scheme for every group: FP8 or
    INT8 per tensor or channel, INT4/INT8 in groups of 32, 64 or 128), GPTQ 4/8-bit and
    AWQ 4-bit at group 128."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            return "fp8"
        return "fp8-block128" if list(block) == [128, 128] else None
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    bits, group = qc.get("bits"), qc.get("group_size")
    if method == "gptq" and bits in (4, 8) and group == 128:
        return f"gptq-int{bits}"
    if method == "awq" and bits == 4 and group == 128 and qc.get("zero_point", True):
        return "awq"
    return None
