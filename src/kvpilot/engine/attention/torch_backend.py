"""The ``torch`` attention backend: the reference path (CPU and CUDA, any dtype)."""

from __future__ import annotations

import torch

from kvpilot.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
    rotate_query_key,
)
from kvpilot.kernels import reference


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with plain torch ops (:mod:`kvpilot.kernels.reference`)."""

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device

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
        q, k = rotate_query_key(q, k, kv)
        reference.store_kv(k, v, kv.key_cache, kv.value_cache, meta.slot_mapping, kv.k_scale, kv.v_scale, **kv.kv4)
        return reference.paged_attention(
            q,
            kv.key_cache,
            kv.value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            kv.k_scale,
            kv.v_scale,
            **kv.kv4,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
