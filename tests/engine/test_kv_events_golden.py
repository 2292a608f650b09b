"""Golden bytes of the KV cache events wire format.

The other KV event tests decode what the publisher sends (so a change that decodes to
the same values passes them); these pin the bytes themselves: the block hashes of a
fixed chain (a salted block included) and the msgpack payload of each batch
``split_salted`` cuts from one step's events, as vllm-router 0.1.17 accepted them (see
docs/engine.md, "KV cache events"). A change to the hash, the map order, the msgpack
types or the batch split shows here as a byte difference.
"""

from __future__ import annotations

from kvpilot.engine.core.kv_events import BlockStored, KVEventCollector, block_hash
from kvpilot.engine.kv_events import encode_batch, split_salted

TS = 1767225600.25  # 2026-01-01T00:00:00.25Z, a float as vLLM sends it

# One step: a two-block chain, a salted root block, two evictions (merged), a clear.
HASHES = (5556960498205426651, 15878834505052875087, 14051191967057738359)
BATCHES = (
    # unsalted store: [ts, [BlockStored(2 blocks, no extra_keys)], rank 0]
    "93cb41da556e401000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7392cf4d1e4a218e6983dbcfdc5cf3da48e4694fb1706172656e745f626c6f636b5f68617368c0a974"
    "6f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d65"
    "6469756da3475055a96c6f72615f6e616d65c000",
    # the salted store alone, with extra_keys [["tenant-a"]]
    "93cb41da556e401000009189a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7391cfc2ffdca5cb4c7a77b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394"
    "01020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f7261"
    "5f6e616d65c0aa65787472615f6b6579739191a874656e616e742d6100",
    # BlockRemoved (both hashes, in eviction order), AllBlocksCleared
    "93cb41da556e401000009283a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368"
    "657392cfdc5cf3da48e4694fcf4d1e4a218e6983dba66d656469756da347505581a474797065b0416c"
    "6c426c6f636b73436c656172656400",
)


def step_events() -> tuple[tuple[int, int, int], list]:
    c = KVEventCollector(4)
    h1 = c.block_stored(None, [1, 2, 3, 4], None)
    h2 = c.block_stored(h1, [5, 6, 7, 8], None)
    hs = c.block_stored(None, [1, 2, 3, 4], "tenant-a")
    c.blocks_removed([h2])
    c.blocks_removed([h1])
    c.all_cleared()
    return (h1, h2, hs), c.drain()


def test_block_hashes_are_golden():
    hashes, _ = step_events()
    assert hashes == HASHES
    assert block_hash(None, [1, 2, 3, 4], None) == HASHES[0]


def test_one_steps_batches_are_golden_bytes():
    _, events = step_events()
    payloads = [encode_batch(TS, run, 0).hex() for run in split_salted(events)]
    assert payloads == list(BATCHES)


def test_a_full_64_bit_hash_and_the_rank_are_golden_bytes():
    payload = encode_batch(1.5, [BlockStored([2**64 - 1], None, [0] * 4, 4)], 3)
    assert payload.hex() == (
        "93cb3ff80000000000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368"
        "657391cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964"
        "739400000000aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c"
        "6f72615f6e616d65c003")


# LoRA adapter blocks: the hash mixes the adapter name (then the salt), the store names
# the adapter (lora_id, lora_name) and carries [name] or [name, salt] per block, and
# split_salted sends it alone so the base-model store of the same step stays creditable.
ADAPTER_HASHES = (10014023254221326127, 8125639080724078713, 3991422119832322350)
ADAPTER_BATCHES = (
    # the base-model store, alone (byte-identical to a store before adapters existed)
    "93cb41da556e401000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7391cf4d1e4a218e6983dbb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394"
    "01020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f7261"
    "5f6e616d65c000",
    # the adapter's stores: lora_id 1, lora_name, extra_keys [[name], [name]] and [[name, salt]]
    "93cb41da556e401000009289a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7392cf8af8f517d85d072fcf70c411b143972079b1706172656e745f626c6f636b5f68617368c0a974"
    "6f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f696401a66d65"
    "6469756da3475055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b6579739291a8"
    "73716c2d6c6f726191a873716c2d6c6f726189a474797065ab426c6f636b53746f726564ac626c6f63"
    "6b5f68617368657391cf37646145413e012eb1706172656e745f626c6f636b5f68617368c0a9746f6b"
    "656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f696401a66d656469756da347"
    "5055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b6579739192a873716c2d6c6f"
    "7261a874656e616e742d6100",
    # the removal of the base block, in a batch the router accepts
    "93cb41da556e401000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368"
    "657391cf4d1e4a218e6983dba66d656469756da347505500",
)


def adapter_step_events() -> tuple[tuple[int, int, int], list]:
    c = KVEventCollector(4)
    base = c.block_stored(None, [1, 2, 3, 4], None)
    a0 = c.block_stored(None, [1, 2, 3, 4], None, lora_name="sql-lora", lora_id=1)
    a1 = c.block_stored(a0, [5, 6, 7, 8], None, lora_name="sql-lora", lora_id=1)
    a_salted = c.block_stored(None, [1, 2, 3, 4], "tenant-a", lora_name="sql-lora", lora_id=1)
    c.blocks_removed([base])
    return (a0, a1, a_salted), c.drain()


def test_adapter_block_hashes_are_golden():
    hashes, _ = adapter_step_events()
    assert hashes == ADAPTER_HASHES
    assert block_hash(None, [1, 2, 3, 4], None, "sql-lora") == ADAPTER_HASHES[0]


def test_a_step_with_adapter_blocks_is_golden_bytes():
    _, events = adapter_step_events()
    payloads = [encode_batch(TS, run, 0).hex() for run in split_salted(events)]
    assert payloads == list(ADAPTER_BATCHES)
