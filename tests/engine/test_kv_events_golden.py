"""Golden bytes of the KV cache events wire format.

The other KV event tests decode what the publisher sends (so a change that decodes to
the same values passes them); these pin the bytes themselves: the block hashes of a
fixed chain (a salted block included) and the msgpack payload of each batch
``split_salted`` cuts from one step's events, as vllm-router 0.1.17 accepted them (see
docs/engine.md, "KV cache events"). A change to the hash, the map order, the msgpack
types or the batch split shows here as a byte difference.
"""

from __future__ import annotations

from kvpilot.engine.core.kv_events import BlockHasher, BlockStored, KVEventCollector, external_hash
from kvpilot.engine.kv_events import encode_batch, split_salted
from kvpilot.engine.lora.request import LoRARequest

TS = 1767225600.25  # 2026-01-01T00:00:00.25Z, a float as vLLM sends it
HASHER = BlockHasher("sha256", "1234")  # vLLM's default algorithm, PYTHONHASHSEED=1234
SQL = LoRARequest("sql-lora", 1, "/adapters/sql-lora")

# One step: a two-block chain, a salted root block, two evictions, a clear. The hashes are
# vLLM 0.32's for PYTHONHASHSEED=1234 (tests/engine/fixtures/vllm_kv_events.json has the
# same chain, salted block and adapter blocks, emitted by vLLM itself).
HASHES = (9219627661045641575, 9124841118524688016, 6399352458402704702)
BATCHES = (
    # unsalted store: [ts, [BlockStored(2 blocks, extra_keys [None, None])], rank 0]
    "93cb41da556e40100000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7392cf7ff2b28291fdb167cf7ea1f2a6dd8ac690b1706172656e745f626c6f636b5f68617368c0a974"
    "6f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d65"
    "6469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69"
    "647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00",
    # the salted store alone, with extra_keys [["tenant-a"]]
    "93cb41da556e40100000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7391cf58cf1127db9dad3eb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394"
    "01020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f7261"
    "5f6e616d65c0aa65787472615f6b6579739191a874656e616e742d61a967726f75705f69647800b26b"
    "765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00",
    # one BlockRemoved per block (in eviction order), AllBlocksCleared
    "93cb41da556e401000009384a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368"
    "657391cf7ea1f2a6dd8ac690a66d656469756da3475055a967726f75705f6964780084a474797065ac"
    "426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf7ff2b28291fdb167a66d65646975"
    "6da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400",
)


def step_events() -> tuple[tuple[int, int, int], list]:
    c = KVEventCollector(4, HASHER)
    h1 = c.block_stored(None, [1, 2, 3, 4])
    h2 = c.block_stored(h1, [5, 6, 7, 8])
    hs = c.block_stored(None, [1, 2, 3, 4], "tenant-a")
    c.blocks_removed([h2])
    c.blocks_removed([h1])
    c.all_cleared()
    return tuple(external_hash(h) for h in (h1, h2, hs)), c.drain()


def test_block_hashes_are_golden():
    hashes, _ = step_events()
    assert hashes == HASHES
    assert external_hash(HASHER.hash_block(None, [1, 2, 3, 4])) == HASHES[0]


def test_one_steps_batches_are_golden_bytes():
    _, events = step_events()
    payloads = [encode_batch(TS, run, 0).hex() for run in split_salted(events)]
    assert payloads == list(BATCHES)


def test_a_full_64_bit_hash_and_the_rank_are_golden_bytes():
    payload = encode_batch(1.5, [BlockStored([2**64 - 1], None, [0] * 4, 4)], 3)
    assert payload.hex() == (
        "93cb3ff8000000000000918aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
        "7391cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394"
        "00000000aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f7261"
        "5f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c"
        "5f617474656e74696f6e03")


# LoRA adapter blocks: the hash mixes the adapter (then the salt, in a first block), the
# store names the adapter (lora_id, lora_name) and carries [name] or [name, salt] per block, and
# split_salted sends it alone so the base-model store of the same step stays creditable.
ADAPTER_HASHES = (3286739003016709734, 16510358397044062238, 9261387164968364636)
ADAPTER_BATCHES = (
    # the base-model store, alone
    "93cb41da556e40100000918ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7391cf7ff2b28291fdb167b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394"
    "01020304aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f7261"
    "5f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b26b765f63616368655f73"
    "7065635f6b696e64ae66756c6c5f617474656e74696f6e00",
    # the adapter's stores: lora_id 1, lora_name, extra_keys [[name], [name]] and [[name, salt]]
    "93cb41da556e40100000928ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7392cf2d9cd7b5983b8666cfe520937c8a32f81eb1706172656e745f626c6f636b5f68617368c0a974"
    "6f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f696401a66d65"
    "6469756da3475055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b6579739291a8"
    "73716c2d6c6f726191a873716c2d6c6f7261a967726f75705f69647800b26b765f63616368655f7370"
    "65635f6b696e64ae66756c6c5f617474656e74696f6e8ba474797065ab426c6f636b53746f726564ac"
    "626c6f636b5f68617368657391cf80870e8ebf4d2a5cb1706172656e745f626c6f636b5f68617368c0"
    "a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f696401a66d656469"
    "756da3475055a96c6f72615f6e616d65a873716c2d6c6f7261aa65787472615f6b6579739192a87371"
    "6c2d6c6f7261a874656e616e742d61a967726f75705f69647800b26b765f63616368655f737065635f"
    "6b696e64ae66756c6c5f617474656e74696f6e00",
    # the removal of the base block, in a batch the router accepts
    "93cb41da556e401000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368"
    "657391cf7ff2b28291fdb167a66d656469756da3475055a967726f75705f6964780000",
)


def adapter_step_events() -> tuple[tuple[int, int, int], list]:
    c = KVEventCollector(4, HASHER)
    base = c.block_stored(None, [1, 2, 3, 4])
    a0 = c.block_stored(None, [1, 2, 3, 4], None, SQL)
    a1 = c.block_stored(a0, [5, 6, 7, 8], None, SQL)
    a_salted = c.block_stored(None, [1, 2, 3, 4], "tenant-a", SQL)
    c.blocks_removed([base])
    return tuple(external_hash(h) for h in (a0, a1, a_salted)), c.drain()


def test_adapter_block_hashes_are_golden():
    hashes, _ = adapter_step_events()
    assert hashes == ADAPTER_HASHES
    assert external_hash(HASHER.hash_block(None, [1, 2, 3, 4], (("lora", "sql-lora", "/adapters/sql-lora"),))) \
        == ADAPTER_HASHES[0]


def test_a_step_with_adapter_blocks_is_golden_bytes():
    _, events = adapter_step_events()
    payloads = [encode_batch(TS, run, 0).hex() for run in split_salted(events)]
    assert payloads == list(ADAPTER_BATCHES)
