"""The attention-backend contract and a registry with lazy factories.

A backend does two things per layer and step: write the step's new K/V into the paged
cache at ``slot_mapping``, then compute attention for every query token over its
sequence's cached context (the new tokens included, causally). The model runner builds
one :class:`AttentionMetadata` per step; all layers share it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvpilot.engine.model.layer_ops import TORCH_LAYER_OPS, TorchLayerOps
from kvpilot.engine.registry import Registry
from kvpilot.kernels.kv4 import KV4Args
from kvpilot.kernels.rotation import rotate_heads

logger = logging.getLogger("kvpilot.engine")


@dataclass
class AttentionMetadata:
    """Per-step batch description shared by all layers (tensors on the model device).

    Sequences are ordered decodes first: the first ``num_decodes`` have one query each.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 flat slots; -1 = do not write (already cached).
        query_start_loc: ``[num_seqs + 1]`` int32 cumulative query lengths.
        seq_lens: ``[num_seqs]`` int32 context length after this step.
        block_tables: ``[num_seqs, max_blocks]`` int32, zero-padded.
        query_start_loc_cpu, seq_lens_cpu: the same as Python lists (no device sync).
        max_query_len, max_seq_len: maxima over the batch.
    """

    num_decodes: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


@dataclass
class LayerKVCache:
    """One layer's paged cache and its quantization scales.

    Attributes:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        k_scale, v_scale: fp32 0-d tensors; 1.0 for unquantized dtypes. The cache holds
            ``x / scale`` (FP8); readers multiply back.
        key_rotation: ``[head_dim, head_dim]`` orthogonal matrix (activation dtype) or
            None. When set, the cache holds rotated keys ``k @ R`` and queries must be
            rotated the same way before attention (:func:`rotate_query_key`); see
            :mod:`kvpilot.kernels.rotation`.
        key_group_scales, value_group_scales: a 4-bit cache's E4M3 scales, one per 16
            values, ``[num_blocks, block_size, num_kv_heads, head_dim // 16]``; the caches
            are then uint8 ``[..., head_dim // 2]`` (:mod:`kvpilot.kernels.kv4`).
        kv4_format: ``fp4_e2m1`` / ``int4`` for a 4-bit cache, else None.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    key_rotation: torch.Tensor | None = None
    key_group_scales: torch.Tensor | None = None
    value_group_scales: torch.Tensor | None = None
    kv4_format: str | None = None

    @property
    def kv4(self) -> KV4Args:
        """The 4-bit keyword arguments of the kernels and references (all None otherwise)."""
        return KV4Args(
            key_group_scales=self.key_group_scales,
            value_group_scales=self.value_group_scales,
            kv4_format=self.kv4_format,
        )


def rotate_query_key(q: torch.Tensor, k: torch.Tensor, kv: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the layer's key rotation to ``q`` and ``k`` (unchanged when it has none).
    ``(q R) . (k R) = q . k``, so attention is the same in exact arithmetic."""
    if kv.key_rotation is None:
        return q, k
    return rotate_heads(q, kv.key_rotation), rotate_heads(k, kv.key_rotation)


class AttentionBackend(ABC):
    """Writes K/V into the paged cache and computes paged attention.

    ``layer_ops`` are the model's elementwise ops that go with this backend (RMSNorm,
    rotary, SiLU-and-mul; :mod:`kvpilot.engine.model.layer_ops`): the torch reference
    unless a backend brings fused kernels of its own (the ``cpu`` backend does).
    """

    name: str = ""
    layer_ops: TorchLayerOps = TORCH_LAYER_OPS

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        """Store ``k``/``v`` at ``meta.slot_mapping`` (mutates ``kv``), then attend.

        ``sliding_window`` W: a query at position ``p`` attends to keys ``p - W < j <= p``
        (HF transformers' sliding mask); None = full causal. ``logit_softcap`` c: scores
        ``s = scale * q.k`` become ``c * tanh(s / c)`` before mask and softmax (Gemma 2);
        None = off.

        Every backend applies ``kv.key_rotation`` (:func:`rotate_query_key`), writes
        with ``kv.k_scale``/``kv.v_scale`` and reads with them on every path.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``.
            k, v: ``[num_tokens, num_kv_heads, head_dim]``.
            scale: softmax scale (usually ``head_dim ** -0.5``).
        Returns:
            ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
        """


# name -> "module:Class", imported on first use so CPU installs never import triton.
ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry(
    "attention backend", unknown="unknown {kind} {name!r}; choose one of: auto, {allowed}")
ATTENTION_BACKENDS.register_lazy("torch", "kvpilot.engine.attention.torch_backend:TorchAttentionBackend")
ATTENTION_BACKENDS.register_lazy("cpu", "kvpilot.engine.attention.cpu_backend:CpuAttentionBackend")
ATTENTION_BACKENDS.register_lazy("triton", "kvpilot.engine.attention.triton_backend:TritonAttentionBackend")


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto`` = triton on CUDA (when registered); on CPU the ``cpu`` backend when its
    kernels build here (compiled once per machine), else torch with a warning that says
    why; torch on any other device.

    Raises:
        ValueError: an unknown backend name.
    """
    if name == "auto":
        if device.type == "cuda" and "triton" in ATTENTION_BACKENDS:
            return "triton"
        if device.type == "cpu" and "cpu" in ATTENTION_BACKENDS:
            from kvpilot.kernels import cpu_attention

            ok, why = cpu_attention.available()
            if ok:
                return "cpu"
            logger.warning("%s; decode attention falls back to the torch backend (slower)", why)
        return "torch"
    if name not in ATTENTION_BACKENDS:
        raise ATTENTION_BACKENDS.unknown(name)
    return name


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Instantiate the backend ``name`` (after resolving ``auto``)."""
    resolved = resolve_backend_name(name, device)
    backend_cls = ATTENTION_BACKENDS.get(resolved)  # ValueError when it cannot be imported here
    return backend_cls(device)
