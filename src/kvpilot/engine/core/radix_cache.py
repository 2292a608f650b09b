"""Radix prefix cache over full KV blocks (RadixAttention at block granularity).

The tree's edges are whole blocks of token ids, so every node owns exactly one KV block::

    root[ns] ──(t0..t15)──> n0 ──(t16..t31)──> n1 ──(t32..t47)──> n2
                               └─(u16..u31)──> n3

A path from a root spells a prefix whose length is a multiple of ``block_size``; the
block of each node holds the KV of its 16 tokens *at those positions*. Roots are per
namespace ``(lora_name, cache_salt)`` (:data:`~kvpilot.engine.core.request.CacheNamespace`),
so requests with different salts, or under different LoRA adapters (or an adapter and the
base model), never share KV: an adapter changes every layer's K and V. vLLM v1 isolates
them the same way, by mixing the LoRA name and then the salt into its block hashes
(``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``).

Contract:
- :meth:`match` never mutates (not even LRU times); callers lock what they use by taking
  a reference on the block in the :class:`BlockPool` and then calling :meth:`touch`.
- A node is evictable when its block has ``ref_count == 0`` and it has no children;
  eviction is LRU over such leaves, so a chain is trimmed from its tail. Because a
  request holds every block of its prefix, a referenced node's ancestors are referenced
  too, and no locked node or ancestor of one can ever be evicted. (A request that has
  freed blocks behind an all-layer sliding window holds no tree node at all: it drops
  its published prompt blocks together, see ``KVCacheManager.free_skipped``.)
- Blocks are inserted only after their KV has been written (the scheduler publishes a
  block once ``num_computed_tokens`` covers it), so a match never returns unwritten KV.
- With a :class:`~kvpilot.engine.core.kv_events.KVEventCollector` (KV cache events on), every
  inserted block is reported as stored and gets its full block hash
  (``RadixNode.block_hash``, vLLM's: chained from its parent's and mixed with its tree's
  adapter and, in a prefix's first block, its salt), and every evicted block as removed; emptying the tree in :meth:`RadixCache.reset` is reported as all cleared.
  Without one (the default) the cost is one ``if`` per insert and per evicted block.

Design after SGLang's ``RadixCache`` (lock counts, LRU leaf eviction) with vLLM's
full-block granularity (vLLM's design document on automatic prefix caching,
https://docs.vllm.ai/en/latest/design/prefix_caching.html).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvpilot.engine.core.block_pool import BlockPool, CacheIntegrityError
from kvpilot.engine.core.kv_events import ChainHash, KVEventCollector
from kvpilot.engine.core.request import CacheNamespace
from kvpilot.engine.lora.request import LoRARequest

BASE_NAMESPACE: CacheNamespace = (None, None)
"""The namespace of base-model requests without a cache salt."""


class RadixNode:
    """One block of the tree: ``key`` is its ``block_size`` token ids.

    ``namespace`` is the ``(lora_name, cache_salt)`` of the tree the node is in (a root
    holds it, its descendants copy it); ``block_hash`` is the block's full hash
    (:class:`~kvpilot.engine.core.kv_events.BlockHasher`), set at insertion only when
    events are on (0 otherwise, and at roots).
    """

    __slots__ = ("block_hash", "block_id", "children", "key", "last_access", "namespace", "parent")

    def __init__(self, key: tuple[int, ...], block_id: int, parent: RadixNode | None,
                 namespace: CacheNamespace = BASE_NAMESPACE) -> None:
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.last_access = 0
        self.namespace: CacheNamespace = parent.namespace if parent is not None else namespace
        self.block_hash: ChainHash = 0

    @property
    def salt(self) -> str | None:
        """The cache salt of the node's tree."""
        return self.namespace[1]

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter name of the node's tree (None: the base model)."""
        return self.namespace[0]

    def __repr__(self) -> str:
        return f"RadixNode(block={self.block_id}, children={len(self.children)}, t={self.last_access})"


