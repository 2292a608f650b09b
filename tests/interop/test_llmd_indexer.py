"""llm-d's precise prefix-cache indexer (llm-d-kv-cache-manager v0.3.0, the helper in
tests/interop/llmd_indexer) fed by a ZMQ PUB that connects to it, as an engine does:

- its block keys equal the Python ``sha256_cbor_64bit`` chain in tests/interop/llmd.py
  (this pins the hash an engine must publish for llm-d to find its blocks);
- a positional BlockStored on ``kv@<pod>@<model>`` makes llm-d's scorer rank that pod
  first for prompts sharing the prefix, and BlockRemoved takes the blocks back out;
- what v0.3.0 drops or ignores: event arrays of any other length than
  ``[tag, hashes, parent, token_ids, block_size, lora_id]`` / ``[tag, hashes]`` (a trailing
  ``medium``, vLLM's newer fields, the map-tagged form), batches of any other length than
  ``[ts, events, dp_rank]``, and AllBlocksCleared (a no-op there).

Every wait polls llm-d's own /score with a deadline; a negative ("not indexed") is
checked after a later event of the same pod has been indexed (llm-d digests one pod's
messages in order, and one batch's events in order)."""

from __future__ import annotations

import msgpack
import pytest

from tests.interop.llmd import (
    LlmdIndexer,
    LlmdIndexerError,
    all_blocks_cleared,
    block_hashes,
    block_removed,
    block_stored,
    event_batch,
)

pytestmark = pytest.mark.tools  # runs llmd-indexer, built by `make tools`

SEED = "1234"  # the engines' PYTHONHASHSEED, llm-d's --hash-seed
BS = 16
MODEL = "kvpilot/test-model"
PREFIX = list(range(1000, 1000 + 3 * BS))  # three full blocks
OTHER = list(range(5000, 5000 + 3 * BS))  # shares no block with PREFIX


@pytest.fixture
def indexer():
    with LlmdIndexer(hash_seed=SEED, block_size=BS) as idx:
        yield idx


@pytest.fixture
def publisher(indexer):
    pub = indexer.publisher()
    yield pub
    pub.close()


def store(tokens: list[int], n_blocks: int | None = None) -> list:
    hashes = block_hashes(tokens, BS, SEED)[:n_blocks]
    return block_stored(hashes, tokens[:len(hashes) * BS], BS)


