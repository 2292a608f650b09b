import pytest

from kvpilot.engine.core.block_pool import BlockPool, OutOfBlocksError


def test_take_and_release_exact_order():
    pool = BlockPool(10)
    assert pool.take(3) == [0, 1, 2]
    assert pool.ref_counts[:4] == [1, 1, 1, 0]
    assert (pool.num_free, pool.num_used) == (7, 3)
    assert pool.decref(1) == 0
    pool.release([1])
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 1]
    assert pool.take(8) == [3, 4, 5, 6, 7, 8, 9, 1]
    with pytest.raises(OutOfBlocksError):
        pool.take(1)


def test_shared_block_needs_every_reference_dropped():
    pool = BlockPool(4)
    (b,) = pool.take(1)
    assert pool.incref(b) == 2
    assert pool.decref(b) == 1
    assert pool.num_used == 1
    assert pool.decref(b) == 0
    assert pool.num_used == 0


def test_misuse_is_caught():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.incref(0)  # free blocks cannot be referenced
    (b,) = pool.take(1)
    with pytest.raises(AssertionError):
        pool.release([b])  # still referenced
    pool.decref(b)
    with pytest.raises(AssertionError):
        pool.decref(b)  # double free
    pool.release([b])
    with pytest.raises(AssertionError):
        pool.release([b])  # already free


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockPool(0)
