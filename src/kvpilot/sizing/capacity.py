"""KV-cache sizing and FinOps arithmetic (pure, standard library).

The formula (PagedAttention keeps a K and a V vector per token, per layer, per KV head),
written once here in :func:`kv_token_bytes`::

    kv_bytes = 2 x bytes_per_element x num_layers x num_kv_heads x head_dim x tokens

Llama-3-70B (80 layers, 8 KV heads, head_dim 128) in fp16: 327,680 B per token, so 8,192
tokens take 2.68 GB and 65,536 tokens 21.47 GB (decimal GB); fp8 halves that.

Sliding windows: a layer that attends to the last W tokens only needs their K/V, but the
engine's blocks hold every layer's K/V for their tokens, so a block can be given back only
when no layer needs it any more. When every layer slides (Mistral-7B-v0.1) a sequence
holds at most ``cdiv(W, block_size) + 1`` blocks (:func:`sliding_window_tokens`: the
window straddles one block boundary at most); when sliding and full layers interleave
(Gemma 2/3) the full layers keep every block, so the KV of a hybrid is sized as full
attention (the sliding layers do not save memory yet). The window never changes the
bytes per token, nor does a mixture of experts (experts hold no KV).

Users: the engine sizes its KV pool with :func:`kv_token_bytes` and :func:`kv_dtype`
(``kvpilot.engine.kv_cache``); ``kvpilot kv-calc`` prints these numbers offline; the
operator's FinOps status reuses :func:`max_concurrent_requests`, :func:`cost_per_hour` and
:func:`cost_per_million_tokens` with the values the engines report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9  # decimal, as GPU and memory vendors print it
GIB = 1024**3


@dataclass(frozen=True)
class KvDtype:
    """Storage of one KV element.

    Attributes:
        name: the ``--kv-cache-dtype`` spelling.
        bits: bits per value.
        group_size: values sharing one scale (0 = no per-group scale; a per-tensor scale is
            a few bytes per layer and is ignored).
        scale_bytes: bytes per group scale.
        scale_format: what the scale is stored as (for the printout).
        head_dim_multiple: head_dim must be a multiple of this (the engine's 4-bit layout
            packs the two halves of head_dim into one byte, a group of 16 in each half).
    """

    name: str
    bits: int
    group_size: int = 0
    scale_bytes: int = 0
    scale_format: str = ""
    head_dim_multiple: int = 1

    @property
    def bytes_per_element(self) -> float:
        """Value bytes plus the amortized group-scale bytes."""
        scale = self.scale_bytes / self.group_size if self.group_size else 0.0
        return self.bits / 8 + scale


# 4-bit formats: one scale per 16 values along head_dim, an FP8 E4M3 scale for both (the
# NVFP4 layout, under a per-layer fp32 scale the engine keeps; kvpilot.kernels.kv4):
# 0.5 + 1/16 = 0.5625 B per value, 3.56x fewer than bf16. (An FP16 group scale would
# make it 0.625 B, 3.2x: under the 3.5x the engine promises.)
KV_DTYPES: dict[str, KvDtype] = {
    d.name: d
    for d in (
        KvDtype("float32", 32),
        KvDtype("bfloat16", 16),
        KvDtype("float16", 16),
        KvDtype("fp8", 8),
        KvDtype("fp8_e4m3", 8),
        KvDtype("fp8_e5m2", 8),
        KvDtype("fp4_e2m1", 4, group_size=16, scale_bytes=1, scale_format="fp8_e4m3", head_dim_multiple=32),
        KvDtype("int4", 4, group_size=16, scale_bytes=1, scale_format="fp8_e4m3", head_dim_multiple=32),
    )
}
KV_DTYPES["fp16"] = KV_DTYPES["float16"]
KV_DTYPES["bf16"] = KV_DTYPES["bfloat16"]
KV_DTYPES["fp32"] = KV_DTYPES["float32"]


def kv_dtype(name: str) -> KvDtype:
    """Look up a KV dtype by name; ValueError lists the allowed names."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"KV dtype must be one of {', '.join(sorted(KV_DTYPES))}; got {name!r}"
        ) from None


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0; got {value!r}")
    if math.isinf(value):
        raise ValueError(f"{name} must be finite; got {value!r}")


