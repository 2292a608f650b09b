"""A checkpoint's weight quantization, read from ``config.json``'s ``quantization_config``
(and vLLM's ``--quantization``), as one :class:`LinearScheme` per linear module.

Formats read (each as the library that writes it lays it out; every other value is
refused naming the key and value):

===================== ===================================================================
``quant_method``      what loads
===================== ===================================================================
compressed-tensors    llm-compressor's ``config_groups``: ``pack-quantized`` W4A16/W8A16
                      (group or channel, symmetric or not, act-order ``group``),
                      ``float-quantized`` FP8 (tensor/channel/block weights; dynamic
                      per-token, static per-tensor or no activation quantization),
                      ``int-quantized``/``naive-quantized`` INT8 W8A8 (channel weights,
                      symmetric dynamic per-token or static per-tensor activations)
gptq                  AutoGPTQ/GPTQModel, 4 or 8 bits, ``desc_act`` either way, v1 and v2
                      zero points
awq                   AutoAWQ ``version: gemm``, 4 bits
fp8                   transformers' / DeepSeek's block-wise FP8 (``weight_block_size``,
                      ``weight_scale_inv``) and per-tensor FP8 (``weight_scale``,
                      ``input_scale``); or, on an unquantized checkpoint, online FP8
===================== ===================================================================

GGUF files carry their types per tensor (:mod:`kvpilot.engine.quantization.gguf`).

Module names are the checkpoint's (``model.layers.0.self_attn.q_proj``, ``lm_head``).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.model.config import UnsupportedModelError
from kvpilot.flags.serve import QUANTIZATIONS

logger = logging.getLogger(__name__)

QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
"""vLLM's kernel names accepted as their format (kvpilot has one kernel per format)."""
QUANTIZATION_METHODS = tuple(q for q in QUANTIZATIONS if q not in QUANTIZATION_ALIASES)
"""The formats (``--quantization`` values without the aliases)."""


@dataclass(frozen=True)
class LinearScheme:
    """How one linear's weight (and activations) are quantized.

    Attributes:
        kind: ``wna16`` (integer weights, float activations), ``fp8`` or ``int8`` (W8A8).
        bits: weight bits (4 or 8).
        group_size: input columns per scale; None: one scale per output channel.
        symmetric: no zero point (``wna16``: zero is ``2**(bits - 1)``).
        act: ``none`` (weight-only), ``dynamic`` (per token) or ``static`` (per tensor).
        block: FP8 block-wise scales ``(rows, cols)``, else None.
        act_order: the weight's columns are permuted (GPTQ ``desc_act``, ``actorder: group``).
        per_tensor: FP8/INT8 weight scale is one value (expanded per channel at load).
        layout: the checkpoint's tensor layout: ``compressed-tensors``, ``gptq``, ``gptq_v2``,
            ``awq``, ``fp8`` or ``online`` (a dense weight quantized at load).
    """

    kind: str
    bits: int
    group_size: int | None = None
    symmetric: bool = True
    act: str = "none"
    block: tuple[int, int] | None = None
    act_order: bool = False
    per_tensor: bool = False
    layout: str = "compressed-tensors"

    def describe(self) -> str:
        """One line for logs and errors."""
        if self.kind == "wna16":
            group = "per-channel" if self.group_size is None else f"group {self.group_size}"
            sym = "symmetric" if self.symmetric else "asymmetric"
            return f"W{self.bits}A16 ({group}, {sym}{', act-order' if self.act_order else ''}; {self.layout})"
        scales = ("per-tensor" if self.per_tensor else "per-channel") if self.block is None else \
            f"{self.block[0]}x{self.block[1]} block"
        acts = "A16" if self.act == "none" else f"A8 {self.act}"
        return f"{self.kind.upper()} W8{acts} ({scales} weight scales; {self.layout})"


def _refuse(where: str, key: str, value: Any, allowed: str) -> UnsupportedModelError:
    """The error for ``quantization_config.<key> = value`` in file ``where``."""
    return UnsupportedModelError(f"{where}: quantization_config.{key} = {value!r} is not supported; "
                                 f"supported: {allowed}")


