"""The KV block pool: reference counts and the free list.

The pool only does bookkeeping over block ids ``0 .. num_blocks - 1``; the tensors that
hold the KV values live in :mod:`kvpilot.engine.kv_cache` and are indexed by the same ids.

Each block is in exactly one of three states::

    free     ref_count == 0, on the free list, not in the prefix cache
    cached   ref_count == 0, in the prefix cache (evictable), not on the free list
    used     ref_count  > 0, held by at least one request's block table

The pool tracks ``free`` and ``used``; the radix cache tracks which blocks are cached.
``check_integrity()`` (on the KV cache manager, the radix cache and the scheduler) checks
that the three states add up and raises :class:`CacheIntegrityError` when they do not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are taken than the free list holds (a scheduler bug)."""


class CacheIntegrityError(RuntimeError):
    """The block accounting broke an invariant (a bug, never bad input).

    Raised by the ``check_integrity()`` methods with the numbers that disagree. They are
    real checks, not ``assert`` statements, so they still run under ``python -O``.
    """


class BlockPool:
    """Reference counts and a FIFO free list over ``num_blocks`` KV blocks.

    Args:
        num_blocks: total blocks in the pool (>= 1).

    The free list is FIFO: a block released earlier is reused earlier, which keeps the
    order deterministic for tests.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free: list[bool] = [True] * num_blocks
        self.num_used = 0

    @property
    def num_free(self) -> int:
        """Blocks on the free list (not counting evictable cached blocks)."""
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """Pop ``n`` blocks off the free list with ref_count 1 each.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free (callers evict first).
        """
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
            self.ref_counts[b] = 1
        self.num_used += n
        return out

    def incref(self, block_id: int) -> int:
        """Add one reference; returns the new count. A free block cannot be referenced."""
        if self._is_free[block_id]:
            raise AssertionError(f"incref of free block {block_id}")
        if self.ref_counts[block_id] == 0:
            self.num_used += 1
        self.ref_counts[block_id] += 1
        return self.ref_counts[block_id]

    def decref(self, block_id: int) -> int:
        """Drop one reference; returns the new count (the caller decides free vs cached)."""
        count = self.ref_counts[block_id]
        if count <= 0:
            raise AssertionError(f"decref of unreferenced block {block_id}")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            self.num_used -= 1
        return count - 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Put unreferenced blocks back on the free list (tail: reused last)."""
        for b in block_ids:
            if self.ref_counts[b] != 0 or self._is_free[b]:
                raise AssertionError(f"release of block {b}: ref={self.ref_counts[b]}, free={self._is_free[b]}")
            self._is_free[b] = True
            self._free.append(b)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list in reuse order (for tests and the integrity check)."""
        return list(self._free)