def kv_token_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float
) -> float:
    """Bytes of K and V for one token across ``num_layers`` layers, unchecked:
    ``2 x bytes_per_element x num_layers x num_kv_heads x head_dim``. ``bytes_per_element``
    includes amortized group scales (:attr:`KvDtype.bytes_per_element`)."""
    return 2 * bytes_per_element * num_layers * num_kv_heads * head_dim


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> float:
    """Bytes of K and V for one token across all layers (:func:`kv_token_bytes`) for the
    KV dtype named ``dtype``.

    Raises:
        ValueError: a non-positive shape, an unknown dtype, or a ``head_dim`` the dtype's
            group layout cannot hold (4-bit formats need a multiple of 32).
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        _positive(name, value)
    d = kv_dtype(dtype)
    multiple = max(d.group_size, d.head_dim_multiple)
    if head_dim % multiple:
        raise ValueError(f"head_dim must be a multiple of {multiple} for {d.name}; got {head_dim}")
    return kv_token_bytes(num_layers, num_kv_heads, head_dim, d.bytes_per_element)


def kv_bytes(bytes_per_token: float, tokens: int) -> float:
    """KV bytes for ``tokens`` tokens of one request (or a whole pool)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0; got {tokens}")
    return bytes_per_token * tokens


def kv_memory_bytes(
    gpu_memory_bytes: float,
    gpu_memory_utilization: float,
    weight_bytes: float,
    reserved_bytes: float = 0.0,
) -> float:
    """Memory left for the KV cache: ``total x utilization - weights - reserved``, floored
    at 0. ``reserved_bytes`` stands for activations, CUDA graphs and the runtime; with 0 the
    result is an upper bound."""
    _positive("gpu_memory_bytes", gpu_memory_bytes)
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {gpu_memory_utilization}")
    if weight_bytes < 0 or reserved_bytes < 0:
        raise ValueError(
            f"weight_bytes and reserved_bytes must be >= 0; got {weight_bytes}, {reserved_bytes}"
        )
    return max(0.0, gpu_memory_bytes * gpu_memory_utilization - weight_bytes - reserved_bytes)


