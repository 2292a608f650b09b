"""KV cache events: the blocks the prefix cache stores and evicts, as plain objects.

The radix cache reports each full block it inserts (``BlockStored``), each block it
evicts (``BlockRemoved``) and emptying the whole tree (``AllBlocksCleared``) to a
:class:`KVEventCollector`; the engine drains the collector once per step and hands the
list to a publisher (:mod:`kvpilot.engine.kv_events`: the ZMQ thread, msgpack encoding,
replay), which KV-aware routers subscribe to.

This module is what the scheduling core needs and nothing more: standard library only,
no encoding and no sockets. Each event's :meth:`to_wire` is its msgpack map (the field
order is the wire's, pinned by tests/engine/test_kv_events_golden.py), and
:func:`block_hash` is the block's identity on the wire: an unsigned 64-bit int, blake2b
over the parent's hash, the block's token ids and the cache salt. A salted block carries
its salt in ``extra_keys`` (one entry per block), as vLLM does for the keys it mixes into
a hash.

Event types after vLLM's ``vllm/distributed/kv_events.py``; the code is kvpilot's own.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The medium of the engine's own KV cache, as vLLM names its device pool.
MEDIUM_GPU = "GPU"

@dataclass(slots=True)
class BlockStored:
    """Full blocks entered the prefix cache, a contiguous chain: block ``i``'s parent is
    block ``i - 1``, the first one's is ``parent_block_hash`` (None at a tree's root).

    ``token_ids`` holds ``len(block_hashes) * block_size`` ids; ``extra_keys`` is None
    for unsalted blocks, else one ``(salt,)`` per block (the salt is in every hash of a
    salted chain)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[str, ...] | None] | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
            "lora_name": self.lora_name,
        }
        if self.extra_keys is not None:  # vLLM omits defaults (omit_defaults=True)
            out["extra_keys"] = self.extra_keys
        return out


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was emptied (``reset_prefix_cache`` with no block in use)."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


_NO_PARENT = b"\x00"
_NO_SALT = b"\x00"


def block_hash(parent_hash: int | None, token_ids: Sequence[int], salt: str | None) -> int:
    """The block's identity on the wire: an unsigned 64-bit int (``0 <= h < 2**64``).

    blake2b (8-byte digest) over: the parent's hash (or a marker at a tree's root), the
    salt (length-prefixed UTF-8, or a marker without one) and the token ids as
    little-endian uint32. Stable across processes and machines (Python's ``hash()`` is
    not), so two engines holding the same prefix report the same hashes. The chain makes
    a hash identify the whole prefix, and the salt makes a salted block differ from an
    unsalted one with the same tokens.

    Raises:
        struct.error: a token id outside ``0 .. 2**32 - 1`` (the engine refuses those
            at admission, so this never happens for a cached block).
    """
    h = hashlib.blake2b(digest_size=8, person=b"kvpilot-kvblock")
    h.update(_NO_PARENT if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "big"))
    if salt is None:
        h.update(_NO_SALT)
    else:
        raw = salt.encode()
        h.update(b"\x01" + len(raw).to_bytes(4, "big") + raw)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "big")


class KVEventCollector:
    """The events of the current engine step, in order (engine thread only).

    The radix cache calls :meth:`block_stored`, :meth:`blocks_removed` and
    :meth:`all_cleared`; the engine calls :meth:`drain` once per step. Nothing is
    encoded here.

    Args:
        block_size: tokens per block (the ``block_size`` field of ``BlockStored``).
    """

    __slots__ = ("block_size", "events")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[KVEvent] = []

    def block_stored(self, parent_hash: int | None, token_ids: Sequence[int], salt: str | None) -> int:
        """Record one block entering the tree under a parent with ``parent_hash`` (None
        at a root) and return its hash. A block whose parent is the last block of the
        previous event (a request publishing several blocks) extends that event, as
        vLLM sends one ``BlockStored`` per request and step."""
        h = block_hash(parent_hash, token_ids, salt)
        events = self.events
        last = events[-1] if events else None
        if type(last) is BlockStored and parent_hash is not None and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(h)
            last.token_ids.extend(token_ids)
            if last.extra_keys is not None:
                last.extra_keys.append((salt,) if salt is not None else None)
        else:
            extra: list[tuple[str, ...] | None] | None = None if salt is None else [(salt,)]
            events.append(BlockStored([h], parent_hash, list(token_ids), self.block_size, extra_keys=extra))
        return h

    def blocks_removed(self, hashes: list[int]) -> None:
        """Record evicted blocks (merged into a preceding ``BlockRemoved``)."""
        if not hashes:
            return
        events = self.events
        last = events[-1] if events else None
        if type(last) is BlockRemoved:
            last.block_hashes.extend(hashes)
        else:
            events.append(BlockRemoved(list(hashes)))

    def all_cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        """The events so far, in order; the collector starts empty again."""
        events, self.events = self.events, []
        return events
