"""The layers the decoders are assembled from: norms, linears (plain, oneDNN-packed, and
the tensor-parallel column/row split), the attention module, the gated MLP, and the
(vocab-parallel) embedding and LM head.

A model file (:mod:`~kvpilot.engine.model.llama`, :mod:`~kvpilot.engine.model.moe`,
:mod:`~kvpilot.engine.model.gemma`) builds its decoder layers from these and owns only how
they are wired and how a checkpoint's names map onto them. This module imports no model
file; of tensor parallelism it needs the group's collectives (a :class:`TPGroup` handed
in) and the vocabulary split (:func:`~kvpilot.engine.distributed.vocab_range`).

Tensor parallelism (Megatron-LM's split, :mod:`kvpilot.engine.distributed`): a
:class:`ColumnParallelLinear` (``qkv_proj``, ``gate_up_proj``) holds this rank's output
rows and needs no communication; a :class:`RowParallelLinear` (``o_proj``,
``down_proj``) holds the matching input columns and sums the ranks' partial outputs with
one all-reduce. Both subclass ``nn.Linear``, so that their parameter names are the
checkpoint's and :func:`pack_linears` can swap each for a :class:`PackedLinear` (which
keeps the row-parallel reduce).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvpilot.engine.distributed import TPGroup as TPGroup  # re-exported for the model files
from kvpilot.engine.distributed import vocab_range
from kvpilot.engine.model.config import ModelConfig
from kvpilot.engine.model.layer_ops import TORCH_LAYER_OPS, TorchLayerOps
from kvpilot.engine.quantization.weights import QuantizedWeight, QuantizedWeightError, cat_rows


@dataclass
class ForwardContext:
    """What every layer needs for one step (passed explicitly, never global).

    Attributes:
        meta: the step's attention metadata (slot mapping, block tables, lengths).
        kv_caches: one :class:`LayerKVCache` per layer; attention writes this step's K/V.
        backend: the attention backend.
        ops: the elementwise ops (the backend's: fused C++ on the cpu backend, else torch).
        rotary: their per-step rotary state (``ops.rotary_tables``).
        calibrate: FP8 scale calibration hook ``(layer, k, v) -> None``, set only until
            calibrated.
    """

    meta: AttentionMetadata
    kv_caches: list[LayerKVCache]
    backend: AttentionBackend
    ops: TorchLayerOps
    rotary: object
    calibrate: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None


# ------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 (Zhang & Sennrich 2019);
    the math is in :mod:`kvpilot.engine.model.layer_ops`.

    Args:
        dim: the normalized (last) dimension; ``weight`` is ``[dim]``, ones at first.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: TorchLayerOps = TORCH_LAYER_OPS) -> torch.Tensor:
        """``[T, dim]`` -> ``[T, dim]`` in ``x``'s dtype (a new tensor)."""
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    ops: TorchLayerOps = TORCH_LAYER_OPS) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; the cpu ops mutate ``x`` and ``residual``."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