# ------------------------------------------------------------------ the hash
@pytest.mark.parametrize("seed", ["", "0", "42", "kvpilot"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_keys_equal_the_python_sha256_cbor_64bit_chain(seed, block_size):
    token_lists = [
        [],
        list(range(block_size - 1)),  # no full block: no key
        list(range(block_size)),
        list(range(3 * block_size + 1)),  # the partial tail is not hashed
        # every CBOR integer width: 0..23 inline, then 1, 2, 4 byte heads
        [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1] * (2 * block_size // 8),
    ]
    with LlmdIndexer(hash_seed=seed, block_size=block_size) as idx:
        for tokens in token_lists:
            expected = block_hashes(tokens, block_size, seed)
            assert idx.keys(MODEL, tokens) == expected, (seed, block_size, tokens)
            assert idx.keys("another/model", tokens) == expected  # the model is not hashed


def test_keys_golden_value():
    # llm-d v0.3.0, seed "" and 16-token blocks: the first block of tokens 1..16.
    assert block_hashes(list(range(1, 17)), 16, "") == [12886194223934072076]


def test_the_seed_changes_every_key():
    tokens = list(range(2 * BS))
    assert not set(block_hashes(tokens, BS, "0")) & set(block_hashes(tokens, BS, "1"))


# ------------------------------------------------------------------ scoring
def test_block_stored_ranks_the_pod_holding_the_prefix(indexer, publisher):
    # pod-a holds all three blocks, pod-b only the first; rank 0 as kvpilot sends it.
    publisher.send("pod-a", MODEL, event_batch([store(PREFIX)], data_parallel_rank=0))
    publisher.send("pod-b", MODEL, event_batch([store(PREFIX, 1)]))
    prompt = [*PREFIX, 7, 8, 9]  # the prefix plus a partial block
    indexer.wait_for(lambda: indexer.score(MODEL, prompt) == {"pod-a": 3, "pod-b": 1},
                     "pod-a's three blocks and pod-b's one")

    scores = indexer.score(MODEL, prompt)
    assert scores["pod-a"] > scores["pod-b"]
    assert indexer.score(MODEL, PREFIX[:2 * BS] + OTHER) == {"pod-a": 2, "pod-b": 1}
    assert indexer.score(MODEL, prompt, pods=["pod-b"]) == {"pod-b": 1}
    # No shared prefix, or another model: nobody scores.
    assert indexer.score(MODEL, OTHER) == {}
    assert indexer.score(MODEL, OTHER[:BS] + PREFIX) == {}
    assert indexer.score("another/model", prompt) == {}


def test_a_prompt_shorter_than_a_block_is_refused(indexer):
    # v0.3.0's Lookup refuses an empty key list ("no keys provided for lookup").
    with pytest.raises(LlmdIndexerError, match="no keys provided"):
        indexer.score(MODEL, PREFIX[:BS - 1])


def test_block_removed_takes_blocks_out(indexer, publisher):
    hashes = block_hashes(PREFIX, BS, SEED)
    publisher.send("pod-a", MODEL, event_batch([store(PREFIX)]))
    indexer.wait_for(lambda: indexer.score(MODEL, PREFIX) == {"pod-a": 3}, "three blocks")

    publisher.send("pod-a", MODEL, event_batch([block_removed(hashes[2:])]))
    indexer.wait_for(lambda: indexer.score(MODEL, PREFIX) == {"pod-a": 2}, "the last removed")
    # Without its first block the chain is broken: the second block alone scores nothing.
    publisher.send("pod-a", MODEL, event_batch([block_removed(hashes[:1])]))
    indexer.wait_for(lambda: indexer.score(MODEL, PREFIX) == {}, "the first removed")
    assert indexer.score(MODEL, PREFIX[BS:]) == {}  # block 2 hashes from block 1, not the root


# ------------------------------------------------------------------ what v0.3.0 drops
MARKER = list(range(9000, 9000 + BS))


def marker_seen(indexer) -> bool:
    return indexer.score(MODEL, MARKER).get("pod-a") == 1


@pytest.mark.parametrize(("name", "event"), [
    ("medium appended (newer vLLM)", [*store(PREFIX), "GPU"]),
    ("medium and lora_name appended", [*store(PREFIX), "GPU", None]),
    ("lora_id missing", store(PREFIX)[:-1]),
    ("map-tagged", {"type": "BlockStored", "block_hashes": block_hashes(PREFIX, BS, SEED),
                    "parent_block_hash": None, "token_ids": PREFIX, "block_size": BS,
                    "lora_id": None, "medium": "GPU"}),
])
def test_block_stored_of_another_shape_is_dropped(indexer, publisher, name, event):
    publisher.send("pod-a", MODEL, event_batch([event, store(MARKER)]))
    indexer.wait_for(lambda: marker_seen(indexer), "the marker block")
    assert indexer.score(MODEL, PREFIX) == {}, name


def test_block_removed_with_medium_is_dropped(indexer, publisher):
    publisher.send("pod-a", MODEL, event_batch([store(PREFIX)]))
    indexer.wait_for(lambda: indexer.score(MODEL, PREFIX) == {"pod-a": 3}, "three blocks")
    removal = [*block_removed(block_hashes(PREFIX, BS, SEED)), "GPU"]
    publisher.send("pod-a", MODEL, event_batch([removal, store(MARKER)]))
    indexer.wait_for(lambda: marker_seen(indexer), "the marker block")
    assert indexer.score(MODEL, PREFIX) == {"pod-a": 3}


@pytest.mark.parametrize(("name", "batch"), [
    ("no data_parallel_rank", lambda events: [1.0, events]),
    ("a fourth element", lambda events: [1.0, events, None, None]),
])
def test_a_batch_of_another_length_is_dropped(indexer, publisher, name, batch):
    publisher.send("pod-a", MODEL, batch([store(PREFIX)]))
    publisher.send("pod-a", MODEL, event_batch([store(MARKER)]))  # same pod: digested after
    indexer.wait_for(lambda: marker_seen(indexer), "the marker block")
    assert indexer.score(MODEL, PREFIX) == {}, name


def test_an_integer_timestamp_is_accepted(indexer, publisher):
    publisher.send_payload(f"kv@pod-a@{MODEL}", msgpack.packb([1, [store(PREFIX)], None]))
    indexer.wait_for(lambda: indexer.score(MODEL, PREFIX) == {"pod-a": 3}, "three blocks")


def test_all_blocks_cleared_is_ignored(indexer, publisher):
    # v0.3.0 digests AllBlocksCleared as a no-op: only BlockRemoved takes blocks out.
    publisher.send("pod-a", MODEL, event_batch([store(PREFIX)]))
    indexer.wait_for(lambda: indexer.score(MODEL, PREFIX) == {"pod-a": 3}, "three blocks")
    publisher.send("pod-a", MODEL, event_batch([all_blocks_cleared(), store(MARKER)]))
    indexer.wait_for(lambda: marker_seen(indexer), "the marker block")
    assert indexer.score(MODEL, PREFIX) == {"pod-a": 3}


def test_a_topic_without_pod_and_model_is_dropped(indexer, publisher):
    publisher.send_payload("kv@pod-a", msgpack.packb(event_batch([store(PREFIX)])))
    publisher.send("pod-a", MODEL, event_batch([store(MARKER)]))
    indexer.wait_for(lambda: marker_seen(indexer), "the marker block")
    assert indexer.score(MODEL, PREFIX) == {}
