"""The ``triton`` attention backend: Triton kernels for the KV store, paged decode
(split-KV) and paged prefill/extend (:mod:`kvpilot.kernels`). The default on CUDA.

On CPU it runs only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
start-up): slow, meant for tests at tiny shapes.
"""

from __future__ import annotations

import torch

from kvpilot.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
    rotate_query_key,
)
from kvpilot.kernels.decode_attention import paged_decode_attention
from kvpilot.kernels.prefill_attention import paged_prefill_attention
from kvpilot.kernels.store_kv import store_kv
from kvpilot.kernels.triton_utils import INTERPRET, is_fp8


class TritonAttentionBackend(AttentionBackend):
    """One step per layer: store the new K/V (quantizing for FP8 and 4-bit), then the decode kernel
    over the batch's leading single-token sequences and the prefill/extend kernel over
    the rest, both writing into one output tensor. A layer's sliding window and logit
    soft-cap run inside both kernels (keys before the window are never read).

    Raises:
        ValueError: on a CPU device without ``TRITON_INTERPRET=1``.
    """

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and not INTERPRET:
            raise ValueError(
                f"the triton attention backend needs a CUDA device (got {device}); on CPU use "
                "--attention-backend torch, or set TRITON_INTERPRET=1 before starting (slow, "
                "for tests)"
            )
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
        quantized = is_fp8(kv.key_cache.dtype) or kv.kv4_format is not None
        k_scale = kv.k_scale if quantized else None
        v_scale = kv.v_scale if quantized else None
        kv4 = kv.kv4
        store_kv(k, v, kv.key_cache, kv.value_cache, meta.slot_mapping, k_scale, v_scale, **kv4)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(
                q[:nd],
                kv.key_cache,
                kv.value_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                k_scale,
                v_scale,
                max_seq_len=max(meta.seq_lens_cpu[:nd]),
                out=out[:nd],
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
                **kv4,
            )
        if nd < meta.num_seqs:
            # query_start_loc keeps absolute offsets into q, so the decodes' rows are
            # simply not covered by any remaining sequence.
            paged_prefill_attention(
                q,
                kv.key_cache,
                kv.value_cache,
                meta.block_tables[nd:],
                meta.query_start_loc[nd:],
                meta.seq_lens[nd:],
                scale,
                k_scale,
                v_scale,
                max_query_len=meta.max_query_len,
                out=out,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
                **kv4,
            )
        return out
