"""The integrity checks raise ``CacheIntegrityError`` naming the numbers that disagree,
and keep doing so under ``python -O`` (they are not ``assert`` statements)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.engine.core.block_pool import CacheIntegrityError
from kvpilot.engine.core.kv_cache_manager import KVCacheManager

from .helpers import make_request, make_scheduler

SRC = Path(__file__).resolve().parents[3] / "src"


def admitted(kv: KVCacheManager, rid: str, prompt: list[int]):
    req = make_request(rid, prompt)
    nodes, hit = kv.match_prefix(req)
    kv.admit(req, nodes, hit)
    return req


def test_a_consistent_cache_passes():
    kv = KVCacheManager(10, 4)
    a = admitted(kv, "a", list(range(9)))
    kv.check_integrity([a])


def test_blocks_that_do_not_add_up_are_named():
    kv = KVCacheManager(10, 4)
    a = admitted(kv, "a", list(range(9)))  # 3 blocks used, 7 free
    kv.pool.num_used += 1
    with pytest.raises(CacheIntegrityError, match=r"free 7 \+ cached 0 \+ used 4 != total 10"):
        kv.check_integrity([a])


def test_a_leaked_reference_names_the_block():
    kv = KVCacheManager(10, 4)
    a = admitted(kv, "a", list(range(9)))
    leaked = a.block_ids[1]
    kv.pool.ref_counts[leaked] += 1
    with pytest.raises(CacheIntegrityError, match=rf"first block {leaked}: ref_count 2, held by 1 requests"):
        kv.check_integrity([a])


def test_a_wrong_cached_count_in_the_tree_is_named():
    kv = KVCacheManager(10, 4)
    kv.radix.num_cached += 1
    with pytest.raises(CacheIntegrityError, match="num_cached=1, counted 0 unreferenced nodes"):
        kv.radix.check_integrity()


def test_a_waiting_request_holding_blocks_is_named():
    sched = make_scheduler()
    req = make_request("w", [1, 2, 3, 4, 5])
    sched.add_request(req)
    sched.schedule()  # admitted: running, holding blocks 0 and 1
    sched.running.remove(req)  # back in the queue without its blocks released
    sched.waiting.appendleft(req)
    with pytest.raises(CacheIntegrityError, match=r"waiting w holds blocks \[0, 1\]"):
        sched.check_integrity()


def test_the_checks_still_run_under_python_dash_o():
    code = (
        "from kvpilot.engine.core.kv_cache_manager import KVCacheManager\n"
        "from kvpilot.engine.core.block_pool import CacheIntegrityError\n"
        "kv = KVCacheManager(4, 4)\n"
        "kv.pool.num_used = 1\n"
        "try:\n"
        "    kv.check_integrity()\n"
        "except CacheIntegrityError as e:\n"
        "    print('raised:', e)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC)}, timeout=60)
    assert out.stdout.strip() == "raised: free 4 + cached 0 + used 1 != total 4"