class RadixCache:
    """Prefix tree of published blocks with LRU leaf eviction.

    Args:
        pool: the block pool whose reference counts decide what is locked.
        block_size: tokens per block (the edge length).
        events: where inserts and evictions are reported (KV cache events), or None.
    """

    def __init__(self, pool: BlockPool, block_size: int, events: KVEventCollector | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.events = events
        self._roots: dict[CacheNamespace, RadixNode] = {}
        self._node_of_block: dict[int, RadixNode] = {}
        self._heap: list[tuple[int, int]] = []  # (last_access, block_id); lazily invalidated
        self._clock = 0
        self.num_cached = 0  # blocks in the tree with ref_count == 0 (evictable)

    # ----------------------------------------------------------------- queries
    def match(self, token_ids: Sequence[int], namespace: CacheNamespace = BASE_NAMESPACE) -> list[RadixNode]:
        """Longest cached prefix of ``token_ids`` in full blocks within ``namespace``
        (``(lora_name, cache_salt)``), as nodes root-first.

        Does not mutate anything. ``len(result) * block_size`` tokens are cached.
        """
        node = self._roots.get(namespace)
        if node is None:
            return []
        bs = self.block_size
        out: list[RadixNode] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            child = node.children.get(tuple(token_ids[start : start + bs]))
            if child is None:
                break
            out.append(child)
            node = child
        return out

    def contains(self, block_id: int) -> bool:
        return block_id in self._node_of_block

    def node_of(self, block_id: int) -> RadixNode | None:
        return self._node_of_block.get(block_id)

    @property
    def num_nodes(self) -> int:
        return len(self._node_of_block)

    def root(self, namespace: CacheNamespace = BASE_NAMESPACE) -> RadixNode:
        """The sentinel root for ``namespace`` (``(lora_name, cache_salt)``; created on
        first use; owns no block)."""
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = RadixNode((), -1, None, namespace)
        return node

    # --------------------------------------------------------------- mutation
    def touch(self, nodes: Sequence[RadixNode]) -> None:
        """Mark ``nodes`` as used now (one tick of the logical LRU clock for all)."""
        self._clock += 1
        for node in nodes:
            node.last_access = self._clock
            self._maybe_push(node)

    def insert(self, parent: RadixNode, key: tuple[int, ...], block_id: int,
               lora: LoRARequest | None = None) -> tuple[RadixNode, bool]:
        """Publish ``block_id`` holding ``key`` under ``parent``.

        Returns ``(node, inserted)``. If ``parent`` already has a child with this key the
        existing node is returned with ``inserted=False`` and nothing changes: the caller
        should switch to the existing block (deduplication).

        The block must be referenced by the caller (it is the caller's own computed block).
        With events on, a new node is reported stored (its hash chained from ``parent``'s
        and mixed with ``lora``, the inserting request's adapter, and the tree's salt).

        Raises:
            ValueError: ``key`` is not ``block_size`` tokens long.
            AssertionError: the block is already in the tree or unreferenced, or an
                adapter's tree gets a block without its adapter.
        """
        if len(key) != self.block_size:
            raise ValueError(f"key has {len(key)} tokens, block_size is {self.block_size}")
        existing = parent.children.get(key)
        if existing is not None:
            return existing, False
        if block_id in self._node_of_block:
            raise AssertionError(f"block {block_id} is already in the tree")
        if self.pool.ref_counts[block_id] <= 0:
            raise AssertionError(f"inserting unreferenced block {block_id}")
        node = RadixNode(key, block_id, parent)
        self._clock += 1
        node.last_access = self._clock
        parent.children[key] = node
        self._node_of_block[block_id] = node
        if self.events is not None:
            lora_key, salt = node.namespace
            if (lora_key is None) != (lora is None):
                raise AssertionError(f"block {block_id} of namespace {node.namespace} inserted with adapter {lora}")
            node.block_hash = self.events.block_stored(
                parent.block_hash if parent.block_id >= 0 else None, key, salt, lora)
        return node, True

    def on_unreferenced(self, block_id: int) -> bool:
        """Called when ``block_id``'s ref count drops to 0. Returns True if it stays cached."""
        node = self._node_of_block.get(block_id)
        if node is None:
            return False
        self.num_cached += 1
        self._maybe_push(node)
        return True

    def on_referenced(self, block_id: int) -> None:
        """Called when a cached block's ref count rises from 0 (it is locked again)."""
        if block_id in self._node_of_block:
            self.num_cached -= 1

    def evict(self, n: int) -> list[int]:
        """Remove up to ``n`` unreferenced leaves, least recently used first.

        Returns the evicted block ids; the caller puts them on the pool's free list.
        With events on, they are reported removed.
        """
        evicted, hashes = self._evict(n)
        if self.events is not None:
            self.events.blocks_removed(hashes)
        return evicted

    def _evict(self, n: int) -> tuple[list[int], list[ChainHash]]:
        """:meth:`evict` without the report: (block ids, their hashes when events are on)."""
        evicted: list[int] = []
        hashes: list[ChainHash] = []
        events_on = self.events is not None
        while len(evicted) < n and self._heap:
            last_access, block_id = heapq.heappop(self._heap)
            node = self._node_of_block.get(block_id)
            if node is None or node.last_access != last_access or not self._is_evictable_leaf(node):
                continue  # stale entry
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            del self._node_of_block[block_id]
            self.num_cached -= 1
            evicted.append(block_id)
            if events_on:
                hashes.append(node.block_hash)
            if parent.block_id >= 0:
                self._maybe_push(parent)
        if len(self._heap) > 2 * len(self._node_of_block) + 64:
            self._rebuild_heap()
        return evicted, hashes

    def reset(self) -> list[int]:
        """Drop every unreferenced node (used when prefix caching is reset). Returns blocks.

        With events on: when the tree is empty afterwards this is reported as
        ``AllBlocksCleared`` (as vLLM reports its reset); when blocks held by running
        requests stay, the dropped ones are reported removed one by one instead, since
        "all cleared" would make a router forget blocks that are still cached.
        """
        evicted, hashes = self._evict(len(self._node_of_block))
        if self.events is not None:
            if self._node_of_block:
                self.events.blocks_removed(hashes)
            else:
                self.events.all_cleared(hashes)
        return evicted

    # ---------------------------------------------------------------- helpers
    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return not node.children and self.pool.ref_counts[node.block_id] == 0

    def _maybe_push(self, node: RadixNode) -> None:
        if node.block_id >= 0 and self._is_evictable_leaf(node):
            heapq.heappush(self._heap, (node.last_access, node.block_id))

    def _rebuild_heap(self) -> None:
        self._heap = [
            (n.last_access, b) for b, n in self._node_of_block.items() if self._is_evictable_leaf(n)
        ]
        heapq.heapify(self._heap)

    def check_integrity(self) -> None:
        """Check the tree's invariants (see the module docstring): every node is indexed
        by its block and linked from its parent, no cached block is on the free list, a
        referenced node's parent is referenced too, every indexed node is reachable, and
        ``num_cached`` counts the unreferenced nodes.

        Raises:
            CacheIntegrityError: an invariant does not hold; the message names the numbers.
        """
        seen = 0
        unreferenced = 0
        for ns, root in self._roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                seen += 1
                b = node.block_id
                if self._node_of_block.get(b) is not node:
                    raise CacheIntegrityError(f"block {b} not indexed (namespace {ns!r})")
                if self.pool.is_free(b):
                    raise CacheIntegrityError(f"cached block {b} is also on the free list")
                parent = node.parent
                if parent is None or parent.children.get(node.key) is not node:
                    raise CacheIntegrityError(f"block {b} is not a child of its parent (namespace {ns!r})")
                ref = self.pool.ref_counts[b]
                if ref == 0:
                    unreferenced += 1
                elif parent.block_id >= 0 and self.pool.ref_counts[parent.block_id] <= 0:
                    raise CacheIntegrityError(
                        f"block {b} is referenced ({ref}) but its parent {parent.block_id} is not"
                    )
                stack.extend(node.children.values())
        if seen != len(self._node_of_block):
            raise CacheIntegrityError(f"{seen} nodes reachable, {len(self._node_of_block)} indexed")
        if unreferenced != self.num_cached:
            raise CacheIntegrityError(f"num_cached={self.num_cached}, counted {unreferenced} unreferenced nodes")
