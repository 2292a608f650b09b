"""kvpilot's block hashes and KV events against vLLM's own, byte for byte.

tests/engine/fixtures/vllm_kv_events.json holds what vLLM 0.32's real ``KVCacheManager``
emitted (``gen_vllm_kv_events.py`` beside it, run with vLLM's CPU install) for one
scenario, per ``--prefix-caching-hash-algo`` and seed: requests admitted, computed and
freed one after the other (a chain, a branch off it, a full hit, a salted one, an
adapter's, an adapter's salted one, then one that evicts most of them), then a reset.
The same scenario runs here through kvpilot's ``KVCacheManager`` and must give:

- the same ``NONE_HASH`` and the same full block hashes (vLLM's request block hasher);
- each ``BlockStored`` encoded to the same bytes as vLLM's msgspec encoder wrote them;
- the same evicted blocks, each a ``BlockRemoved`` of the same bytes (the eviction order
  is each cache's own LRU: compared as a set);
- the same ``AllBlocksCleared`` after the reset.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_events import (
    HASH_ALGOS,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventCollector,
    resolve_hash_seed,
)
from kvpilot.engine.lora.request import LoRARequest
from tests.engine.core.helpers import make_request

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_kv_events.json").read_text())
CASES = FIXTURE["cases"]
BS = FIXTURE["block_size"]


def encode(ev: BlockStored | BlockRemoved) -> str:
    return msgpack.packb(ev.to_wire(), use_bin_type=True).hex()


def replay(case: dict, seed: str) -> tuple[BlockHasher, list[dict]]:
    """The fixture's scenario through kvpilot's cache; per step the full block hashes
    of the request's blocks, its hit, and the events it caused."""
    hasher = BlockHasher(case["algo"], seed)
    events = KVEventCollector(BS, hasher)
    kv = KVCacheManager(FIXTURE["num_blocks"] - 1, BS, kv_events=events)  # vLLM's block 0 is its null block
    out = []
    for step in case["steps"]:
        lora = LoRARequest(step["lora"]["lora_name"], step["lora"]["lora_int_id"], step["lora"]["lora_path"]) \
            if step["lora"] else None
        req = make_request(step["request"], list(step["token_ids"]), salt=step["cache_salt"], lora=lora)
        nodes, hit = kv.match_prefix(req)
        assert kv.can_admit(req, nodes), step["request"]
        kv.admit(req, nodes, hit)
        req.num_computed_tokens = req.num_tokens
        kv.publish(req)
        full = [kv.radix.node_of(b).block_hash for b in req.block_ids[: req.num_tokens // BS]]
        kv.free(req)
        out.append({"hit": hit, "hashes": full, "events": events.drain()})
    kv.reset_prefix_cache() if hasattr(kv, "reset_prefix_cache") else kv.reset()
    out.append({"events": events.drain()})
    return hasher, out


@pytest.mark.parametrize("case", CASES, ids=[f"{c['algo']}-seed={c['seed']}" for c in CASES])
def test_hashes_and_events_equal_vllms(case, monkeypatch):
    if case["seed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        seed, source = resolve_hash_seed(case["algo"])
        assert (seed, source) == (case["seed_used"], "default")
    else:
        seed = case["seed"]
    hasher, steps = replay(case, seed)
    assert hasher.none_hash.hex() == case["none_hash"]
    for got, want in zip(steps, case["steps"], strict=False):
        rid = want["request"]
        assert got["hit"] == want["num_cached_tokens"], rid
        assert [h.hex() for h in got["hashes"]] == want["block_hashes"], rid
        stores = [encode(ev) for ev in got["events"] if isinstance(ev, BlockStored)]
        removals = sorted(encode(ev) for ev in got["events"] if isinstance(ev, BlockRemoved))
        want_events = [(e["type"], h) for e, h in zip(want["events"], want["events_hex"], strict=True)]
        assert stores == [h for t, h in want_events if t == "BlockStored"], rid
        assert removals == sorted(h for t, h in want_events if t == "BlockRemoved"), rid
        assert len(got["events"]) == len(want_events), rid
    assert [msgpack.packb(ev.to_wire()).hex() for ev in steps[-1]["events"]] == case["reset_events_hex"]


def test_every_vllm_algorithm_is_covered():
    assert {c["algo"] for c in CASES} == set(HASH_ALGOS) - {"sha256_cbor_64bit"}
    assert FIXTURE["vllm_version"] == "0.32.0"


def test_the_seed_follows_pythonhashseed_as_vllm_resolves_it(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "77")
    assert resolve_hash_seed("sha256") == ("77", "PYTHONHASHSEED")
    assert resolve_hash_seed("xxhash") == ("77", "PYTHONHASHSEED")
    assert BlockHasher("sha256").none_hash == BlockHasher("sha256", "77").none_hash
    monkeypatch.delenv("PYTHONHASHSEED")
    assert resolve_hash_seed("sha256_cbor") == ("vllm-none-hash", "default")
    # xxHash is not collision resistant: an unset seed is random per process, as in vLLM.
    a, b = resolve_hash_seed("xxhash"), resolve_hash_seed("xxhash")
    assert a[1] == b[1] == "random" and a[0] != b[0] and len(a[0]) == 64
