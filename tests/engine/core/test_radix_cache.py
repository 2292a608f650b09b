"""Exact-state tests of the radix prefix cache through the KV cache manager
(block size 4, ten blocks)."""

import pytest

from kvpilot.engine.core.block_pool import OutOfBlocksError
from kvpilot.engine.core.kv_cache_manager import KVCacheManager

from .helpers import make_request


def admit(kv: KVCacheManager, req):
    nodes, hit = kv.match_prefix(req)
    assert kv.can_admit(req, nodes)
    kv.admit(req, nodes, hit)
    return hit


def compute_all(kv: KVCacheManager, req):
    req.num_computed_tokens = req.num_tokens
    kv.publish(req)


def test_publish_free_and_reuse_exact_blocks():
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(1, 11)))  # 10 tokens -> 3 blocks, 2 full
    assert admit(kv, a) == 0
    assert a.block_ids == [0, 1, 2]
    compute_all(kv, a)
    assert a.num_published_blocks == 2
    kv.free(a)
    # Full blocks stay cached; the partial block returns to the free list tail.
    assert kv.num_cached_blocks == 2
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2]
    kv.check_integrity()

    b = make_request("b", [*range(1, 9), 50, 51])
    assert admit(kv, b) == 8
    assert b.block_ids == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [1, 1, 0, 1]
    assert kv.num_cached_blocks == 0
    kv.check_integrity([b])


def test_c03_full_prompt_hit_recomputes_only_the_last_token():
    kv = KVCacheManager(10, 4)
    prompt = list(range(1, 13))  # exactly 3 x BS
    a = make_request("a", prompt)
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    b = make_request("b", prompt)
    assert admit(kv, b) == 11  # 3 x BS - 1
    assert b.num_computed_tokens == 11
    assert b.block_ids == [0, 1, 2]  # all shared with a
    assert b.num_prefix_kv_tokens == 12  # position 11's KV is cached: its write is skipped
    # Extending the prompt still hits the whole chain.
    kv.free(b)
    c = make_request("c", [*prompt, 13, 14])
    assert admit(kv, c) == 12
    kv.check_integrity([c])


def test_match_never_mutates():
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    before = [(n.block_id, n.last_access) for n in kv.radix.match(list(range(8)))]
    kv.radix.match(list(range(8)))
    kv.match_prefix(make_request("x", list(range(8))))
    after = [(n.block_id, n.last_access) for n in kv.radix.match(list(range(8)))]
    assert before == after
    assert kv.num_cached_blocks == 2


def test_cache_salt_namespaces_prefixes():
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(8)), salt="tenant-a")
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    assert kv.match_prefix(make_request("b", list(range(8)), salt="tenant-b"))[1] == 0
    assert kv.match_prefix(make_request("c", list(range(8))))[1] == 0
    assert kv.match_prefix(make_request("d", list(range(8)), salt="tenant-a"))[1] == 7


def test_lru_evicts_leaves_first_in_exact_order():
    kv = KVCacheManager(6, 2)
    # Chain X: blocks 0,1 (tokens 1..4); chain Y: blocks 2,3 (tokens 9..12).
    x = make_request("x", [1, 2, 3, 4])
    admit(kv, x)
    compute_all(kv, x)
    kv.free(x)
    y = make_request("y", [9, 10, 11, 12])
    admit(kv, y)
    compute_all(kv, y)
    kv.free(y)
    assert kv.num_cached_blocks == 4
    assert kv.pool.free_block_ids() == [4, 5]
    # Touch chain X again (a match + lock), then release: X is now most recent.
    x2 = make_request("x2", [1, 2, 3, 4, 5])
    admit(kv, x2)  # takes blocks 0, 1 and a new block 4
    kv.free(x2)
    # Need 4 blocks with 2 free: evict Y's leaf (3) then Y's root (2); X untouched.
    z = make_request("z", list(range(20, 28)))
    admit(kv, z)
    assert z.block_ids == [5, 4, 3, 2]
    assert kv.radix.contains(0) and kv.radix.contains(1)
    assert not kv.radix.contains(2) and not kv.radix.contains(3)
    kv.check_integrity([z])


def test_c02_locked_nodes_and_their_ancestors_are_never_evicted():
    kv = KVCacheManager(5, 2)
    a = make_request("a", [1, 2, 3, 4, 5, 6])  # 3 full blocks
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    # A running request locks the first two blocks of that chain.
    b = make_request("b", [1, 2, 3, 4, 7])
    assert admit(kv, b) == 4
    assert b.block_ids[:2] == [0, 1]
    kv.check_integrity([b])
    # Only the unlocked leaf (block 2) and the free block can be taken.
    assert kv.num_available_blocks == 2
    c = make_request("c", [30, 31, 32, 33])
    admit(kv, c)
    assert sorted(c.block_ids) == [2, 4]
    assert kv.radix.contains(0) and kv.radix.contains(1)
    with pytest.raises(OutOfBlocksError):
        kv._allocate(1)
    kv.check_integrity([b, c])


def test_duplicate_publish_switches_to_the_cached_block():
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(8)))
    admit(kv, a)
    admit(kv, b)  # same step: nothing published yet, so no hit
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    compute_all(kv, a)
    compute_all(kv, b)
    assert b.block_ids == [0, 1]  # deduplicated onto a's published blocks
    assert kv.pool.ref_counts[:4] == [2, 2, 0, 0]
    assert kv.pool.free_block_ids()[-2:] == [2, 3]
    kv.check_integrity([a, b])


def test_without_prefix_caching_blocks_go_straight_back():
    kv = KVCacheManager(4, 2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4])
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)
    assert kv.num_cached_blocks == 0
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
    assert kv.match_prefix(make_request("b", [1, 2, 3, 4]))[1] == 0
