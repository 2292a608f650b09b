"""Tensor parallelism: the process group and the split of a model over its ranks.

The layers that communicate (the vocab-parallel embedding and LM head, the row-parallel
reductions) are :mod:`kvpilot.engine.model.layers`.

The split is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"), as vLLM and SGLang apply it to
inference:

- the QKV and gate/up projections are column-parallel: rank ``r`` of ``N`` holds rows
  ``[r * out / N, (r + 1) * out / N)`` (whole heads for attention), and computes its heads'
  attention and its slice of the MLP without communication;
- the output (``o_proj``) and ``down`` projections are row-parallel: rank ``r`` holds the
  matching columns, and the partial sums are added by one all-reduce per projection (a
  bias is added by rank 0 only);
- KV heads are split across the ranks with the query heads that use them (an uneven
  split when ``N`` does not divide them: :func:`head_range`). When there are fewer KV
  heads than ranks each KV head is replicated on ``N / num_kv_heads`` ranks (vLLM's
  ``QKVParallelLinear``), so every rank's query heads find their KV head locally;
- the embedding and LM head are vocab-parallel: rank ``r`` holds rows ``[r * V', (r + 1) *
  V')`` of the vocabulary, ``V' = ceil(V / N)`` (zero-padded); an embedding lookup is a
  masked local lookup plus an all-reduce, and the logits are all-gathered;
- MoE experts are split along their intermediate dimension (every rank holds a slice of
  every expert; vLLM's tensor-parallel ``FusedMoE``), one all-reduce per MoE block, the
  shared expert's partial sum included.

So a step costs ``2 x num_layers + 1`` all-reduces and one all-gather of the logits.
Every rank holds its own heads' shard of every KV block: block tables and slot mappings
are the same on all ranks, and the scheduler on rank 0 plans for all of them.

The process group is built directly on a ``TCPStore`` (gloo on CPU, NCCL on CUDA) rather
than ``torch.distributed``'s global default group, so that one process can run several
engines one after another (tests) and an engine never touches state it does not own.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from kvpilot.engine.model.config import ModelConfig

# How long a collective (and the start-up rendezvous) may wait for a peer.
TP_TIMEOUT_SECONDS = 120.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process ended: the engine cannot run another step (its
    shard of the weights and of the KV cache is gone). The server fails the requests in
    flight, ``/health`` fails and the process exits non-zero."""