# ----------------------------------------------------------------- linears
class PackedLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` reordered once, at load, into oneDNN's blocked layout
    (``torch.ops.mkldnn._reorder_linear_weight``), as vLLM's CPU backend does with its
    oneDNN matmul handles.

    Why: ``F.linear`` on CPU calls MKL's sgemm, which packs the weight again on every
    call. For a decode step (a few to a few dozen rows) that repacking is a second pass
    over every weight, and the step is bound by reading the weights: measured on the
    development machine (one thread, the embedded model's 30 layers), 8 rows 109 -> 83 ms,
    32 rows 220 -> 143 ms, the LM head at 32 rows 58 -> 34 ms; a 2,048-row prefill chunk
    is the same either way.

    Args:
        weight: ``[out_features, in_features]`` fp32 (CPU); not kept (the packed copy is).
        bias: ``[out_features]`` or None.
        tp: the group a row-parallel linear's output is all-reduced over (the packed copy
            of a :class:`RowParallelLinear`), None for no reduce.
    Raises:
        RuntimeError: from oneDNN when it cannot pack this dtype on this CPU (bf16
            without AVX-512/AVX-NE-CONVERT): the caller keeps the plain ``nn.Linear``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()
        self.nbytes = weight.numel() * weight.element_size()
        self.tp = tp

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b``: ``[T, in_features]`` -> ``[T, out_features]`` in ``x``'s dtype,
        this rank's part only (no communication)."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`matmul`, summed over ``tp``'s ranks when it has one."""
        return row_parallel_reduce(self.matmul(x), self.tp)


class ColumnParallelLinear(nn.Linear):
    """A linear whose output rows are split over the tensor-parallel ranks (the QKV and
    gate/up projections): rank ``r`` holds its heads' or its intermediate slice's rows of
    ``weight`` ``[out / N, in]`` and computes them without communication, so this is a
    plain ``nn.Linear`` over the rank's shapes; the name says how the checkpoint is sliced
    (:func:`~kvpilot.engine.distributed.shard_weights`)."""


class RowParallelLinear(nn.Linear):
    """A linear whose input columns are split over the tensor-parallel ranks (the output
    and down projections): rank ``r`` holds ``weight`` ``[out, in / N]`` and computes a
    partial sum, which one all-reduce over ``tp`` completes (a bias is held by rank 0
    only, zeros elsewhere, so it is added once).

    Args:
        in_features, out_features, bias: as ``nn.Linear`` (the rank's ``in``).
        reduce_results: False to leave the partial sum to the caller (a MoE block's shared
            expert: the block reduces once for the experts and the shared expert).
    Attributes:
        tp: the group (set by :func:`set_tensor_parallel`); None: no reduce.
    """

    tp: TPGroup | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, reduce_results: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.reduce_results = reduce_results

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b``: ``[T, in]`` -> ``[T, out]`` in ``x``'s dtype, this rank's partial
        sum (no communication)."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`local`, summed over the ranks."""
        return row_parallel_reduce(self.local(x), self.group)

    @property
    def group(self) -> TPGroup | None:
        """The group this projection's output is all-reduced over (None: none)."""
        return self.tp if self.reduce_results else None


class QuantizedLinear(nn.Module):
    """A projection whose weight is a quantized checkpoint's
    (:mod:`kvpilot.engine.quantization.weights`): ``x @ W.T + b`` by the format's kernel.

    Built in place of an ``nn.Linear`` before the weights are read
    (:func:`quantize_linears`); the checkpoint's parts arrive through :meth:`add_shard`
    (the fused q/k/v and gate/up projections get one per part, by output rows) and
    :meth:`finish` joins them and repacks them for the device.

    Args:
        in_features, out_features: the projection's shape.
        bias: whether it has a bias (an ``nn.Parameter`` named ``bias``, loaded as before).
        reduce_results: a row-parallel projection's flag (kept for the model files; tensor
            parallelism over quantized weights is refused at load).
    Attributes:
        qweight: the joined weight after :meth:`finish` (None before).
        tp: the group a row-parallel projection all-reduces over (None: none).
    """

    tp: TPGroup | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reduce_results = reduce_results
        self.qweight: QuantizedWeight | None = None
        self._shards: dict[tuple[int, int], QuantizedWeight] = {}

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``: the dense weight's shape."""
        return self.out_features, self.in_features

    def add_shard(self, rows: tuple[int, int] | None, weight: QuantizedWeight, name: str) -> None:
        """Take output rows ``rows`` (``[start, end)``; None: all) from ``weight``.

        Raises:
            QuantizedWeightError: a shape that does not fit those rows (naming ``name``).
        """
        start, end = (0, self.out_features) if rows is None else rows
        if (weight.out_features, weight.in_features) != (end - start, self.in_features):
            raise QuantizedWeightError(
                f"{name}: quantized weight of shape {[weight.out_features, weight.in_features]}, expected "
                f"{[end - start, self.in_features]}")
        self._shards[(start, end)] = weight

    def finish(self, device: torch.device, name: str) -> None:
        """Join the shards by rows (:func:`~kvpilot.engine.quantization.weights.cat_rows`)
        and repack for ``device``. Mutates ``qweight``; drops the shards.

        Raises:
            QuantizedWeightError: rows left uncovered, or parts in formats that cannot be
                joined (mixed formats in one fused projection).
        """
        spans = sorted(self._shards)
        covered = 0
        for start, end in spans:
            if start != covered:
                raise QuantizedWeightError(f"{name}: rows {covered}..{start - 1} have no quantized weight")
            covered = end
        if covered != self.out_features:
            raise QuantizedWeightError(f"{name}: rows {covered}..{self.out_features - 1} have no quantized weight")
        self.qweight = cat_rows([self._shards[s] for s in spans], name).prepare(device)
        self._shards.clear()

    @property
    def nbytes(self) -> int:
        """The quantized weight's resident bytes (the bias is a parameter)."""
        return 0 if self.qweight is None else self.qweight.nbytes

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b``: ``[T, in]`` -> ``[T, out]`` in ``x``'s dtype (no communication)."""
        assert self.qweight is not None, "QuantizedLinear used before finish()"
        return self.qweight.linear(x, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`local`, all-reduced over ``tp`` when it has one and ``reduce_results``."""
        return row_parallel_reduce(self.local(x), self.tp if self.reduce_results else None)


class QuantizedEmbedding(nn.Module):
    """A token embedding kept quantized (GGUF's ``token_embd``): a lookup dequantizes the
    looked-up rows only; a tied LM head multiplies by the same quantized matrix
    (:attr:`head`).

    Args:
        vocab_size, hidden_size: the table's shape.
        dtype: the model's dtype (of the looked-up rows).
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inner = QuantizedLinear(hidden_size, vocab_size)
        self.dtype = dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.inner.out_features, self.inner.in_features

    @property
    def head(self) -> QuantizedLinear:
        """The table as a linear ``[T, hidden]`` -> ``[T, vocab]`` (a tied LM head)."""
        return self.inner

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 -> ``[T, hidden]`` in ``dtype``."""
        assert self.inner.qweight is not None, "QuantizedEmbedding used before finish()"
        return self.inner.qweight.dequantize(input_ids.reshape(-1), self.dtype)


def quantize_linears(model: nn.Module, checkpoint_names: Callable[[str], list[str]],
                     is_quantized: Callable[[str], bool], dtype: torch.dtype,
                     present: Callable[[str], bool] | None = None, embeddings: bool = False) -> set[str]:
    """Replace every ``nn.Linear`` the checkpoint quantizes (and a quantized token
    embedding) with a :class:`QuantizedLinear` (:class:`QuantizedEmbedding`) of the same
    shape and bias, before any weight is read: call on the model built on the meta device.

    Args:
        model: the module tree (mutated).
        checkpoint_names: our module name -> the checkpoint's module names it is loaded
            from (``layers.0.self_attn.qkv_proj`` -> the q, k and v projections).
        is_quantized: whether a checkpoint module is quantized.
        dtype: the model's dtype (a quantized embedding's rows).
        present: whether the checkpoint has a module of that name (our names map to
            several spellings: Mixtral's ``block_sparse_moe.gate`` and Qwen-MoE's
            ``mlp.gate``); only present ones are asked. None: all are.
        embeddings: whether token embeddings may be quantized (GGUF); a
            compressed-tensors ``Linear`` target never names one.
    Returns:
        the checkpoint module names now loaded into quantized modules.
    Raises:
        QuantizedWeightError: a fused projection whose parts the checkpoint quantizes only
            partly (one kernel serves the fused matrix).
    """
    replaced: set[str] = set()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if not isinstance(child, nn.Linear) and not (embeddings and isinstance(child, nn.Embedding)):
                continue
            names = [n for n in checkpoint_names(name) if present is None or present(n)]
            flags = [is_quantized(n) for n in names]
            if not any(flags):
                continue
            if not all(flags):
                mixed = ", ".join(f"{n} ({'quantized' if f else 'not quantized'})" for n, f in zip(names, flags))
                raise QuantizedWeightError(f"{name}: its parts are quantized differently ({mixed}); a fused "
                                           "projection needs one format for all its parts")
            new: nn.Module
            if isinstance(child, nn.Embedding):
                new = QuantizedEmbedding(child.num_embeddings, child.embedding_dim, dtype)
            else:
                reduce = child.reduce_results if isinstance(child, RowParallelLinear) else True
                new = QuantizedLinear(child.in_features, child.out_features, child.bias is not None, reduce)
            setattr(parent, child_name, new)
            replaced.update(names)
    return replaced


def finish_quantized(model: nn.Module, device: torch.device) -> int:
    """:meth:`QuantizedLinear.finish` every quantized module after loading; returns their
    resident bytes (which ``model.parameters()`` does not show)."""
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            m.finish(device, name)
            total += m.nbytes
    return total


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` applies: CPU, fp32 and a torch built with oneDNN."""
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(model: nn.Module) -> tuple[int, int]:
    """Replace every ``nn.Linear`` under ``model`` with a :class:`PackedLinear` (a
    :class:`RowParallelLinear`'s keeps its all-reduce).

    Returns ``(count, bytes)``: how many were packed and the packed weights' bytes (which
    ``model.parameters()`` no longer shows). Mutates the module tree; call under
    ``torch.no_grad()``.
    """
    count = nbytes = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                group = child.group if isinstance(child, RowParallelLinear) else None
                packed = PackedLinear(child.weight, child.bias, group)
                setattr(module, child_name, packed)
                nbytes += packed.nbytes
                count += 1
    return count, nbytes


def row_parallel_reduce(y: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """The output of a row-parallel linear: the ranks' partial sums ``[T, out]`` added by
    one all-reduce (in place: ``y`` is mutated and returned); ``y`` itself without a group."""
    return y if tp is None else tp.all_reduce(y)


def probe_batch_invariance(model: nn.Module, rows: int = 40, seed: int = 0) -> tuple[bool, str]:
    """Whether this model's matrix products give a row the same bits whatever the number
    of rows in the call: the property that lets a request's answer not depend on what it
    was batched with (vLLM's and SGLang's "batch invariance"). Every other per-token op of
    the CPU path is row-local by construction; the products are the library's choice
    (MKL's sgemm rounds a lone row differently from a row among several; oneDNN's packed
    kernels were found not to), so it is measured on this machine, once at load.

    For each distinct weight shape among the ``nn.Linear``/:class:`PackedLinear`
    modules (and the packed LM head), ``rows`` random rows go through once together and
    again as calls of 1, 2, 3, 8 and 17 rows; any bit of difference is a failure. A
    sample, not a proof: a library that changes kernels at a row count not sampled would
    pass.

    Args:
        model: the loaded model (on its device, in its dtype).
        rows: rows of the full call; seed: for the random rows.
    Returns:
        ``(invariant, detail)``; detail names the first shape and row count that differed.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    products: dict[tuple[int, int], tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = {}
    for m in model.modules():
        # The local products only: a row-parallel linear's all-reduce is not probed.
        if isinstance(m, nn.Linear):
            local: Callable[[torch.Tensor], torch.Tensor] = m.local if isinstance(m, RowParallelLinear) else m
            products.setdefault((m.in_features, m.out_features), (local, m.weight))
        elif isinstance(m, PackedLinear):
            products.setdefault((m.in_features, m.out_features), (m.matmul, m.packed))
        elif isinstance(m, QuantizedLinear) and m.qweight is not None:
            ref = next(model.parameters())  # the model's device and dtype: x's
            products.setdefault((m.in_features, m.out_features), (m.local, ref))
    embed = getattr(model, "embed_tokens", None)
    if isinstance(embed, (nn.Embedding, VocabParallelEmbedding)) and getattr(model, "lm_head", None) is None and getattr(model, "packed_head", None) is None:
        head: torch.Tensor = embed.weight  # a tied head left unpacked: F.linear over the embedding table
        products.setdefault((head.shape[1], head.shape[0]), (lambda h: F.linear(h, head), head))
    for (inp, out), (fn, param) in products.items():
        x = torch.randn(rows, inp, generator=gen).to(device=param.device, dtype=param.dtype)
        with torch.no_grad():
            full = fn(x)
            for n in (1, 2, 3, 8, 17):
                for start in (0, rows - n):
                    if not torch.equal(fn(x[start:start + n]), full[start:start + n]):
                        return False, (f"{inp}x{out} product: rows {start}..{start + n - 1} alone differ from "
                                       f"the same rows among {rows}")
    return True, f"{len(products)} weight shapes, calls of 1-17 rows against one of {rows}"


# --------------------------------------------------------------- attention
class Attention(nn.Module):
    """Self-attention over the paged KV cache; with tensor parallelism this rank's heads
    (column-parallel ``qkv_proj``, row-parallel ``o_proj``) and one all-reduce of the
    output (:mod:`kvpilot.engine.distributed`).

    Args:
        config: the rank's shapes (:func:`~kvpilot.engine.distributed.rank_config`).
        layer_idx: which KV cache layer this attention reads and writes.
    Attributes:
        qkv_proj: ``[q_size + 2 * kv_size, hidden]`` (q rows, then k, then v), column-parallel.
        o_proj: ``[hidden, q_size]``, row-parallel (its output all-reduced).
        q_norm, k_norm: Qwen3's per-head RMSNorm of q and k before RoPE (None elsewhere).
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                             bias=config.attention_bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: RMSNorm over each head of q and of k, before RoPE (one weight per dim).
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.sliding_window = config.sliding_window_for(layer_idx)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; writes this step's K/V to the layer's cache."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim), ctx.ops)
            k = self.k_norm(k.reshape(-1, self.head_dim), ctx.ops)
        q, k = ctx.ops.rotary(q.view(-1, self.num_heads, self.head_dim),
                              k.view(-1, self.num_kv_heads, self.head_dim), ctx.rotary)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if ctx.calibrate is not None:
            ctx.calibrate(self.layer_idx, k, v)
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.meta, self.scale,
                                  sliding_window=self.sliding_window)
        return self.project_out(out)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of the attention output ``[T, heads, head_dim]`` -> ``[T, hidden]``,
        summed over the tensor-parallel ranks."""
        y: torch.Tensor = self.o_proj(out.reshape(-1, self.q_size))
        return y


# --------------------------------------------------------------------- MLP
class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020). With tensor parallelism
    this rank's slice of the intermediate dimension, and one all-reduce of the output
    unless ``reduce_output`` is False (a MoE block's shared expert: the block reduces once).

    Args:
        config: the rank's shapes.
        intermediate_size: default ``config.intermediate_size`` (a shared expert's differs).
        reduce_output: whether ``down_proj`` all-reduces its output.
    Attributes:
        gate_up_proj: ``[2 * intermediate, hidden]`` (gate rows, then up rows), column-parallel.
        down_proj: ``[hidden, intermediate]``, row-parallel.
    """

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, reduce_output: bool = True) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.reduce_output = reduce_output
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * self.intermediate_size,
                                                 bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias,
                                           reduce_results=reduce_output)

    def forward(self, x: torch.Tensor, ops: TorchLayerOps = TORCH_LAYER_OPS) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` in ``x``'s dtype."""
        y: torch.Tensor = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return y


# ------------------------------------------------------ embedding, LM head
class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows ``[first, end)`` of the vocabulary
    (:func:`~kvpilot.engine.distributed.vocab_range`); a token outside them looks up
    zeros, and the all-reduce fills in every token.

    Attributes:
        weight: ``[rows, hidden]`` (``rows = ceil(vocab / size)``, zero-padded); the LM
            head of a tied model multiplies by it too.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.first, self.end, rows = vocab_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 -> ``[T, hidden]`` (the whole vocabulary's embeddings)."""
        local = input_ids - self.first
        outside = (input_ids < self.first) | (input_ids >= self.end)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(h)


def lm_head_logits(hidden: torch.Tensor, head: nn.Module | torch.Tensor, tp: TPGroup | None,
                   vocab_size: int) -> torch.Tensor:
    """The LM head: ``[n, hidden]`` -> ``[n, vocab_size]`` fp32 logits.

    Args:
        hidden: final hidden states, the model's dtype.
        head: a weight ``[rows, hidden]`` (the LM head's, or the embedding table of a tied
            model; with tensor parallelism this rank's vocabulary rows, zero-padded), or a
            module computing ``hidden @ weight.T`` (its :class:`PackedLinear` copy on CPU).
        tp: with tensor parallelism the ranks' slices are all-gathered (every rank calls
            this with the same rows) and the padding dropped.
        vocab_size: the whole model's vocabulary.
    """
    if isinstance(head, torch.Tensor):
        logits = F.linear(hidden, head).float()
    else:
        logits = head(hidden).float()
    if tp is not None:
        logits = tp.all_gather_last_dim(logits)[:, :vocab_size]
    return logits


def set_tensor_parallel(model: nn.Module, tp: TPGroup,
                        kinds: tuple[type[nn.Module], ...] = (RowParallelLinear,)) -> None:
    """Give every module of ``model`` of one of ``kinds`` (the row-parallel linears, and a
    model file's own blocks that reduce their output) the group ``tp``, so each
    all-reduces its output. Mutates the modules' ``tp``."""
    for module in model.modules():
        if isinstance(module, kinds):
            # A plain attribute: nn.Module.__setattr__ is typed for tensors and modules only.
            module.tp = tp  # type: ignore[assignment]
