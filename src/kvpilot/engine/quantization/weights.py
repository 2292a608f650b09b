"""Quantized weight matrices in the engine's canonical layouts, and their products.

A checkpoint's quantized linear (compressed-tensors, GPTQ, AWQ, transformers ``fp8``,
GGUF) is converted once, at load, into one of these classes; a model's
:class:`~kvpilot.engine.model.layers.QuantizedLinear` holds it and calls
:meth:`QuantizedWeight.linear`. Every class stores one ``[N, K]`` matrix (``N`` output
rows, ``K`` input columns) and knows three things: its product with activations, its
dequantized rows (for references, embeddings and tests), and its resident bytes.

Canonical layouts (what :mod:`kvpilot.kernels.quant_gemm`'s CUDA kernels read):

``WNA16Weight`` (integer weights, float activations: GPTQ, AWQ, compressed-tensors
W4A16/W8A16, GGUF Q4_0/Q4_1/Q8_0/Q4_K):
    ``qweight`` uint8: 4 bits ``[N, K // 2]`` (column ``2j`` in byte ``j``'s low nibble,
    ``2j + 1`` in its high nibble), 8 bits ``[N, K]``; ``q`` unsigned in ``[0, 2**bits)``.
    ``scales``, ``offsets`` ``[N, K // group_size]``: ``w = q * scale + offset``
    (``offset = -zero_point * scale``). ``perm`` ``[K]`` int64 or None: GPTQ's act-order,
    the matrix's columns are ``x[:, perm]``'s (groups made contiguous at load).
``FP8Weight`` (compressed-tensors FP8 W8A8/W8A16, transformers ``fp8``, online FP8):
    ``weight`` float8_e4m3fn ``[N, K]``; ``weight_scale`` float32 ``[N]`` (per output
    channel; a per-tensor scale is expanded) or ``[ceil(N / bn), ceil(K / bk)]`` for
    ``block=(bn, bk)``: ``w = weight * scale``. Activations: ``act="dynamic"`` (per token,
    or per token and ``bk`` columns for block weights), ``"static"`` (``input_scale``, one
    float) or ``"none"`` (W8A16).
``FloatWeight`` (a float32 model's unquantized LM head and token embedding, kept as the
    checkpoint stores them): ``weight`` ``[N, K]`` float32, bfloat16 or float16.
``Int8Weight`` (compressed-tensors INT8 W8A8):
    ``weight`` int8 ``[N, K]``, ``weight_scale`` float32 ``[N]``; activations quantized
    symmetrically to int8 per token (``act="dynamic"``) or with one ``input_scale``.

On CPU ``WNA16Weight`` runs the C++ GEMM of :mod:`kvpilot.kernels.cpu_quant_gemm` on its
canonical tensors (exact fp32, up to :data:`SMALL_M` rows) where the CPU kernels load;
without them, and for more rows, the weight-only kernels torch ships where one applies
(``_weight_int4pack_mm_for_cpu`` for 4 bits with group sizes 32..256, ``_weight_int8pack_mm``
for per-channel 8 bits, both over bf16 activations). INT8 W8A8 takes ``torch._int_mm``.
Otherwise a tile of output rows is dequantized at a time (:data:`TILE_BYTES` of fp32) and
multiplied: the matrix is never held dequantized. On CUDA it is the Triton GEMMs of
:mod:`kvpilot.kernels.quant_gemm`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F

TILE_BYTES = 8 << 20
"""fp32 bytes of one dequantized tile on the CPU fallback (a tile is whole output rows)."""

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
INT8_MAX = 127.0
_INT4PACK_GROUPS = (32, 64, 128, 256)
SMALL_M = 2048
"""Most activation rows ``WNA16Weight.linear`` gives the C++ CPU GEMM (the default step
budget, ``--max-num-batched-tokens``); more take the dequantize-a-tile path (the
measurements are in :class:`WNA16Weight`'s docstring)."""


class QuantizedWeightError(ValueError):
    """A quantized tensor whose shape, dtype or parameters cannot be honoured; the
    message names the tensor (``name``), what it holds and what is allowed."""


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise QuantizedWeightError(f"{name}: {message}")


def _cpu_kernels() -> bool:
    """Whether the C++ CPU kernels load here (the first call may compile them, once per
    machine; :func:`kvpilot.kernels.cpu_attention.load`)."""
    from kvpilot.kernels import cpu_attention

    return cpu_attention.available()[0]


def _rows_tile(in_features: int) -> int:
    return max(1, TILE_BYTES // (4 * max(1, in_features)))


class QuantizedWeight(ABC):
    """One ``[out_features, in_features]`` matrix in a quantized layout.

    Attributes:
        name: the checkpoint tensor (prefix) it came from, for errors and logs.
        format: a short name (``wna16``, ``fp8``, ``int8``, ``gguf:<type>``) for logs and
            the format table.
    """

    name: str
    format: str
    out_features: int
    in_features: int

    @abstractmethod
    def params(self) -> tuple[object, ...]:
        """The non-tensor parameters that must agree for two weights to be joined by rows."""

    @abstractmethod
    def describe(self) -> str:
        """One line: the format and its parameters."""

    @abstractmethod
    def cat(self, parts: Sequence[QuantizedWeight], name: str) -> QuantizedWeight:
        """``parts`` (all of this class and :meth:`params`) joined by rows."""

    @abstractmethod
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias``: ``[T, in_features]`` -> ``[T, out_features]`` in ``x``'s dtype."""

    @abstractmethod
    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``rows`` (int64 ``[n]``; None: all) of ``W`` as ``[n, in_features]`` ``dtype``."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Resident bytes of every tensor this weight holds."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors, by attribute name (for :meth:`to` and :meth:`cat_rows`)."""

    def prepare(self, device: torch.device) -> QuantizedWeight:
        """Move to ``device`` and repack for its kernels (once, after loading); returns
        the weight to serve with (possibly ``self``)."""
        return self.to(device)

    def to(self, device: torch.device) -> QuantizedWeight:
        """This weight with every tensor on ``device`` (a new object when any moved)."""
        moved = {k: None if t is None else t.to(device) for k, t in self.tensors().items()}
        if all(t is None or t.device == device for t in self.tensors().values()):
            return self
        return self._replace(**moved)

    @abstractmethod
    def _replace(self, **tensors: torch.Tensor | None) -> QuantizedWeight:
        """A copy with some tensors replaced (same parameters)."""

    def select_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The matrix ``W[rows]`` (a new weight; rows int64 ``[n]``): GGUF's Q/K row
        un-permutation and tensor-parallel slices. Row-indexed tensors are gathered."""
        return self._replace(**{k: t.index_select(0, rows) for k, t in self.tensors().items()
                                 if t is not None and self._row_indexed(k)})

    def _row_indexed(self, key: str) -> bool:
        """Whether tensor ``key`` has one row per output row (gathered by :meth:`select_rows`)."""
        return True

    def _tiled(self, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The dequantize-a-tile-then-multiply product (any layout; CPU fallback)."""
        n = self.out_features
        out = x.new_empty(x.shape[0], n)
        xc = x.to(dtype)
        step = _rows_tile(self.in_features)
        for start in range(0, n, step):
            rows = torch.arange(start, min(n, start + step), device=x.device)
            out[:, start:start + rows.numel()] = F.linear(xc, self.dequantize(rows, dtype)).to(x.dtype)
        if bias is not None:
            out += bias.to(out.dtype)
        return out


def cat_rows(parts: Sequence[QuantizedWeight], name: str) -> QuantizedWeight:
    """One weight whose rows are ``parts``' rows in order (the fused q/k/v and gate/up
    projections of the model files). Consecutive parts of one format are joined into one
    matrix (one kernel call); parts in different formats (a GGUF Q4_K_M file's Q6_K
    ``attn_v`` beside Q4_K ``attn_q``/``attn_k``) become a :class:`StackedWeight`.

    Raises:
        QuantizedWeightError: parts with different ``in_features``.
    """
    first = parts[0]
    for p in parts[1:]:
        _check(p.in_features == first.in_features, name,
               f"parts with {first.in_features} and {p.in_features} input columns cannot be fused")
    runs: list[list[QuantizedWeight]] = []
    for p in parts:
        if runs and type(p) is type(runs[-1][0]) and p.params() == runs[-1][0].params():
            runs[-1].append(p)
        else:
            runs.append([p])
    joined = [run[0] if len(run) == 1 else run[0].cat(run, name) for run in runs]
    return joined[0] if len(joined) == 1 else StackedWeight(joined, name)


class StackedWeight(QuantizedWeight):
    """Row blocks in different formats, each multiplied by its own kernel into its columns
    of the output (a fused projection whose parts are stored in different types).

    Args:
        parts: the blocks, in row order (same ``in_features``).
    """

    format = "stacked"

    def __init__(self, parts: Sequence[QuantizedWeight], name: str = "weight") -> None:
        self.name = name
        self.parts = list(parts)
        self.in_features = parts[0].in_features
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + p.out_features)
        self.out_features = self.starts[-1]

    def params(self) -> tuple[object, ...]:
        return ("stacked", *(type(p).__name__ for p in self.parts), *(p.params() for p in self.parts))

    def describe(self) -> str:
        return " + ".join(f"{p.out_features} rows of {p.describe()}" for p in self.parts)

    def cat(self, parts: Sequence[QuantizedWeight], name: str) -> QuantizedWeight:
        return StackedWeight([q for p in parts for q in (p.parts if isinstance(p, StackedWeight) else [p])], name)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {}

    def _replace(self, **tensors: torch.Tensor | None) -> QuantizedWeight:
        return self

    def select_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        raise QuantizedWeightError(f"{self.name}: rows of a weight stacked from several formats cannot be reordered")

    def to(self, device: torch.device) -> QuantizedWeight:
        return StackedWeight([p.to(device) for p in self.parts], self.name)

    def prepare(self, device: torch.device) -> QuantizedWeight:
        return StackedWeight([p.prepare(device) for p in self.parts], self.name)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if rows is None:
            return torch.cat([p.dequantize(None, dtype) for p in self.parts])
        out = torch.empty(rows.numel(), self.in_features, dtype=dtype, device=rows.device)
        for p, start in zip(self.parts, self.starts):
            mask = (rows >= start) & (rows < start + p.out_features)
            if bool(mask.any()):
                out[mask] = p.dequantize(rows[mask] - start, dtype)
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.out_features)
        for p, start in zip(self.parts, self.starts):
            end = start + p.out_features
            out[:, start:end] = p.linear(x, None if bias is None else bias[start:end])
        return out


# ----------------------------------------------------------------------------- WNA16
class WNA16Weight(QuantizedWeight):
    """Grouped integer weights (4 or 8 bits), float activations; layout in the module
    docstring.

    Args:
        qweight: uint8 ``[N, K // 2]`` (4 bits) or ``[N, K]`` (8 bits).
        scales, offsets: ``[N, K // group_size]``, one float dtype.
        bits: 4 or 8; group_size: divides ``K``; in_features: ``K``.
        perm: int64 ``[K]``, the act-order column permutation, or None.
        name: the checkpoint tensor, for errors.
    Raises:
        QuantizedWeightError: shapes or dtypes that do not fit together.

    The CPU product: where the C++ CPU kernels load, :meth:`prepare` keeps the canonical
    layout and :meth:`linear` runs :func:`kvpilot.kernels.cpu_quant_gemm.wna16_gemm`
    (fp32 dequantization and accumulation, a row's bits independent of its batch) for up
    to :data:`SMALL_M` rows, and the dequantize-a-tile path (``_tiled``: 8 MB of fp32
    rows, then sgemm) beyond. Measured with ``benchmarks/cpu_quant_gemm.py`` (2 threads
    of a Zen 5 EPYC, torch 2.15, fp32 activations, median ms; group 32):

    - Against torch's int4 pack (bf16 activations and scales, about 1e-2 relative
      error): as fast at decode sizes. ``2048x5632`` (K x N), 1 / 8 / 32 rows: 0.162 /
      0.547 / 2.11 ms here, 0.162 / 0.579 / 2.30 torch; the ``576x49152`` LM head:
      0.420 / 1.53 / 5.93 here, 0.422 / 1.61 / 6.09 torch; SmolLM2's small ``576x192``
      and ``576x576`` at 32 rows up to 1.25x slower (a tie on one thread). Torch's pack
      is faster for prefill chunks (1.09-1.13x at 2,048 rows, 1.16-1.33x at 4,096),
      given up for exactness, batch invariance and one code path; it also cannot take
      8-bit groups (GGUF Q8_0) or ``N`` not a multiple of 16. 8 bits per channel:
      0.133 ms here, 0.172 with torch's int8 kernel (``2048x5632``, 1 row).
    - Against ``_tiled``: 4 bits, 1 row 18-48x faster (237x at ``576x1536``, whose tile
      took 2.3 ms to dequantize), 32 rows 4.2-9.2x, 2,048 rows 1.30-1.43x, 4,096 rows
      1.08-1.27x; 8 bits (Q8_0), 1 row 12-29x (174x at ``576x1536``; the LM head 0.545
      ms against 15.8), 2,048 rows 1.22-1.24x, 4,096 rows 0.98-1.20x. Hence
      :data:`SMALL_M` = 2,048, also the default step budget: a default engine never
      leaves the kernel.
    - Without the C++ kernels (no compiler, nothing prebuilt for this CPU), :meth:`prepare`
      repacks for torch's int4/int8 kernels where they apply, as before.
    """

    format = "wna16"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                 group_size: int, in_features: int, perm: torch.Tensor | None = None, name: str = "weight") -> None:
        self.name = name
        _check(bits in (4, 8), name, f"bits = {bits}; 4 or 8 are supported")
        _check(qweight.dtype == torch.uint8, name, f"packed weight dtype {qweight.dtype}; expected uint8")
        k = in_features
        _check(group_size > 0 and k % group_size == 0, name,
               f"group size {group_size} does not divide the input dimension {k}")
        _check(bits == 8 or k % 2 == 0, name, f"4-bit rows need an even input dimension; got {k}")
        n = qweight.shape[0]
        want_cols = k if bits == 8 else k // 2
        _check(qweight.dim() == 2 and qweight.shape[1] == want_cols, name,
               f"packed weight shape {tuple(qweight.shape)}; expected [{n}, {want_cols}] for {bits}-bit rows of {k}")
        groups = k // group_size
        for label, t in (("scales", scales), ("offsets", offsets)):
            _check(tuple(t.shape) == (n, groups), name,
                   f"{label} shape {tuple(t.shape)} does not match the weight: expected [{n}, {groups}] "
                   f"(group size {group_size})")
            _check(t.dtype.is_floating_point, name, f"{label} dtype {t.dtype}; expected a float dtype")
        if perm is not None:
            _check(tuple(perm.shape) == (k,), name, f"act-order permutation shape {tuple(perm.shape)}; expected [{k}]")
        self.qweight, self.scales, self.offsets = qweight, scales, offsets.to(scales.dtype)
        self.bits, self.group_size, self.perm = bits, group_size, perm
        self.out_features, self.in_features = n, k
        # CPU kernel forms, set by prepare(): torch's int4 pack, or int8 rows.
        self._int4pack: torch.Tensor | None = None
        self._scale_zeros: torch.Tensor | None = None
        self._int8: torch.Tensor | None = None
        self._int8_scale: torch.Tensor | None = None
        self._int8_corr: torch.Tensor | None = None

    def params(self) -> tuple[object, ...]:
        return (self.bits, self.group_size, self.in_features, self.perm is not None)

    def describe(self) -> str:
        return f"{self.bits}-bit integer weights, group size {self.group_size}" + (
            ", act-order" if self.perm is not None else "")

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"qweight": self.qweight, "scales": self.scales, "offsets": self.offsets, "perm": self.perm}

    def _row_indexed(self, key: str) -> bool:
        return key != "perm"

    def _replace(self, **t: torch.Tensor | None) -> WNA16Weight:
        cur = self.tensors()
        cur.update(t)
        q, s, o = cur["qweight"], cur["scales"], cur["offsets"]
        assert q is not None and s is not None and o is not None
        return WNA16Weight(q, s, o, self.bits, self.group_size, self.in_features, cur["perm"], self.name)

    def cat(self, parts: Sequence[QuantizedWeight], name: str) -> WNA16Weight:
        ps = [p for p in parts if isinstance(p, WNA16Weight)]
        if ps[0].perm is not None and any(not torch.equal(p.perm, ps[0].perm) for p in ps[1:]):  # type: ignore[arg-type]
            raise QuantizedWeightError(f"{name}: its parts have different act-order permutations; they cannot "
                                       "share one input")
        return WNA16Weight(torch.cat([p.qweight for p in ps]), torch.cat([p.scales for p in ps]),
                           torch.cat([p.offsets for p in ps]), self.bits, self.group_size, self.in_features,
                           self.perm, name)

    @property
    def nbytes(self) -> int:
        held = [self._int4pack, self._scale_zeros, self._int8, self._int8_scale, self._int8_corr]
        if self._int4pack is None and self._int8 is None:
            held += [self.qweight, self.scales, self.offsets]
        held.append(self.perm)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def unpack(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The codes ``q`` of rows ``rows`` as uint8 ``[n, K]`` (canonical layout)."""
        q = self.qweight if rows is None else self.qweight.index_select(0, rows)
        if self.bits == 8:
            return q
        return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(q.shape[0], -1)

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W[rows]`` in the matrix's column order (``x[:, perm]``'s when act-ordered)."""
        if self._int4pack is not None or self._int8 is not None:
            return self._dequantize_cpu(rows, dtype)
        q = self.unpack(rows).to(dtype)
        s = self.scales if rows is None else self.scales.index_select(0, rows)
        o = self.offsets if rows is None else self.offsets.index_select(0, rows)
        g = self.group_size
        w = q.view(q.shape[0], -1, g) * s.to(dtype)[..., None] + o.to(dtype)[..., None]
        return w.view(q.shape[0], -1)

    def prepare(self, device: torch.device) -> QuantizedWeight:
        """On CPU with the C++ kernels (they load or build here), keep the canonical
        layout: the C++ GEMM reads it (the class docstring says why). On CPU without them,
        repack for torch's weight-only kernels when the layout allows (4 bits: group size
        32..256 and ``N`` a multiple of 16; 8 bits: one group per row); the canonical
        tensors are dropped then. On CUDA, move (the Triton GEMM reads the canonical
        layout)."""
        w = self.to(device)
        assert isinstance(w, WNA16Weight)
        if w is self:
            w = self._replace()  # the kernel forms below never change self
        if device.type != "cpu" or _cpu_kernels():
            return w  # the canonical layout: the Triton GEMM, or the C++ CPU GEMM
        if self.bits == 4 and self.group_size in _INT4PACK_GROUPS and self.out_features % 16 == 0 \
                and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            q = w.unpack().to(torch.int32)
            w._int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # torch's int4 kernel: w = (q - 8) * scale + zero, zero = offset + 8 * scale.
            s = w.scales.float()
            zero = w.offsets.float() + 8.0 * s
            w._scale_zeros = torch.stack((s.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
        elif self.bits == 8 and self.group_size == self.in_features and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            # w = (q - 128) * scale + (offset + 128 * scale): the int8 kernel does the
            # first term, a rank-one correction (row sums of x) the second.
            w._int8 = (w.qweight.to(torch.int16) - 128).to(torch.int8)
            s = w.scales.float()[:, 0]
            w._int8_scale = s.to(torch.bfloat16)
            corr = w.offsets.float()[:, 0] + 128.0 * s
            w._int8_corr = corr if bool(corr.abs().max() > 0) else None
        else:
            return w
        w.qweight = w.qweight.new_empty(0)  # dropped: the kernel form is what serves
        w.scales = w.scales[:0]
        w.offsets = w.offsets[:0]
        return w

    def _dequantize_cpu(self, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        k = self.in_features
        if self._int4pack is not None:
            assert self._scale_zeros is not None
            n = self.out_features
            idx = torch.arange(n) if rows is None else rows
            # torch's CPU int4 layout: blocks of 64 rows, [N / 64, K, 32] bytes; row
            # 64b + j is the low nibble of column j (j < 32), the high one of j - 32.
            if n % 64 == 0:
                blocks = self._int4pack.view(n // 64, k, 32)
                b, j = idx // 64, idx % 64
                byte = blocks[b, :, j % 32]  # [n_rows, K]
                q = torch.where((j < 32)[:, None], byte & 0xF, byte >> 4)
            else:
                q = self._unpack_int4pack_any(idx)
            sz = self._scale_zeros.index_select(1, idx).float()  # [G, n, 2]
            g = self.group_size
            w = (q.to(torch.float32) - 8.0).view(idx.numel(), -1, g) * sz[..., 0].t()[..., None] \
                + sz[..., 1].t()[..., None]
            return w.view(idx.numel(), k).to(dtype)
        assert self._int8 is not None and self._int8_scale is not None
        q8 = self._int8 if rows is None else self._int8.index_select(0, rows)
        s8 = self._int8_scale if rows is None else self._int8_scale.index_select(0, rows)
        w = q8.float() * s8.float()[:, None]
        if self._int8_corr is not None:
            w += (self._int8_corr if rows is None else self._int8_corr.index_select(0, rows))[:, None]
        return w.to(dtype)

    def _unpack_int4pack_any(self, idx: torch.Tensor) -> torch.Tensor:
        """Codes of rows ``idx`` from the packed form when ``N`` is not a multiple of 64:
        recovered by the kernel itself (identity activations, zero offsets), exact."""
        assert self._int4pack is not None
        k, g = self.in_features, self.group_size
        ones = torch.zeros(k // g, self.out_features, 2, dtype=torch.bfloat16)
        ones[..., 0] = 1.0
        eye = torch.eye(k, dtype=torch.bfloat16)
        full: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self._int4pack, g, ones)  # q - 8
        return (full.t().index_select(0, idx).float() + 8.0).round().to(torch.uint8)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        y: torch.Tensor
        if self._int4pack is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self._int4pack,
                                                           self.group_size, self._scale_zeros).to(x.dtype)
        elif self._int8 is not None:
            xb = x.to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(xb, self._int8, self._int8_scale).to(x.dtype)
            if self._int8_corr is not None:
                y += x.float().sum(-1, keepdim=True).to(x.dtype) * self._int8_corr.to(x.dtype)
        elif x.device.type == "cpu" and x.shape[0] <= SMALL_M and _cpu_kernels():
            from kvpilot.kernels.cpu_quant_gemm import wna16_gemm as cpu_gemm

            y = cpu_gemm(x, self.qweight, self.scales, self.offsets, self.bits, self.group_size).to(x.dtype)
        elif x.is_cuda:
            from kvpilot.kernels.quant_gemm import wna16_gemm  # Triton: CUDA only

            out: torch.Tensor = wna16_gemm(x.contiguous(), self.qweight, self.scales, self.offsets, self.bits,
                                           self.group_size, bias=bias)
            return out
        else:
            return self._tiled(x, bias, torch.float32 if x.dtype == torch.float32 else x.dtype)
        if bias is not None:
            y += bias.to(y.dtype)
        return y


# ------------------------------------------------------------------ float weights
class FloatWeight(QuantizedWeight):
    """An unquantized matrix kept as the checkpoint stores it (float32, bfloat16 or
    float16) by a float32 model: the LM head and token embedding of a quantized
    checkpoint, which its quantizer leaves unquantized (llm-compressor's
    ``ignore: [lm_head]``, GPTQ, AWQ). Widening a 16-bit table to float32 would double its
    bytes, and a tied table would be held twice (the lookup rows and the head's packed
    copy): for SmolLM2-135M W4A16 1.5-1.7 times the checkpoint's bytes. Kept as stored,
    the lookup widens the looked-up rows only and the head widens each weight in
    registers (:func:`kvpilot.kernels.cpu_quant_gemm.float_gemm`), exactly: every weight
    is a float32 value, so the products are the float32 model's up to summation order.

    Args:
        weight: ``[N, K]`` float32, bfloat16 or float16.
        name: the checkpoint tensor, for errors.
    Raises:
        QuantizedWeightError: another dtype or rank.
    """

    format = "float"

    def __init__(self, weight: torch.Tensor, name: str = "weight") -> None:
        self.name = name
        _check(weight.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.dim() == 2, name,
               f"weight {weight.dtype} {tuple(weight.shape)}; expected float32, bfloat16 or float16 [N, K]")
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.format = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[weight.dtype]

    def params(self) -> tuple[object, ...]:
        return (self.weight.dtype, self.in_features)

    def describe(self) -> str:
        return f"{self.format} weights kept as stored (float32 products)"

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"weight": self.weight}

    def _replace(self, **t: torch.Tensor | None) -> FloatWeight:
        w = t.get("weight", self.weight)
        assert w is not None
        return FloatWeight(w, self.name)

    def cat(self, parts: Sequence[QuantizedWeight], name: str) -> FloatWeight:
        return FloatWeight(torch.cat([p.weight for p in parts if isinstance(p, FloatWeight)]), name)

    def prepare(self, device: torch.device) -> QuantizedWeight:
        moved = self.to(device)
        assert isinstance(moved, FloatWeight)
        return moved if moved.weight.is_contiguous() else FloatWeight(moved.weight.contiguous(), self.name)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight if rows is None else self.weight.index_select(0, rows)
        return w.to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= SMALL_M and _cpu_kernels():
            from kvpilot.kernels.cpu_quant_gemm import float_gemm

            y = float_gemm(x, self.weight).to(x.dtype)
        elif x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, None if bias is None else bias.to(x.dtype))
        else:
            return self._tiled(x, bias, x.dtype)
        if bias is not None:
            y += bias.to(y.dtype)
        return y


# ------------------------------------------------------------------------------- FP8
def quantize_fp8_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 E4M3 quantization of activations (vLLM's ``scaled_fp8_quant`` per
    token; ``per_token_group_quant_fp8`` with ``group``).

    Args:
        x: ``[T, K]`` float.
        group: columns per scale (block weights' ``bk``), None: one scale per row.
    Returns:
        ``(x_q [T, K] float8_e4m3fn, scales [T, ceil(K / group)] or [T, 1] float32)`` with
        ``x ~= x_q * scale``; scale ``= amax / 448`` (at least 1e-12 / 448).
    """
    xf = x.float()
    t, k = xf.shape
    if group is None or group >= k:
        amax = xf.abs().amax(dim=-1, keepdim=True)
        s = amax.clamp(min=1e-12) / FP8_MAX
        return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s
    groups = math.ceil(k / group)
    pad = groups * group - k
    xp = F.pad(xf, (0, pad)).view(t, groups, group)
    s = xp.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [T, G]
    q = (xp / s[..., None]).clamp(-FP8_MAX, FP8_MAX).view(t, -1)[:, :k].to(torch.float8_e4m3fn)
    return q, s


def quantize_fp8_weight(w: torch.Tensor, name: str = "weight") -> FP8Weight:
    """Online FP8: a float ``[N, K]`` weight quantized per output channel (scale
    ``amax / 448``), with dynamic per-token activations (vLLM's ``--quantization fp8`` on
    an unquantized checkpoint quantizes per tensor; per channel keeps more accuracy at
    four bytes a row)."""
    wf = w.float()
    s = wf.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (wf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FP8Weight(q, s, act="dynamic", name=name)


class FP8Weight(QuantizedWeight):
    """FP8 E4M3 weights with per-channel or block scales; layout in the module docstring.

    Args:
        weight: float8_e4m3fn ``[N, K]``.
        weight_scale: float32 ``[N]`` or, with ``block``, ``[ceil(N / bn), ceil(K / bk)]``.
        act: ``dynamic``, ``static`` (needs ``input_scale``) or ``none`` (weight-only).
        input_scale: the static activation scale (a float), else None.
        block: ``(bn, bk)`` or None.
    Raises:
        QuantizedWeightError: shapes, dtypes or an ``act`` that do not fit.
    """

    format = "fp8"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, act: str = "dynamic",
                 input_scale: float | None = None, block: tuple[int, int] | None = None, name: str = "weight") -> None:
        self.name = name
        _check(weight.dtype == torch.float8_e4m3fn, name, f"weight dtype {weight.dtype}; expected float8_e4m3fn")
        _check(weight.dim() == 2, name, f"weight shape {tuple(weight.shape)}; expected 2-D")
        _check(act in ("dynamic", "static", "none"), name, f"activation scheme {act!r}; dynamic, static or none")
        _check(act != "static" or input_scale is not None, name, "static activations need an input_scale tensor")
        n, k = weight.shape
        if block is None:
            _check(tuple(weight_scale.shape) == (n,), name,
                   f"weight_scale shape {tuple(weight_scale.shape)} does not match the weight: expected [{n}]")
        else:
            bn, bk = block
            want = (math.ceil(n / bn), math.ceil(k / bk))
            _check(tuple(weight_scale.shape) == want, name,
                   f"weight_scale shape {tuple(weight_scale.shape)} does not match the weight {tuple(weight.shape)} "
                   f"in blocks of {bn}x{bk}: expected {list(want)}")
        self.weight, self.weight_scale = weight, weight_scale.float()
        self.act, self.input_scale, self.block = act, input_scale, block
        self.out_features, self.in_features = n, k

    def params(self) -> tuple[object, ...]:
        return (self.act, self.block, self.in_features)

    def describe(self) -> str:
        scales = "per-channel" if self.block is None else f"{self.block[0]}x{self.block[1]} block"
        return f"FP8 weights ({scales} scales), {self.act} activations"

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"weight": self.weight, "weight_scale": self.weight_scale}

    def _row_indexed(self, key: str) -> bool:
        return self.block is None or key == "weight"

    def select_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        if self.block is not None:
            raise QuantizedWeightError(f"{self.name}: rows of a block-scaled FP8 weight cannot be reordered")
        return super().select_rows(rows)

    def _replace(self, **t: torch.Tensor | None) -> FP8Weight:
        cur = self.tensors()
        cur.update(t)
        w, s = cur["weight"], cur["weight_scale"]
        assert w is not None and s is not None
        return FP8Weight(w, s, self.act, self.input_scale, self.block, self.name)

    def cat(self, parts: Sequence[QuantizedWeight], name: str) -> FP8Weight:
        ps = [p for p in parts if isinstance(p, FP8Weight)]
        if self.block is not None:
            bn = self.block[0]
            bad = [p.name for p in ps[:-1] if p.out_features % bn]
            _check(not bad, name, f"parts {bad} have rows not a multiple of the {bn}-row scale block; "
                                  "their scales cannot be fused")
        # vLLM's rule for fused static activation scales: the largest (every part sees x).
        scale = None if self.act != "static" else max(float(p.input_scale or 0.0) for p in ps)
        return FP8Weight(torch.cat([p.weight for p in ps]), torch.cat([p.weight_scale for p in ps]), self.act,
                         scale, self.block, name)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale))

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from kvpilot.kernels.fast_dequant import FP8_HALF_FACTOR, fp8_as_half

        w8 = self.weight if rows is None else self.weight.index_select(0, rows)
        w = fp8_as_half(w8.view(torch.uint8), torch.float8_e4m3fn).float() * FP8_HALF_FACTOR[torch.float8_e4m3fn]
        if self.block is None:
            s = self.weight_scale if rows is None else self.weight_scale.index_select(0, rows)
            return (w * s[:, None]).to(dtype)
        bn, bk = self.block
        idx = torch.arange(self.out_features, device=w.device) if rows is None else rows
        s = self.weight_scale.index_select(0, idx // bn)  # [n, ceil(K / bk)]
        s = s.repeat_interleave(bk, dim=1)[:, : self.in_features]
        return (w * s).to(dtype)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the format multiplies: ``x`` after FP8 quantization and back
        (``act`` dynamic/static), or ``x`` itself (``none``). ``[T, K]`` float32."""
        if self.act == "none":
            return x.float()
        if self.act == "static":
            s = torch.tensor(float(self.input_scale or 1.0), device=x.device)
            q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return q.float() * s
        group = None if self.block is None else self.block[1]
        q, s = quantize_fp8_rows(x, group)
        if group is None:
            return q.float() * s
        t, k = x.shape
        return (q.float().view(t, -1) * s.repeat_interleave(group, dim=1)[:, :k])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            from kvpilot.kernels.quant_gemm import fp8_gemm  # Triton: CUDA only

            scale = None if self.input_scale is None else torch.tensor([self.input_scale], device=x.device)
            out: torch.Tensor = fp8_gemm(x.contiguous(), self.weight, self.weight_scale, input_scale=scale,
                                         block=self.block, act_quant=self.act != "none", bias=bias,
                                         out_dtype=x.dtype)
            return out
        y = self._tiled(self.quantize_input(x), None, torch.float32).to(x.dtype)
        if bias is not None:
            y += bias.to(y.dtype)
        return y


# ------------------------------------------------------------------------------ INT8
def quantize_int8_rows(x: torch.Tensor, input_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of activations: per token (``amax / 127``) or with one
    static scale. Returns ``(x_q [T, K] int8, scales [T, 1] float32)``; ``x ~= x_q * s``."""
    xf = x.float()
    if input_scale is None:
        s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / INT8_MAX
    else:
        s = torch.full((xf.shape[0], 1), float(input_scale), device=x.device)
    return torch.round(xf / s).clamp(-128, 127).to(torch.int8), s


class Int8Weight(QuantizedWeight):
    """INT8 W8A8: int8 ``[N, K]`` weights with per-channel scales ``[N]``; activations
    quantized to int8 per token (``dynamic``) or with ``input_scale`` (``static``); the
    product accumulates in int32 (``torch._int_mm`` on CPU) and is scaled by
    ``s_x[t] * s_w[n]``.

    Raises:
        QuantizedWeightError: shapes or dtypes that do not fit.
    """

    format = "int8"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, act: str = "dynamic",
                 input_scale: float | None = None, name: str = "weight") -> None:
        self.name = name
        _check(weight.dtype == torch.int8 and weight.dim() == 2, name,
               f"weight {weight.dtype} {tuple(weight.shape)}; expected int8 [N, K]")
        _check(act in ("dynamic", "static"), name, f"activation scheme {act!r}; dynamic or static")
        _check(act != "static" or input_scale is not None, name, "static activations need an input_scale tensor")
        n, k = weight.shape
        _check(tuple(weight_scale.shape) == (n,), name,
               f"weight_scale shape {tuple(weight_scale.shape)} does not match the weight: expected [{n}]")
        self.weight, self.weight_scale = weight, weight_scale.float()
        self.act, self.input_scale = act, input_scale
        self.out_features, self.in_features = n, k

    def params(self) -> tuple[object, ...]:
        return (self.act, self.in_features)

    def describe(self) -> str:
        return f"int8 weights (per-channel scales), {self.act} int8 activations"

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"weight": self.weight, "weight_scale": self.weight_scale}

    def _replace(self, **t: torch.Tensor | None) -> Int8Weight:
        cur = self.tensors()
        cur.update(t)
        w, s = cur["weight"], cur["weight_scale"]
        assert w is not None and s is not None
        return Int8Weight(w, s, self.act, self.input_scale, self.name)

    def cat(self, parts: Sequence[QuantizedWeight], name: str) -> Int8Weight:
        ps = [p for p in parts if isinstance(p, Int8Weight)]
        scale = None if self.act != "static" else max(float(p.input_scale or 0.0) for p in ps)
        return Int8Weight(torch.cat([p.weight for p in ps]), torch.cat([p.weight_scale for p in ps]), self.act,
                          scale, name)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.weight_scale))

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight if rows is None else self.weight.index_select(0, rows)
        s = self.weight_scale if rows is None else self.weight_scale.index_select(0, rows)
        return (w.float() * s[:, None]).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            from kvpilot.kernels.quant_gemm import int8_gemm  # Triton: CUDA only

            scale = None if self.input_scale is None else torch.tensor([self.input_scale], device=x.device)
            out: torch.Tensor = int8_gemm(x.contiguous(), self.weight, self.weight_scale, input_scale=scale,
                                          bias=bias, out_dtype=x.dtype)
            return out
        if x.device.type == "cpu" and x.dim() == 2 and _cpu_kernels():
            # the same bits as below, one pass (and one allocation) each side of the product
            from kvpilot.kernels import cpu_quant_gemm as cq

            xq, sx = cq.int8_quantize_rows(x, self.input_scale)
            y = cq.int8_scale(torch._int_mm(xq, self.weight.t()), sx, self.weight_scale, x.dtype)
        else:
            xq, sx = quantize_int8_rows(x, self.input_scale)
            acc = torch._int_mm(xq, self.weight.t())  # [T, N] int32, exact
            y = (acc.float() * sx * self.weight_scale[None, :]).to(x.dtype)
        if bias is not None:
            y += bias.to(y.dtype)
        return y