def _match(pattern: str, name: str) -> bool:
    """compressed-tensors' target rule: ``re:<regex>`` matched at the start of the name,
    else the exact module name or its last component (``lm_head``)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


class CheckpointQuantization:
    """A checkpoint's quantization: which linear modules are quantized, and how.

    Attributes:
        method: the ``--quantization`` name (``compressed-tensors``, ``gptq``, ``awq``, ``fp8``).
        online: dense weights are quantized at load (``--quantization fp8`` on an
            unquantized checkpoint).
    """

    method: str = ""
    online: bool = False

    def scheme_for(self, module: str) -> LinearScheme | None:
        """The scheme of linear ``module`` (checkpoint name), None when it is not quantized."""
        raise NotImplementedError

    def is_quantized(self, module: str) -> bool:
        return self.scheme_for(module) is not None

    def summary(self) -> str:
        """One line for the load log."""
        return self.method


# ------------------------------------------------------------------- compressed-tensors
_CT_FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")


class CompressedTensorsQuantization(CheckpointQuantization):
    """llm-compressor's ``quantization_config`` (``quant_method: compressed-tensors``).

    Raises (at construction):
        UnsupportedModelError: a key or value outside the formats in the module docstring,
            named with the key (``quantization_config.config_groups.group_0.weights.num_bits``)
            and what is allowed.
    """

    method = "compressed-tensors"

    def __init__(self, q: dict[str, Any], where: str) -> None:
        self.where = where
        top_format = q.get("format")
        status = q.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise self._refuse("quantization_status", status, "compressed (as llm-compressor saves a model)")
        sparsity = q.get("sparsity_config")
        if sparsity:
            raise self._refuse("sparsity_config", sparsity.get("format", sparsity) if isinstance(sparsity, dict)
                               else sparsity, "no sparsity (2:4 sparse checkpoints are not supported)")
        if q.get("transform_config"):
            raise self._refuse("transform_config", "(set)", "none (rotations/Hadamard transforms are not supported)")
        self.ignore: list[str] = list(q.get("ignore") or [])
        self.groups: list[tuple[list[str], LinearScheme]] = []
        groups = q.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise self._refuse("config_groups", groups, "one or more quantization groups")
        for gname, group in groups.items():
            key = f"config_groups.{gname}"
            fmt = group.get("format") or top_format
            if fmt not in _CT_FORMATS:
                raise self._refuse(f"{key}.format" if group.get("format") else "format", fmt,
                                   f"one of {', '.join(_CT_FORMATS)}")
            targets = group.get("targets") or []
            if not targets:
                raise self._refuse(f"{key}.targets", targets, "a list of module classes or names")
            self.groups.append((list(targets), self._scheme(group, key, fmt)))
        self.kv_cache_scheme = q.get("kv_cache_scheme")

    def _refuse(self, key: str, value: Any, allowed: str) -> UnsupportedModelError:
        return _refuse(self.where, key, value, allowed)

    def _scheme(self, group: dict[str, Any], key: str, fmt: str) -> LinearScheme:
        w = group.get("weights")
        if not isinstance(w, dict):
            raise self._refuse(f"{key}.weights", w, "a weight quantization (num_bits, type, strategy)")
        if group.get("output_activations"):
            raise self._refuse(f"{key}.output_activations", group["output_activations"], "null")
        bits, wtype, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy", "tensor")
        if w.get("dynamic"):
            raise self._refuse(f"{key}.weights.dynamic", w["dynamic"], "false (weights are quantized offline)")
        a = group.get("input_activations")
        act, a_group = "none", None
        if a:
            if a.get("num_bits") != 8 or a.get("type", "int") != wtype:
                raise self._refuse(f"{key}.input_activations", {k: a.get(k) for k in ("num_bits", "type")},
                                   f"8-bit activations of the weights' type ({wtype})")
            if not a.get("symmetric", True):
                raise self._refuse(f"{key}.input_activations.symmetric", a.get("symmetric"), "true")
            a_strategy = a.get("strategy", "tensor")
            if a.get("dynamic") in (True, "local") and a_strategy in ("token", "group"):
                act = "dynamic"
                a_group = a.get("group_size") if a_strategy == "group" else None
            elif not a.get("dynamic") and a_strategy == "tensor":
                act = "static"
            else:
                raise self._refuse(f"{key}.input_activations", {k: a.get(k) for k in ("strategy", "dynamic")},
                                   "dynamic per-token (or per-group with block weights) or static per-tensor")
        if strategy not in ("tensor", "channel", "group", "block"):
            raise self._refuse(f"{key}.weights.strategy", strategy, "tensor, channel, group or block")
        group_size = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
            raise self._refuse(f"{key}.weights.group_size", group_size, "a positive integer with strategy group")
        actorder = w.get("actorder")
        if actorder not in (None, "group", "weight", "static"):
            raise self._refuse(f"{key}.weights.actorder", actorder, "null, group, weight or static")
        if wtype == "float":
            if bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
                raise self._refuse(f"{key}.weights", {"type": wtype, "num_bits": bits, "format": fmt},
                                   "float weights of 8 bits (FP8 E4M3), format float-quantized")
            if not w.get("symmetric", True):
                raise self._refuse(f"{key}.weights.symmetric", w.get("symmetric"), "true for FP8")
            if strategy == "group":
                raise self._refuse(f"{key}.weights.strategy", strategy, "tensor, channel or block for FP8")
            block = None
            if strategy == "block":
                bs = w.get("block_structure")
                if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(v, int) and v > 0 for v in bs)):
                    raise self._refuse(f"{key}.weights.block_structure", bs, "[rows, cols] with strategy block")
                block = (bs[0], bs[1])
                if act == "dynamic" and a_group not in (None, block[1]):
                    raise self._refuse(f"{key}.input_activations.group_size", a_group,
                                       f"the weight block's columns ({block[1]})")
            elif act == "dynamic" and a_group is not None:
                raise self._refuse(f"{key}.input_activations.strategy", "group", "token with per-channel weights")
            return LinearScheme("fp8", 8, act=act, block=block, per_tensor=strategy == "tensor")
        if wtype != "int":
            raise self._refuse(f"{key}.weights.type", wtype, "int or float")
        if act != "none":  # INT8 W8A8
            if bits != 8 or strategy not in ("channel", "tensor"):
                raise self._refuse(f"{key}.weights", {"num_bits": bits, "strategy": strategy},
                                   "8-bit per-channel (or per-tensor) weights with int8 activations")
            if not w.get("symmetric", True):
                raise self._refuse(f"{key}.weights.symmetric", w.get("symmetric"), "true for INT8 W8A8")
            if fmt == "pack-quantized":
                raise self._refuse("format", fmt, "int-quantized or naive-quantized for INT8 W8A8")
            if a_group is not None:
                raise self._refuse(f"{key}.input_activations.strategy", "group", "token or tensor for INT8 W8A8")
            return LinearScheme("int8", 8, act=act, per_tensor=strategy == "tensor")
        if bits not in (4, 8):
            raise self._refuse(f"{key}.weights.num_bits", bits, "4 or 8 for integer weight-only quantization")
        if strategy not in ("group", "channel"):
            raise self._refuse(f"{key}.weights.strategy", strategy, "group or channel for integer weights")
        if fmt not in ("pack-quantized", "naive-quantized", "int-quantized"):
            raise self._refuse("format", fmt, "pack-quantized for W4A16/W8A16")
        return LinearScheme("wna16", bits, group_size, bool(w.get("symmetric", True)), act_order=actorder == "group",
                            layout="compressed-tensors" if fmt == "pack-quantized" else "compressed-tensors-int")

    def scheme_for(self, module: str) -> LinearScheme | None:
        if any(_match(p, module) for p in self.ignore):
            return None
        for targets, scheme in self.groups:
            for t in targets:
                if t == "Linear" or _match(t, module):
                    return scheme
        return None

    def summary(self) -> str:
        return "compressed-tensors: " + "; ".join(s.describe() for _, s in self.groups)


# ---------------------------------------------------------------------- GPTQ and AWQ
class GPTQQuantization(CheckpointQuantization):
    """AutoGPTQ / GPTQModel ``quant_method: gptq``: ``qweight``/``qzeros``/``scales``/``g_idx``."""

    method = "gptq"

    def __init__(self, q: dict[str, Any], where: str) -> None:
        refuse = functools.partial(_refuse, where)
        bits, group = q.get("bits"), q.get("group_size", 128)
        if bits not in (4, 8):
            raise refuse("bits", bits, "4 or 8")
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise refuse("group_size", group, "a positive integer or -1 (per channel)")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse("checkpoint_format", fmt, "gptq or gptq_v2")
        if q.get("dynamic"):
            raise refuse("dynamic", "(per-module overrides)", "none")
        if q.get("lm_head"):
            raise refuse("lm_head", q["lm_head"], "false (a quantized LM head)")
        self.scheme = LinearScheme("wna16", bits, None if group == -1 else group, bool(q.get("sym", True)),
                                   act_order=bool(q.get("desc_act", False)), layout=fmt)
        self.skip = list(q.get("modules_to_not_convert") or [])

    def scheme_for(self, module: str) -> LinearScheme | None:
        if module.endswith("lm_head") or module.endswith(".gate") or any(s in module for s in self.skip):
            return None  # GPTQ quantizes the decoder layers' projections, not the head or routers
        return self.scheme

    def summary(self) -> str:
        return "gptq: " + self.scheme.describe()


class AWQQuantization(GPTQQuantization):
    """AutoAWQ ``quant_method: awq``, ``version: gemm``: ``qweight``/``qzeros``/``scales``."""

    method = "awq"

    def __init__(self, q: dict[str, Any], where: str) -> None:
        refuse = functools.partial(_refuse, where)
        bits = q.get("bits", q.get("w_bit"))
        group = q.get("group_size", q.get("q_group_size", 128))
        version = str(q.get("version", "gemm")).lower()
        if bits != 4:
            raise refuse("bits", bits, "4")
        if version != "gemm":
            raise refuse("version", version, "gemm")
        if not isinstance(group, int) or group <= 0:
            raise refuse("group_size", group, "a positive integer")
        if not q.get("zero_point", True):
            raise refuse("zero_point", q.get("zero_point"), "true")
        self.scheme = LinearScheme("wna16", 4, group, symmetric=False, layout="awq")
        self.skip = list(q.get("modules_to_not_convert") or [])

    def summary(self) -> str:
        return "awq: " + self.scheme.describe()


# ------------------------------------------------------------------------------- FP8
class FP8Quantization(CheckpointQuantization):
    """``quant_method: fp8``: transformers' fine-grained FP8 (``weight_block_size`` and
    ``weight_scale_inv``, as DeepSeek-V3 and Qwen3 FP8 ship) or per-tensor FP8
    (``weight_scale``, ``input_scale`` with ``activation_scheme: static``); with
    ``online`` an unquantized checkpoint quantized at load (vLLM's ``--quantization fp8``)."""

    method = "fp8"

    def __init__(self, q: dict[str, Any], where: str, online: bool = False) -> None:
        refuse = functools.partial(_refuse, where)
        self.online = online
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise refuse("activation_scheme", scheme, "dynamic or static")
        block = q.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
                raise refuse("weight_block_size", block, "[rows, cols] of positive integers")
            if scheme != "dynamic":
                raise refuse("activation_scheme", scheme, "dynamic with weight_block_size")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise refuse("fmt", fmt, "e4m3")
        self.scheme = LinearScheme("fp8", 8, act=scheme, block=None if block is None else (block[0], block[1]),
                                   per_tensor=block is None, layout="online" if online else "fp8")
        self.skip = list(q.get("modules_to_not_convert") or q.get("ignored_layers") or [])

    def scheme_for(self, module: str) -> LinearScheme | None:
        if module.endswith("lm_head") or any(module == s or module.endswith("." + s) or s in module
                                             for s in self.skip):
            return None
        if self.online and module.endswith(".gate"):  # MoE routers stay in the model dtype
            return None
        return self.scheme

    def summary(self) -> str:
        return ("fp8 (online, per-channel): " if self.online else "fp8: ") + self.scheme.describe()


# ---------------------------------------------------------------------------- reading
def normalize_method(value: str | None) -> str | None:
    """A ``--quantization`` value with vLLM's kernel aliases folded (``gptq_marlin`` ->
    ``gptq``).

    Raises:
        UnsupportedModelError: a value outside :data:`QUANTIZATION_METHODS` and the aliases.
    """
    if value is None:
        return None
    v = QUANTIZATION_ALIASES.get(value, value)
    if v not in QUANTIZATION_METHODS:
        raise UnsupportedModelError(
            f"--quantization {value!r} is not supported; supported: "
            f"{', '.join(QUANTIZATIONS)}")
    return v


def read_quantization(cfg: dict[str, Any], where: str, requested: str | None = None) -> CheckpointQuantization | None:
    """The quantization of an HF checkpoint whose ``config.json`` is ``cfg``.

    Args:
        cfg: the parsed config.json.
        where: the file, for messages.
        requested: ``--quantization`` (None: the checkpoint's own). ``fp8`` on an
            unquantized checkpoint quantizes online; any other value must name the
            checkpoint's format.
    Returns:
        None for an unquantized checkpoint without ``--quantization``.
    Raises:
        UnsupportedModelError: an unsupported method or value (named), or
            ``--quantization`` that contradicts the checkpoint.
    """
    method = normalize_method(requested)
    q = cfg.get("quantization_config")
    if not q:
        if method is None:
            return None
        if method == "fp8":
            return FP8Quantization({"activation_scheme": "dynamic"}, where, online=True)
        raise UnsupportedModelError(
            f"--quantization {requested}: {where} has no quantization_config, and only fp8 quantizes an "
            "unquantized checkpoint at load")
    if not isinstance(q, dict):
        raise UnsupportedModelError(f"{where}: quantization_config = {q!r} is not supported; an object")
    found = q.get("quant_method")
    if method is not None and method != found:
        raise UnsupportedModelError(
            f"--quantization {requested} does not match {where}: quantization_config.quant_method = {found!r}")
    if found == "compressed-tensors":
        return CompressedTensorsQuantization(q, where)
    if found == "gptq":
        return GPTQQuantization(q, where)
    if found == "awq":
        return AWQQuantization(q, where)
    if found == "fp8":
        return FP8Quantization(q, where)
    raise UnsupportedModelError(
        f"{where}: quantization_config.quant_method = {found!r} is not supported; supported: "
        f"{', '.join(m for m in QUANTIZATION_METHODS if m != 'gguf')} (and GGUF files)")


def load_quantization(source: Any, gguf_file: Any, requested: str | None,
                      load_format: str = "auto") -> CheckpointQuantization | None:
    """The quantization of a resolved model source
    (:class:`~kvpilot.engine.model.loader.ModelSource`): an HF folder's
    ``quantization_config`` (:func:`read_quantization`), a GGUF file's tensor types (its
    :class:`~kvpilot.engine.model.loader.GGUFModelFile`'s ``quantization()``), or none.

    Raises:
        UnsupportedModelError: ``--quantization`` that does not match the source, or a
            config value that is not supported (named).
    """
    method = normalize_method(requested)
    if source.kind == "gguf":
        if method not in (None, "gguf"):
            raise UnsupportedModelError(f"--quantization {requested} does not match {source.path}: a GGUF file "
                                        "carries its own types (gguf)")
        reader = getattr(gguf_file, "quantization", None)
        return None if reader is None else reader()
    if method == "gguf":
        raise UnsupportedModelError(f"--quantization gguf: {source.path} is not a GGUF file")
    if source.kind == "preset" or load_format == "dummy":
        if method is not None:
            raise UnsupportedModelError(f"--quantization {requested} with --load-format dummy / a preset is not "
                                        "supported: quantized weights come from a checkpoint")
        return None
    import json

    where = source.path / "config.json"
    return read_quantization(json.loads(where.read_text()), str(where), requested)


def schemes_of(quant: CheckpointQuantization, modules: Iterable[str]) -> dict[str, LinearScheme | None]:
    """``{module: scheme}`` for a list of checkpoint module names (for the load log)."""
    return {m: quant.scheme_for(m) for m in modules}
