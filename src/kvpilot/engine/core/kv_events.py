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
over the parent's hash, the LoRA adapter's name, the cache salt and the block's token
ids. A block of an adapter or a salted block carries those keys in ``extra_keys`` (one
entry per block: the adapter name first, then the salt, as vLLM orders the keys it mixes
into a hash in ``generate_block_hash_extra_keys``, ``vllm/v1/core/kv_cache_utils.py``),
and an adapter's block names it in ``lora_id`` (its ``lora_int_id``) and ``lora_name``,
as vLLM's ``BlockPool.cache_full_blocks`` does (``vllm/v1/core/block_pool.py``).

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
    for base-model unsalted blocks, else one tuple per block: ``(lora_name,)``,
    ``(lora_name, salt)`` or ``(salt,)`` (both are in every hash of the chain; the order
    is vLLM's). ``lora_id`` and ``lora_name`` name the adapter (None: the base model)."""

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
_LORA = b"\x02"  # never a salt marker's first byte (0x00 or 0x01)


def block_hash(parent_hash: int | None, token_ids: Sequence[int], salt: str | None,
               lora_name: str | None = None) -> int:
    """The block's identity on the wire: an unsigned 64-bit int (``0 <= h < 2**64``).

    blake2b (8-byte digest) over: the parent's hash (or a marker at a tree's root), the
    LoRA adapter's name when there is one (a marker and the length-prefixed UTF-8 name;
    nothing for the base model), the salt (length-prefixed UTF-8, or a marker without
    one) and the token ids as little-endian uint32. Stable across processes and machines
    (Python's ``hash()`` is not), so two engines holding the same prefix report the same
    hashes. The chain makes a hash identify the whole prefix; the adapter name and the
    salt (in vLLM's order: the LoRA name first) make an adapter's or a salted block
    differ from a base-model or unsalted one with the same tokens, so a KV-aware router
    never matches one with the other. Base-model blocks hash as they did before adapters
    existed.

    Raises:
        struct.error: a token id outside ``0 .. 2**32 - 1`` (the engine refuses those
            at admission, so this never happens for a cached block).
    """
    h = hashlib.blake2b(digest_size=8, person=b"kvpilot-kvblock")
    h.update(_NO_PARENT if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "big"))
    if lora_name is not None:
        raw_name = lora_name.encode()
        h.update(_LORA + len(raw_name).to_bytes(4, "big") + raw_name)
    if salt is None:
        h.update(_NO_SALT)
    else:
        raw = salt.encode()
        h.update(b"\x01" + len(raw).to_bytes(4, "big") + raw)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "big")


def extra_keys(lora_name: str | None, salt: str | None) -> tuple[str, ...] | None:
    """One block's ``extra_keys`` entry: the keys mixed into its hash besides the parent
    and the tokens, in vLLM's order (LoRA name, then salt); None when there are none."""
    if lora_name is None:
        return None if salt is None else (salt,)
    return (lora_name,) if salt is None else (lora_name, salt)


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

    def block_stored(self, parent_hash: int | None, token_ids: Sequence[int], salt: str | None,
                     lora_name: str | None = None, lora_id: int | None = None,
                     event_lora_name: str | None = None) -> int:
        """Record one block entering the tree under a parent with ``parent_hash`` (None
        at a root) and return its hash (:func:`block_hash`). ``lora_name`` (the adapter's
        cache key, mixed into the hash) and ``lora_id`` name the adapter of the block's
        tree (None: the base model); ``event_lora_name`` is the adapter's name as the
        event and its ``extra_keys`` carry it (default ``lora_name``).

        A block whose parent is the last block of the previous event (a request
        publishing several blocks) extends that event, as vLLM sends one ``BlockStored``
        per request and step; a chain has one adapter and one salt, so the event's
        ``lora_id``, ``lora_name`` and ``extra_keys`` layout hold for every block."""
        h = block_hash(parent_hash, token_ids, salt, lora_name)
        if lora_name is not None and event_lora_name is not None:
            lora_name = event_lora_name
        keys = extra_keys(lora_name, salt)
        events = self.events
        last = events[-1] if events else None
        if (type(last) is BlockStored and parent_hash is not None and last.block_hashes[-1] == parent_hash
                and last.lora_id == lora_id):
            last.block_hashes.append(h)
            last.token_ids.extend(token_ids)
            if last.extra_keys is not None:
                last.extra_keys.append(keys)
        else:
            events.append(BlockStored([h], parent_hash, list(token_ids), self.block_size, lora_id=lora_id,
                                      lora_name=lora_name, extra_keys=None if keys is None else [keys]))
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
