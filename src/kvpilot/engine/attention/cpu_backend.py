"""The ``cpu`` attention backend: decode reads K/V from the pages in place (C++), the
prefill/extend chunks go to PyTorch's fused SDPA kernel. The default on CPU when the
kernels build (:mod:`kvpilot.kernels.cpu_attention`).

Why two paths: a decode query is one token over a long context, memory bound, and on
CPU the torch reference spent more time copying K/V out of the pages than attending;
the C++ kernel walks the block table instead. A prefill chunk has many queries per K/V
row, compute bound: gathering its context once is small next to the attention itself,
and SDPA's flash kernel for CPU (``_scaled_dot_product_flash_attention_for_cpu``, chosen
for a boolean mask without dropout) does the product.
"""

from __future__ import annotations

import torch

from kvpilot.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
    rotate_query_key,
)
from kvpilot.engine.model.layer_ops import CpuLayerOps
from kvpilot.kernels import cpu_attention, reference


class CpuAttentionBackend(AttentionBackend):
    """Store with the reference's vectorized writes, then the in-place C++ decode over the
    batch's leading single-token sequences and SDPA over each prefill chunk.

    Raises:
        ValueError: on a non-CPU device, or when the kernels cannot be built here (the
            message says why; ``--attention-backend torch`` always works).
    """

    name = "cpu"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU only (got {device})")
        ok, why = cpu_attention.available()
        if not ok:
            raise ValueError(f"{why}; use --attention-backend torch")
        self.device = device
        self.layer_ops = CpuLayerOps()

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
        kv4 = kv.kv4
        reference.store_kv(k, v, kv.key_cache, kv.value_cache, meta.slot_mapping, kv.k_scale, kv.v_scale, **kv4)
        masks = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return cpu_attention.paged_decode_attention(
                q, kv.key_cache, kv.value_cache, meta.block_tables, meta.seq_lens, scale, kv.k_scale, kv.v_scale,
                **kv4, **masks,
            )
        out = torch.empty_like(q)
        if nd:
            out[:nd] = cpu_attention.paged_decode_attention(
                q[:nd], kv.key_cache, kv.value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                kv.k_scale, kv.v_scale, **kv4, **masks,
            )
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        if sliding_window is not None or logit_softcap is not None:
            # Prefill chunks of sliding or soft-capped layers: the torch reference's masked
            # path (exact; reads the whole context of the chunk's sequence).
            for i in range(nd, meta.num_seqs):
                s, e = qsl[i], qsl[i + 1]
                out[s:e] = reference.masked_paged_attention(
                    q[s:e], kv.key_cache, kv.value_cache, meta.block_tables[i], lens[i], scale, kv.k_scale,
                    kv.v_scale, **kv4, **masks,
                )
            return out
        # A cache that stores the activations unchanged holds exactly this step's k/v: a
        # chunk that is its sequence's whole context attends to them without a gather.
        exact_cache = kv.kv4_format is None and kv.key_cache.dtype == q.dtype
        for i in range(nd, meta.num_seqs):
            s, e = qsl[i], qsl[i + 1]
            if exact_cache and e - s == lens[i]:
                out[s:e] = reference.causal_attention(q[s:e], k[s:e], v[s:e], scale)
                continue
            out[s:e] = reference.paged_prefill_attention(
                q[s:e], kv.key_cache, kv.value_cache, meta.block_tables[i], lens[i], scale, kv.k_scale,
                kv.v_scale, **kv4,
            )
        return out

