"""Block tables for requests: prefix matching, admission, growth, publishing and freeing.

The manager owns the :class:`BlockPool` and, with prefix caching on, the
:class:`RadixCache`. Symmetric pairs: ``can_admit``/``admit``, ``grow``, ``free``.

Capacity seen by the scheduler is ``num_free + num_cached``: cached blocks whose
ref count is 0 are evicted (LRU, leaves first) only when the free list runs dry.

Sliding windows: when *every* attention layer of the model slides with window ``W``
(Mistral-style; ``sliding_window=W``), a query at position ``p`` sees keys
``p - W < j <= p``, so once a request's next query starts at ``s`` (its
``num_computed_tokens``) no layer reads a block whose last position is ``< s - W + 1``.
:meth:`KVCacheManager.free_skipped` (called by the scheduler after each step) drops those
blocks and puts :data:`NULL_BLOCK` in their block-table entries, so a request generating
far past the window holds about ``cdiv(W, block_size) + 1`` blocks. After vLLM's
``SlidingWindowManager.remove_skipped_blocks`` (``vllm/v1/core/single_type_kv_cache_manager.py``).
With prefix caching on, such a request publishes only its prompt's full blocks, keeps
them until the window has passed all of them and then drops them together, so the radix
tree never holds a cached block above a referenced one (its invariants and LRU eviction
are unchanged); prefix hits then lock the whole matched chain as before. Hybrid models
(any full-attention layer, e.g. Gemma 2/3) pass ``sliding_window=None``: the global
layers read every block, nothing is freed early.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvpilot.engine.core.block_pool import BlockPool, CacheIntegrityError, OutOfBlocksError
from kvpilot.engine.core.kv_events import KVEventCollector
from kvpilot.engine.core.radix_cache import RadixCache, RadixNode
from kvpilot.engine.core.request import Request

NULL_BLOCK = 0
"""Block id written into block-table entries whose block was freed behind the sliding
window. It carries no reference and is not reserved: block 0's KV memory is zero at
start-up and only ever holds finite KV afterwards (the same id the model runner pads
block tables with), so a kernel or reference that reads the entry and masks it by
position stays finite. Nothing is ever written through a null entry: slot mappings only
cover positions ``>= num_computed_tokens``, which are inside the window."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates KV blocks to requests.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep computed full blocks in a radix tree for reuse.
        kv_events: collects KV cache events (blocks stored in and evicted from the radix
            tree, resets), or None for no events. Needs prefix caching.
        sliding_window: tokens each query sees (the query included) when *every* layer
            of the model slides (``ModelConfig.all_layers_slide``); blocks behind it are
            freed as requests advance (see the module docstring). None (default, and
            for hybrid or full-attention models): nothing is freed early.

    Raises:
        ValueError: ``block_size < 1``, ``sliding_window < 1``, or ``kv_events``
            without prefix caching.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 kv_events: KVEventCollector | None = None, sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if kv_events is not None and not enable_prefix_caching:
            raise ValueError("KV cache events need prefix caching: only blocks in the prefix cache are reported")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        self.radix: RadixCache | None = (
            RadixCache(self.pool, block_size, kv_events) if enable_prefix_caching else None)

    # ------------------------------------------------------------ accounting
    @property
    def enable_prefix_caching(self) -> bool:
        return self.radix is not None

    @property
    def num_cached_blocks(self) -> int:
        """Evictable blocks: in the prefix cache, held by no request."""
        return self.radix.num_cached if self.radix is not None else 0

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get now: free plus evictable."""
        return self.pool.num_free + self.num_cached_blocks

    @property
    def usage(self) -> float:
        """Share of blocks held by requests, 0..1 (evictable cached blocks count as free)."""
        return self.pool.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @staticmethod
    def num_held_blocks(request: Request) -> int:
        """Blocks the request holds a reference on (its block table less null entries)."""
        return len(request.block_ids) - request.num_skipped_blocks

    def num_publishable_blocks(self, request: Request) -> int:
        """Full blocks of the request that :meth:`publish` will eventually insert into
        the radix tree once computed: every full block normally; with a sliding window,
        only the prompt's, and none once the request has freed blocks."""
        if self.sliding_window is None:
            return request.num_tokens // self.block_size
        if request.num_skipped_blocks:
            return 0
        return min(request.num_tokens, request.num_prompt_tokens) // self.block_size

    # ------------------------------------------------------------- matching
    def match_prefix(self, request: Request) -> tuple[list[RadixNode], int]:
        """Cached full blocks for the request's tokens and how many tokens to skip.

        Only blocks of the request's namespace (its LoRA adapter and cache salt) match.
        Returns ``(nodes, num_hit_tokens)``. At least one token is always left to
        compute, so a full hit reports ``num_tokens - 1`` (the last token is recomputed
        for its logits; its KV is already cached). Does not mutate anything.
        """
        if self.radix is None or request.num_tokens == 0:
            return [], 0
        nodes = self.radix.match(request.token_ids, request.cache_namespace)
        return nodes, min(len(nodes) * self.block_size, request.num_tokens - 1)

    # ------------------------------------------------------------ admission
    def can_admit(self, request: Request, nodes: list[RadixNode], reserve_blocks: int = 0) -> bool:
        """Whether blocks for the request's *whole* current token list fit, leaving
        ``reserve_blocks`` available afterwards. Matched blocks that are now evictable
        stop being evictable once locked, so they are subtracted."""
        needed = self.blocks_for(request.num_tokens) - len(nodes)
        relocked = sum(1 for n in nodes if self.pool.ref_counts[n.block_id] == 0)
        return self.num_available_blocks - relocked - needed >= reserve_blocks

    def admit(self, request: Request, nodes: list[RadixNode], num_hit_tokens: int) -> None:
        """Lock the matched blocks and allocate the rest of the token list.

        Mutates ``request.block_ids``, ``num_computed_tokens``, ``num_prefix_kv_tokens``,
        ``num_published_blocks`` and ``last_node``. Call only after :meth:`can_admit`.
        """
        assert not request.block_ids, f"{request.request_id} already holds blocks"
        for node in nodes:
            if self.pool.incref(node.block_id) == 1:
                assert self.radix is not None
                self.radix.on_referenced(node.block_id)
        if self.radix is not None:
            self.radix.touch(nodes)
        new_blocks = self._allocate(self.blocks_for(request.num_tokens) - len(nodes))
        request.block_ids = [n.block_id for n in nodes] + new_blocks
        request.num_skipped_blocks = 0
        request.num_computed_tokens = num_hit_tokens
        request.num_prefix_kv_tokens = len(nodes) * self.block_size
        request.num_published_blocks = len(nodes)
        if self.radix is not None:
            request.last_node = nodes[-1] if nodes else self.radix.root(request.cache_namespace)

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens. False if out of blocks
        (nothing is allocated then)."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        if needed > self.num_available_blocks:
            return False
        request.block_ids.extend(self._allocate(needed))
        return True

    def _allocate(self, n: int) -> list[int]:
        if n <= 0:
            return []
        short = n - self.pool.num_free
        if short > 0:
            if self.radix is None or self.radix.num_cached < short:
                raise OutOfBlocksError(f"need {n} blocks, {self.num_available_blocks} available")
            self.pool.release(self.radix.evict(short))
        return self.pool.take(n)

    # ----------------------------------------------------------- publishing
    def publish(self, request: Request) -> None:
        """Insert the request's newly computed full blocks into the radix tree.

        A block is published only once every token in it has its KV written
        (``num_computed_tokens`` covers it). If an identical block was published first
        by another request, this request switches to that block and frees its own copy,
        so each prefix is cached once and referenced chains stay contiguous.

        With a sliding window only prompt blocks are published, and nothing once the
        request has freed blocks behind the window (:meth:`free_skipped`): the blocks it
        holds are then no longer a chain from the root.
        """
        radix = self.radix
        if radix is None or request.num_skipped_blocks:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        if self.sliding_window is not None:
            num_full = min(num_full, request.num_prompt_tokens // bs)
        parent = request.last_node
        assert parent is not None
        lora = request.lora_request
        for i in range(request.num_published_blocks, num_full):
            own = request.block_ids[i]
            node, inserted = radix.insert(parent, tuple(request.token_ids[i * bs : (i + 1) * bs]), own, lora)
            if not inserted and node.block_id != own:
                if self.pool.incref(node.block_id) == 1:
                    radix.on_referenced(node.block_id)
                request.block_ids[i] = node.block_id
                self._decref([own])
            parent = node
        request.num_published_blocks = max(request.num_published_blocks, num_full)
        request.last_node = parent

    # -------------------------------------------------------------- freeing
    def free(self, request: Request) -> None:
        """Drop the request's references. Published blocks stay cached (evictable);
        the rest return to the free list. Tail blocks are released first; null entries
        (already freed behind the sliding window) are skipped, so each block is
        released exactly once."""
        if self.radix is not None and request.num_published_blocks and not request.num_skipped_blocks:
            nodes = [self.radix.node_of(b) for b in request.block_ids[: request.num_published_blocks]]
            self.radix.touch([n for n in nodes if n is not None])
        self._decref(reversed(request.block_ids[request.num_skipped_blocks :]))
        request.block_ids = []
        request.num_skipped_blocks = 0
        request.num_published_blocks = 0
        request.last_node = None
        request.num_prefix_kv_tokens = 0

    def num_skippable_blocks(self, request: Request) -> int:
        """Leading blocks no layer reads again: 0 without a sliding window.

        The next step's first query is at ``s = num_computed_tokens`` and later queries
        only move right; a query at ``p`` sees keys ``p - W < j <= p``, so the smallest
        key still read is ``s - W + 1``. Block ``i`` covers positions
        ``[i * bs, (i + 1) * bs)`` and is behind the window iff ``(i + 1) * bs <= s - W + 1``,
        i.e. the first ``(s - W + 1) // bs`` blocks (a chunked prefill's whole chunk
        counts from its first query, so nothing it reads is freed).
        """
        w = self.sliding_window
        if w is None:
            return 0
        return min(max(0, (request.num_computed_tokens - w + 1) // self.block_size), len(request.block_ids))

    def free_skipped(self, request: Request) -> int:
        """Free the request's blocks that every layer's sliding window has left behind.

        Mutates ``request.block_ids`` (freed entries become :data:`NULL_BLOCK`),
        ``num_skipped_blocks`` and, when the published prompt blocks go, ``last_node``.
        Blocks in the radix tree stay there as evictable cache. Published blocks form a
        chain from the root and are freed only together, once the window has passed
        all of them (a cached block above a referenced one would break the tree's
        invariants and make ``num_cached_blocks`` count a block eviction cannot reach);
        after that the request publishes nothing more. Unpublished blocks are freed as
        soon as they fall behind. Returns how many blocks were freed (0 without a
        window). The source of the idea: vLLM's ``SlidingWindowManager``
        (``remove_skipped_blocks``), which swaps such blocks for its null block.
        """
        k = self.num_skippable_blocks(request)
        start = request.num_skipped_blocks
        if k <= start or k < request.num_published_blocks:
            return 0
        if start == 0 and request.num_published_blocks and self.radix is not None:
            nodes = [self.radix.node_of(b) for b in request.block_ids[: request.num_published_blocks]]
            self.radix.touch([n for n in nodes if n is not None])
            request.last_node = None
        self._decref(reversed(request.block_ids[start:k]))
        request.block_ids[start:k] = [NULL_BLOCK] * (k - start)
        request.num_skipped_blocks = k
        return k - start

    def _decref(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self.pool.decref(b) == 0 and not (self.radix is not None and self.radix.on_unreferenced(b)):
                self.pool.release([b])

    def reset_prefix_cache(self) -> int:
        """Evict every unreferenced cached block. Returns how many were dropped. With KV
        events on, reported as all cleared when nothing stays cached, else as removals
        (:meth:`RadixCache.reset`)."""
        if self.radix is None:
            return 0
        dropped = self.radix.reset()
        self.pool.release(dropped)
        return len(dropped)

    # ------------------------------------------------------------ integrity
    def check_integrity(self, live_requests: Iterable[Request] = ()) -> None:
        """Check ``free + cached + used == total``, that each block's ref count equals
        the number of live requests holding it (null entries behind a sliding window hold
        nothing and may only lead a block table), and that free blocks are unreferenced
        and out of the tree; then the radix tree's own invariants.

        Raises:
            CacheIntegrityError: an invariant does not hold; the message names the numbers.
        """
        pool = self.pool
        free = pool.free_block_ids()
        if len(free) != len(set(free)):
            twice = sorted(b for b, n in Counter(free).items() if n > 1)
            raise CacheIntegrityError(f"blocks {twice} are on the free list more than once")
        if pool.num_free + self.num_cached_blocks + pool.num_used != self.num_blocks:
            raise CacheIntegrityError(
                f"free {pool.num_free} + cached {self.num_cached_blocks} + used {pool.num_used} "
                f"!= total {self.num_blocks}"
            )
        holders = [0] * self.num_blocks
        for req in live_requests:
            skipped = req.num_skipped_blocks
            if skipped and (self.sliding_window is None or skipped > len(req.block_ids)
                            or any(b != NULL_BLOCK for b in req.block_ids[:skipped])):
                raise CacheIntegrityError(
                    f"{req.request_id} has {skipped} skipped blocks (window {self.sliding_window}) "
                    f"but block table {req.block_ids}")
            held = req.block_ids[skipped:]
            if len(held) != len(set(held)):
                raise CacheIntegrityError(f"{req.request_id} holds a block twice: {req.block_ids}")
            for b in held:
                holders[b] += 1
        wrong = [b for b in range(self.num_blocks) if holders[b] != pool.ref_counts[b]]
        if wrong:
            b = wrong[0]
            raise CacheIntegrityError(
                f"ref counts differ from the block tables of live requests at {len(wrong)} blocks, "
                f"first block {b}: ref_count {pool.ref_counts[b]}, held by {holders[b]} requests"
            )
        referenced = sum(1 for c in pool.ref_counts if c > 0)
        if referenced != pool.num_used:
            raise CacheIntegrityError(f"{referenced} blocks are referenced but num_used is {pool.num_used}")
        for b in free:
            if pool.ref_counts[b] != 0:
                raise CacheIntegrityError(f"free block {b} has ref_count {pool.ref_counts[b]}")
            if self.radix is not None and self.radix.contains(b):
                raise CacheIntegrityError(f"free block {b} is in the tree")
        if self.radix is not None:
            self.radix.check_integrity()
