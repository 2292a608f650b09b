"""Attention backends over the paged KV cache, chosen by ``--attention-backend``."""

from kvpilot.engine.attention.backend import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