@dataclass
class TPGroup:
    """One rank's view of the tensor-parallel group.

    Attributes:
        rank, size: this rank and the number of ranks.
        device: this rank's device (``cuda:rank`` on CUDA).
        pg: the gloo / NCCL process group (None when ``size == 1``).
        num_all_reduces, num_all_gathers: collectives run so far (the benchmark's count).
    """

    rank: int
    size: int
    device: torch.device
    pg: Any = None
    num_all_reduces: int = 0
    num_all_gathers: int = 0
    _store: Any = field(default=None, repr=False)

    @classmethod
    def connect(cls, rank: int, size: int, port: int, device: torch.device,
                store: Any = None, timeout: float = TP_TIMEOUT_SECONDS) -> TPGroup:
        """Join the group whose TCPStore listens on ``127.0.0.1:port`` (rank 0 passes the
        store it created). Blocks until all ``size`` ranks have joined or ``timeout`` s.

        Raises:
            RuntimeError: from torch.distributed, a rank did not join in time.
        """
        td = datetime.timedelta(seconds=timeout)
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, False, timeout=td)
        prefixed = dist.PrefixStore("kvpilot-tp", store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, size, td)
        return cls(rank, size, device, pg, _store=store)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``. A no-op for one rank."""
        if self.size > 1:
            self.pg.allreduce([x]).wait()
            self.num_all_reduces += 1
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, c]`` on every rank -> ``[n, c * size]``: the ranks' blocks side by side,
        rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        self.num_all_gathers += 1
        return torch.cat(parts, dim=-1)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``x`` over the ranks, in place; returns ``x``. A no-op
        for one rank. Quantized KV caches use it so that every rank fixes the scales one
        device would fix from all the heads (:meth:`PagedKVCache._needed`)."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.pg.allreduce([x], opts).wait()
            self.num_all_reduces += 1
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV block count every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        """Drop the process group and the store (idempotent)."""
        pg, self.pg, self._store = self.pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            with contextlib.suppress(Exception):  # a peer already gone: nothing left to release
                pg.shutdown()


# ------------------------------------------------------------------ the split
def head_range(config: ModelConfig, rank: int, size: int) -> tuple[int, int, int, int]:
    """``(first query head, query heads, first KV head, KV heads)`` of rank ``rank``.

    With at least as many KV heads as ranks, rank ``r`` holds KV heads ``[kv * r // size,
    kv * (r + 1) // size)`` and the query heads that attend to them: the usual even split
    when ``size`` divides ``kv``, else an uneven one (SmolLM2's 3 KV heads over 2 ranks: 1
    and 2), still exact since every query head stays with its KV head. With fewer KV heads
    than ranks, the query heads split evenly and each rank holds the one KV head its
    queries use (vLLM's replication)."""
    kv, group = config.num_kv_heads, config.num_heads // config.num_kv_heads
    if kv >= size:
        first, end = kv * rank // size, kv * (rank + 1) // size
        return first * group, (end - first) * group, first, end - first
    per = config.num_heads // size
    return rank * per, per, rank * kv // size, 1


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse a split this model cannot take, before any process starts.

    Raises:
        ValueError: naming ``--tensor-parallel-size``, the value, the model field it does
            not fit, and the sizes that work.
    """
    if size == 1:
        return

    def refuse(what: str) -> ValueError:
        ok = [n for n in range(1, 2 * config.num_heads + 1) if _splits(config, n)]
        return ValueError(f"--tensor-parallel-size {size} cannot split this model: {what}; "
                          f"sizes it can be split into: {', '.join(map(str, ok))}")

    kv = config.num_kv_heads
    if kv < size and (size % kv or config.num_heads % size):
        raise refuse(f"with fewer KV heads ({kv}) than ranks, the size must be a multiple of the KV heads "
                     f"and divide num_attention_heads ({config.num_heads})")
    for what, value in (("intermediate_size", config.intermediate_size),
                        ("moe_intermediate_size", config.moe_intermediate_size),
                        ("shared_expert_intermediate_size", config.shared_expert_intermediate_size)):
        if value % size:
            raise refuse(f"it does not divide the model's {what} {value}")


def _splits(config: ModelConfig, n: int) -> bool:
    kv = config.num_kv_heads
    return ((kv >= n or (n % kv == 0 and config.num_heads % n == 0))
            and all(v % n == 0 for v in (config.intermediate_size, config.moe_intermediate_size,
                                         config.shared_expert_intermediate_size)))


def rank_config(config: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The shapes rank ``rank`` holds: its query and KV heads (:func:`head_range`) and
    every intermediate size divided by ``size``. The vocabulary, hidden size and head size
    stay whole (:class:`~kvpilot.engine.model.layers.VocabParallelEmbedding` splits the vocabulary). Call
    :func:`check_tensor_parallel` first."""
    if size == 1:
        return config
    _, q_heads, _, kv_heads = head_range(config, rank, size)
    return replace(
        config,
        num_heads=q_heads,
        num_kv_heads=kv_heads,
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size,
    )


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """``(first, end, rows)``: rank ``rank`` holds vocabulary rows ``[first, end)`` in a
    table of ``rows = ceil(vocab_size / size)`` rows (zero-padded past ``end``)."""
    rows = math.ceil(vocab_size / size)
    first = min(rank * rows, vocab_size)
    return first, min(first + rows, vocab_size), rows


# HF tensor names by how they are split.
_COLUMN = re.compile(r"\.(q_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)$")
_KV = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj|w2)\.(weight|bias)$")
_FUSED_QKV = re.compile(r"\.qkv_proj\.(weight|bias)$")
_FUSED_GATE_UP = re.compile(r"\.gate_up_proj\.(weight|bias)$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                  rank: int, size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``rank``'s part of each HF-named full tensor (same names; the model built
    from :func:`rank_config` then loads them as usual). q and o take the rank's query
    heads (rows of q, columns of o), k/v its KV heads (:func:`head_range`); gate/up
    (experts' too) rows and down columns of an even slice of the intermediate dimension;
    a row-parallel bias stays on rank 0 (zeros elsewhere: it is added once); Phi-3's fused
    ``qkv_proj``/``gate_up_proj`` each part's rows; the embedding and LM head the rank's
    vocabulary rows (zero-padded). Norms, routers and scales are whole on every rank.

    Args:
        config: the full model's config (not the rank's).
    """
    if size == 1:
        yield from weights
        return
    hd, q, kv = config.head_dim, config.q_size, config.kv_size
    q_first, q_heads, kv_first, kv_heads = head_range(config, rank, size)

    def q_part(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.narrow(dim, q_first * hd, q_heads * hd)

    def kv_part(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(0, kv_first * hd, kv_heads * hd)

    for name, t in weights:
        if _VOCAB.search(name):
            first, end, rows = vocab_range(t.shape[0], rank, size)
            out = t.new_zeros((rows, *t.shape[1:]))
            out[: end - first] = t[first:end]
            t = out
        elif m := _COLUMN.search(name):
            t = q_part(t) if m.group(1) == "q_proj" else _chunk(t, 0, rank, size)
        elif _KV.search(name):
            t = kv_part(t)
        elif m := _ROW.search(name):
            if m.group(2) == "bias":
                t = t if rank == 0 else torch.zeros_like(t)
            elif m.group(1) == "o_proj":
                t = q_part(t, 1)
            else:
                t = _chunk(t, t.dim() - 1, rank, size)
        elif _FUSED_QKV.search(name):
            tq, tk, tv = t.split([q, kv, kv], dim=0)
            t = torch.cat([q_part(tq), kv_part(tk), kv_part(tv)])
        elif _FUSED_GATE_UP.search(name):
            gate, up = t.chunk(2, dim=0)
            t = torch.cat([_chunk(gate, 0, rank, size), _chunk(up, 0, rank, size)])
        yield name, t.contiguous()