def kv_capacity_tokens(kv_memory: float, bytes_per_token: float, block_size: int = 16) -> int:
    """Tokens the KV pool holds: whole blocks of ``block_size`` tokens that fit."""
    _positive("bytes_per_token", bytes_per_token)
    _positive("block_size", block_size)
    if kv_memory < 0:
        raise ValueError(f"kv_memory must be >= 0; got {kv_memory}")
    return int(kv_memory // (bytes_per_token * block_size)) * block_size


def sliding_window_tokens(sliding_window: int, block_size: int = 1) -> int:
    """The most KV tokens one sequence holds when every layer slides with window
    ``sliding_window``: ``(cdiv(W, block_size) + 1) x block_size`` (whole blocks; the last
    W tokens straddle at most one more block boundary than W alone needs). That is the
    steady state the engine's block freeing reaches in decode; while a prefill chunk of C
    tokens runs, the request briefly holds about C more."""
    _positive("sliding_window", sliding_window)
    _positive("block_size", block_size)
    return (math.ceil(sliding_window / block_size) + 1) * block_size


def kv_tokens_per_request(
    context_tokens: float, block_size: int = 1, sliding_window: int | None = None
) -> int:
    """KV tokens one request of ``context_tokens`` tokens holds at its longest: whole
    blocks, at most :func:`sliding_window_tokens` when ``sliding_window`` is given (pass
    it only when every layer slides: ``ModelShape.kv_window``)."""
    _positive("context_tokens", context_tokens)
    _positive("block_size", block_size)
    tokens = math.ceil(context_tokens / block_size) * block_size
    if sliding_window is not None:
        tokens = min(tokens, sliding_window_tokens(sliding_window, block_size))
    return tokens


def max_concurrent_requests(
    capacity_tokens: int,
    context_tokens: float,
    block_size: int = 1,
    sliding_window: int | None = None,
) -> int:
    """Requests of ``context_tokens`` tokens (prompt + output) that fit at once. Each takes
    whole blocks, so with ``block_size`` > 1 the last partial block counts in full; with
    ``sliding_window`` (every layer slides) a request takes at most
    :func:`sliding_window_tokens`."""
    if capacity_tokens < 0:
        raise ValueError(f"capacity_tokens must be >= 0; got {capacity_tokens}")
    per_request = kv_tokens_per_request(context_tokens, block_size, sliding_window)
    return int(capacity_tokens // per_request)


def cost_per_hour(cost_per_replica_hour: float, replicas: int) -> float:
    """``finops.costPerReplicaHour`` x replicas."""
    if cost_per_replica_hour < 0 or replicas < 0:
        raise ValueError(
            f"cost_per_replica_hour and replicas must be >= 0; got {cost_per_replica_hour},"
            f" {replicas}"
        )
    return cost_per_replica_hour * replicas


def cost_per_million_tokens(hourly_cost: float, generated_tokens_per_second: float) -> float | None:
    """Cost of one million generated tokens at the current rate; ``None`` when nothing is
    being generated (the cost per token is undefined, not infinite)."""
    if hourly_cost < 0:
        raise ValueError(f"hourly_cost must be >= 0; got {hourly_cost}")
    if generated_tokens_per_second < 0:
        raise ValueError(
            f"generated_tokens_per_second must be >= 0; got {generated_tokens_per_second}"
        )
    if generated_tokens_per_second == 0:
        return None
    return hourly_cost / (generated_tokens_per_second * 3600.0) * 1e6


@dataclass(frozen=True)
class FinOps:
    """The FinOps view of a deployment (status fields, ``kv-calc`` output).

    Attributes:
        kv_capacity_tokens: per replica.
        max_concurrent_requests: per replica, at ``mean_context_tokens`` (None if unknown).
        cost_per_hour: for all replicas.
        cost_per_million_tokens: at the current generation rate (None if idle or unknown).
    """

    kv_capacity_tokens: int
    mean_context_tokens: float | None
    max_concurrent_requests: int | None
    replicas: int
    cost_per_hour: float | None
    cost_per_million_tokens: float | None


def finops(
    kv_capacity_tokens: int,
    replicas: int,
    mean_context_tokens: float | None = None,
    cost_per_replica_hour: float | None = None,
    generated_tokens_per_second: float | None = None,
    block_size: int = 1,
    sliding_window: int | None = None,
) -> FinOps:
    """Everything the operator writes to status, from what the engines report.

    Args:
        kv_capacity_tokens: ``kvpilot:kv_cache_capacity_tokens`` of one replica.
        replicas: ready replicas.
        mean_context_tokens: observed mean context (prompt + generated) per request, e.g.
            KV usage x capacity / running requests; ``None`` skips the concurrency estimate.
        cost_per_replica_hour: ``finops.costPerReplicaHour``; ``None`` skips costs.
        generated_tokens_per_second: ``rate(kvpilot:generation_tokens_total)`` summed over pods.
        sliding_window: the window when every layer of the model slides (caps the KV a
            request holds); None for full attention and for hybrids.
    """
    conc = None
    if mean_context_tokens:
        conc = max_concurrent_requests(
            kv_capacity_tokens, mean_context_tokens, block_size, sliding_window
        )
    hourly = (
        None if cost_per_replica_hour is None else cost_per_hour(cost_per_replica_hour, replicas)
    )
    per_m = None
    if hourly is not None and generated_tokens_per_second is not None:
        per_m = cost_per_million_tokens(hourly, generated_tokens_per_second)
    return FinOps(kv_capacity_tokens, mean_context_tokens, conc, replicas, hourly, per_m)
