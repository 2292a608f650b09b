"""KV cache events (kvpilot.engine.core.kv_events, kvpilot.engine.kv_events): the
--kv-events-config validation, the block hash, the events a real KVCacheManager emits on
insert / evict / reset, and the ZMQ publisher's wire format read back through real SUB and
DEALER sockets (sequence numbers, replay and its end marker, a restart starting at 0,
clean shutdown).

The format is the one vllm-router 0.1.17 accepted in the experiments recorded in
docs/engine.md ("KV cache events"): a msgpack array batch of map-tagged events, and replay
replies carrying the topic frame."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_events import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVEventCollector,
    external_hash,
)
from kvpilot.engine.kv_events import (
    END_SEQ,
    ExtraPublisher,
    KVEventsConfig,
    KVEventsConfigError,
    ZmqEventPublisher,
    binds,
    encode_batch,
    split_salted,
)
from tests.engine.core.helpers import adapter, make_request

BS = 4
HASHER = BlockHasher("sha256", "kvpilot-tests")  # vLLM's default algorithm, a fixed seed


def block_hash(parent: bytes | None, tokens: list[int], salt: str | None = None, lora=None) -> bytes:
    """A block's full hash under HASHER, with vLLM's keys (the salt in a first block)."""
    return HASHER.hash_block(parent, tokens, HASHER.hash_keys(lora, salt, parent is None))


# --------------------------------------------------------------------- config
def test_config_defaults_follow_vllm():
    off = KVEventsConfig()
    assert (off.enable_kv_cache_events, off.publisher, off.publishes) == (False, "null", False)
    on = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.replay_endpoint) == ("zmq", "tcp://*:5557", None)
    assert (on.buffer_steps, on.hwm, on.max_queue_size, on.topic) == (10_000, 100_000, 100_000, "")
    assert on.publishes
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').publishes


@pytest.mark.parametrize(("text", "expected"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object; got list"),
    ('{"enable_kv_cache_events": true, "port": 5557}', "unknown key 'port'; allowed keys: enable_kv_cache_events, publisher"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false; got 'yes'"),
    ('{"publisher": "kafka"}', "publisher must be 'zmq' or 'null'; got 'kafka'"),
    ('{"endpoint": "http://x:1"}', "endpoint must be tcp://HOST:PORT, ipc://PATH or inproc://NAME (unknown scheme); got 'http://x:1'"),
    ('{"endpoint": "tcp://host"}', "(no HOST:PORT); got 'tcp://host'"),
    ('{"endpoint": "tcp://*:70000"}', "(port '70000' is not in 0..65535)"),
    ('{"endpoint": 5557}', "endpoint must be tcp://HOST:PORT, ipc://PATH or inproc://NAME (not a string); got 5557"),
    ('{"replay_endpoint": "tcp://*:5557"}', "replay_endpoint must be an address other than endpoint; got 'tcp://*:5557'"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1; got 0"),
    ('{"hwm": -1}', "hwm must be an integer >= 0; got -1"),
    ('{"max_queue_size": true}', "max_queue_size must be an integer >= 1; got True"),
    ('{"buffer_steps": 2.5}', "buffer_steps must be an integer >= 1; got 2.5"),
    ('{"topic": 7}', "topic must be a string; got 7"),
])
def test_config_refuses_bad_input_naming_field_value_and_allowed(text, expected):
    with pytest.raises(KVEventsConfigError) as e:
        KVEventsConfig.from_json(text)
    assert str(e.value).startswith("--kv-events-config")
    assert expected in str(e.value)


def test_engine_args_parse_the_flag_and_refuse_events_without_prefix_caching():
    args = EngineArgs(kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://*:6001"}')
    assert args.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6001")
    assert EngineArgs(kv_events_config={"topic": "t"}).kv_events_config.topic == "t"
    with pytest.raises(ValueError, match="enable_kv_cache_events needs prefix caching"):
        EngineArgs(enable_prefix_caching=False, kv_events_config='{"enable_kv_cache_events": true}')
    # Events off: prefix caching may be off too.
    EngineArgs(enable_prefix_caching=False, kv_events_config='{"enable_kv_cache_events": false}')


def test_cli_flag_error_names_the_field(capsys):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for text, message in (('{"publisher": "redis"}', "publisher must be 'zmq' or 'null'; got 'redis'"),
                          ('{"enable_kv_cache_events": true, "hwm": "big"}', "hwm must be an integer >= 0; got 'big'")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-events-config", text])
        assert message in capsys.readouterr().err
    ns = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert EngineArgs.from_cli_args(ns).kv_events_config.publishes


# ------------------------------------------------------------------- hashing
def test_block_hash_is_stable_across_processes_for_one_seed():
    """The wire hash is the full hash's last 8 bytes, the same in another process with
    the same PYTHONHASHSEED (a new seed changes every hash)."""
    code = ("from kvpilot.engine.core.kv_events import BlockHasher, external_hash; h = BlockHasher('sha256'); "
            "print(h.seed_source, external_hash(h.hash_block(None, [1, 2, 3, 4])))")

    def other_process(seed: str | None) -> tuple[str, int]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                             check=True)
        source, value = out.stdout.split()
        return source, int(value)

    mine = BlockHasher("sha256", "12345").hash_block(None, [1, 2, 3, 4])
    assert len(mine) == 32 and 0 <= external_hash(mine) < 2**64
    assert external_hash(mine) == int.from_bytes(mine[-8:], "big")
    assert other_process("12345") == ("PYTHONHASHSEED", external_hash(mine))
    assert other_process("54321")[1] != external_hash(mine)
    default = BlockHasher("sha256", "vllm-none-hash").hash_block(None, [1, 2, 3, 4])
    assert other_process(None) == ("default", external_hash(default))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "sha256_cbor_64bit"])
def test_block_hash_chains_parents_and_isolates_salts_and_adapters(algo):
    h = BlockHasher(algo, "7")
    tokens = [5, 6, 7, 8]

    def block(parent, salt=None, lora=None, toks=tokens):
        return h.hash_block(parent, toks, h.hash_keys(lora, salt, parent is None))

    root = block(None)
    assert block(root) != root and block(block(None, "a")) != block(root)
    # Salts: salted != unsalted and two salts differ at a first block; further down the
    # salt is not mixed in again (vLLM), the chain carries it.
    assert len({block(None, s) for s in (None, "a", "b")}) == 3
    assert block(root, "a") == block(root)
    # An adapter changes every block of its chain; its name differs from a salt of that name.
    alpha = adapter("alpha", 1)
    assert block(root, lora=alpha) != block(root)
    if h.tagged_keys:
        assert block(None, lora=alpha) != block(None, salt="alpha")
    else:  # vLLM 0.10's keys were untagged: an adapter and a salt of one name alias (on the wire only)
        assert block(None, lora=alpha) == block(None, salt="alpha")
    # Token order and content matter; the seed too.
    assert block(None, toks=[8, 7, 6, 5]) != root and block(None, toks=[5, 6, 7, 9]) != root
    assert BlockHasher(algo, "8").hash_block(None, tokens) != root
    with pytest.raises(ValueError, match=r"--prefix-caching-hash-algo must be one of sha256, .*; got 'md5'"):
        BlockHasher("md5")


def test_sha256_cbor_64bit_is_vllm_010s_chain_of_64_bit_ints():
    """vLLM 0.10's sha256_cbor_64bit (what llm-d's indexer v0.3.0 recomputes): the low
    64 bits of SHA-256 over canonical CBOR of ``[parent int, tokens, extra keys]``, the
    root parent being the seed's hash (CBOR of the seed string)."""
    import hashlib

    import cbor2

    h = BlockHasher("sha256_cbor_64bit", "")
    low64 = lambda data: int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")  # noqa: E731
    none_hash = low64(cbor2.dumps("", canonical=True))
    assert h.none_hash == none_hash == low64(bytes.fromhex("60"))  # CBOR "" is the one byte 0x60
    first = h.hash_block(None, [1, 2, 3, 4])
    assert first == low64(cbor2.dumps([none_hash, [1, 2, 3, 4], None], canonical=True))
    assert h.hash_block(first, [5, 6, 7, 8]) == low64(cbor2.dumps([first, [5, 6, 7, 8], None], canonical=True))
    assert external_hash(first) == first
    # Untagged keys, as vLLM 0.10 mixed them: the adapter's name, the salt in a first block.
    assert h.hash_keys(adapter("alpha", 1), "s", True) == ("alpha", "s")
    assert h.hash_keys(adapter("alpha", 1), "s", False) == ("alpha",)


# ------------------------------------------------------- events from the cache
def manager(num_blocks: int = 10) -> tuple[KVCacheManager, KVEventCollector]:
    events = KVEventCollector(BS, HASHER)
    return KVCacheManager(num_blocks, BS, kv_events=events), events


def run(kv: KVCacheManager, req) -> None:
    """Admit ``req``, compute all its tokens and publish its full blocks."""
    nodes, hit = kv.match_prefix(req)
    assert kv.can_admit(req, nodes)
    kv.admit(req, nodes, hit)
    req.num_computed_tokens = req.num_tokens
    kv.publish(req)


def chain(tokens: list[int], salt: str | None = None, parent: bytes | None = None, lora=None) -> list[int]:
    """The wire hashes of ``tokens``' full blocks as one chain."""
    hashes = []
    for i in range(0, len(tokens) - BS + 1, BS):
        parent = block_hash(parent, tokens[i:i + BS], salt, lora)
        hashes.append(external_hash(parent))
    return hashes


def test_publish_emits_one_block_stored_per_contiguous_chain():
    kv, events = manager()
    a = make_request("a", list(range(1, 11)))  # 10 tokens: 2 full blocks
    run(kv, a)
    [ev] = events.drain()
    assert ev == BlockStored(chain(list(range(1, 9))), None, list(range(1, 9)), BS, extra_keys=[None, None])
    assert ev.medium == "GPU" and ev.lora_id is None and ev.group_idx == 0
    assert ev.kv_cache_spec_kind == "full_attention" and not ev.isolated
    assert [external_hash(kv.radix.node_of(b).block_hash) for b in a.block_ids[:2]] == ev.block_hashes
    # A request sharing the first block stores only its own next blocks, parented on it.
    b = make_request("b", [1, 2, 3, 4, 50, 51, 52, 53, 54])
    run(kv, b)
    [ev_b] = events.drain()
    assert ev_b.parent_block_hash == ev.block_hashes[0]
    assert ev_b.token_ids == [50, 51, 52, 53]
    full0 = kv.radix.node_of(a.block_ids[0]).block_hash
    assert ev_b.block_hashes == [external_hash(block_hash(full0, [50, 51, 52, 53]))]
    # The same prompt again hits the cache: nothing new is stored.
    kv.free(a)
    c = make_request("c", list(range(1, 11)))
    run(kv, c)
    assert events.drain() == []
    kv.check_integrity([b, c])


def test_a_block_two_requests_compute_is_stored_once():
    kv, events = manager()
    a, b = make_request("a", [1, 2, 3, 4, 9]), make_request("b", [1, 2, 3, 4, 9])
    for req in (a, b):  # both admitted before either published: both compute block 0
        nodes, hit = kv.match_prefix(req)
        kv.admit(req, nodes, hit)
    for req in (a, b):
        req.num_computed_tokens = req.num_tokens
        kv.publish(req)
    [ev] = events.drain()
    assert ev.block_hashes == chain([1, 2, 3, 4])
    kv.check_integrity([a, b])


def test_salted_blocks_carry_the_salt_and_differ_from_unsalted_ones():
    kv, events = manager()
    tokens = list(range(1, 9))
    run(kv, make_request("plain", [*tokens, 0]))
    run(kv, make_request("salted", [*tokens, 0], salt="tenant-a"))
    plain, salted = events.drain()
    assert plain.extra_keys == [None, None] and not plain.isolated
    assert salted.extra_keys == [("tenant-a",), None]  # vLLM: the salt is a first block's key
    assert salted.isolated
    assert salted.parent_block_hash is None
    assert salted.block_hashes == chain(tokens, "tenant-a")
    assert set(salted.block_hashes).isdisjoint(plain.block_hashes)


def test_adapter_blocks_name_the_adapter_and_differ_from_base_blocks():
    """vLLM's BlockStored for a LoRA request: lora_id = lora_int_id, lora_name, and per
    block extra_keys holding the LoRA name first, then the salt (in the first block)."""
    kv, events = manager(20)
    tokens = list(range(1, 9))
    alpha, beta = adapter("alpha", 3), adapter("beta", 4)
    run(kv, make_request("base", [*tokens, 0]))
    run(kv, make_request("a", [*tokens, 0], lora=alpha))
    run(kv, make_request("b", [*tokens, 0], lora=beta))
    run(kv, make_request("as", [*tokens, 0], lora=alpha, salt="tenant-a"))
    base, a, b, a_salted = events.drain()
    assert (base.lora_id, base.lora_name, base.extra_keys) == (None, None, [None, None])
    assert (a.lora_id, a.lora_name, a.extra_keys) == (3, "alpha", [("alpha",), ("alpha",)])
    assert (b.lora_id, b.lora_name, b.extra_keys) == (4, "beta", [("beta",), ("beta",)])
    assert a_salted.extra_keys == [("alpha", "tenant-a"), ("alpha",)]
    assert a.block_hashes == chain(tokens, lora=alpha)
    assert a_salted.block_hashes == chain(tokens, "tenant-a", lora=alpha)
    every = [set(ev.block_hashes) for ev in (base, a, b, a_salted)]
    for i in range(len(every)):
        for j in range(i + 1, len(every)):
            assert every[i].isdisjoint(every[j]), (i, j)
    assert base.block_hashes == chain(tokens)
    assert a.parent_block_hash is None and a.token_ids == tokens
    assert all(ev.medium == "GPU" for ev in (base, a, b, a_salted))
    # Its wire map: vLLM's field order, lora_id and lora_name set.
    wire = a.to_wire()
    assert list(wire) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                          "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    assert (wire["lora_id"], wire["lora_name"]) == (3, "alpha")


def test_eviction_emits_block_removed_for_the_lru_leaves():
    kv, events = manager(num_blocks=6)
    a = make_request("a", list(range(1, 10)))  # 2 full blocks + 1 partial
    run(kv, a)
    stored_a = events.drain()[0].block_hashes
    kv.free(a)  # 2 cached blocks, 4 free
    b = make_request("b", list(range(100, 121)))  # 21 tokens: 6 blocks -> evicts both of a's
    run(kv, b)
    *removed, stored_b = events.drain()
    # One BlockRemoved per block, as vLLM sends them: the leaf first, then its parent.
    assert removed == [BlockRemoved([h]) for h in stored_a[::-1]]
    assert stored_b.block_hashes == chain(list(range(100, 120)))
    kv.check_integrity([b])


def test_reset_with_nothing_in_use_is_all_blocks_cleared():
    kv, events = manager()
    a = make_request("a", list(range(1, 13)))
    run(kv, a)
    kv.free(a)
    events.drain()
    assert kv.reset_prefix_cache() == 3
    assert events.drain() == [AllBlocksCleared()]


def test_the_positional_encoding_sends_a_reset_as_removals_first():
    """llm-d's indexer v0.3.0 ignores AllBlocksCleared: the positional ("array") batch
    removes the dropped blocks first; the map batch is vLLM's bare AllBlocksCleared."""
    kv, events = manager()
    a = make_request("a", list(range(1, 13)))
    run(kv, a)
    stored = events.drain()[0].block_hashes
    kv.free(a)
    kv.reset_prefix_cache()
    [cleared] = events.drain()
    assert cleared == AllBlocksCleared() and sorted(cleared.removed) == sorted(stored)
    _, arrays, _ = msgpack.unpackb(encode_batch(1.0, [cleared], 0, "array"))
    assert arrays[0][0] == "BlockRemoved" and sorted(arrays[0][1]) == sorted(stored)
    assert arrays[1:] == [["AllBlocksCleared"]]
    assert msgpack.unpackb(encode_batch(1.0, [cleared], 0))[1] == [{"type": "AllBlocksCleared"}]
    assert msgpack.unpackb(encode_batch(1.0, [AllBlocksCleared()], 0, "array"))[1] == [["AllBlocksCleared"]]


def test_reset_while_blocks_are_in_use_reports_only_what_was_dropped():
    kv, events = manager()
    a = make_request("a", [*range(1, 9), 0])
    b = make_request("b", [*range(20, 28), 0])
    run(kv, a)
    run(kv, b)
    stored_a, _ = events.drain()
    kv.free(a)
    assert kv.reset_prefix_cache() == 2  # a's blocks go, b's are in use and stay
    assert events.drain() == [BlockRemoved([h]) for h in stored_a.block_hashes[::-1]]
    kv.check_integrity([b])


def test_events_off_costs_no_hashing():
    kv = KVCacheManager(10, BS)
    assert kv.radix.events is None
    a = make_request("a", list(range(1, 10)))
    run(kv, a)
    assert {kv.radix.node_of(b).block_hash for b in a.block_ids[:2]} == {0}
    with pytest.raises(ValueError, match="need prefix caching"):
        KVCacheManager(10, BS, enable_prefix_caching=False, kv_events=KVEventCollector(BS))


def test_split_salted_keeps_order_and_never_puts_a_removal_with_salted_stores():
    plain = BlockStored([1], None, [0] * BS, BS, extra_keys=[None])
    salted = BlockStored([2], None, [0] * BS, BS, extra_keys=[None], isolated=True)  # a salted chain's 2nd block
    removed = BlockRemoved([3])
    runs = split_salted([removed, salted, salted, plain, removed, salted, AllBlocksCleared()])
    assert runs == [[removed], [salted, salted], [plain, removed], [salted], [AllBlocksCleared()]]
    assert split_salted([]) == []


def test_split_salted_puts_adapter_stores_in_batches_of_their_own():
    kv, events = manager(20)
    # One step: a base request and an adapter request publish, then something is evicted.
    run(kv, make_request("base", [1, 2, 3, 4, 0]))
    run(kv, make_request("a", [1, 2, 3, 4, 0], lora=adapter("alpha", 1)))
    run(kv, make_request("base2", [5, 6, 7, 8, 0]))
    base, a, base2 = events.drain()
    removed = BlockRemoved([base.block_hashes[0]])
    runs = split_salted([base, a, base2, removed])
    assert runs == [[base], [a], [base2, removed]]
    assert a.isolated and not base.isolated


# ------------------------------------------------------------------ publisher
def loopback(**kw) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                          replay_endpoint="tcp://127.0.0.1:0", topic="kv", **kw)


class Subscriber:
    """A real SUB socket on the publisher, joined before the test's batches are sent:
    probe batches are published until one arrives (a PUB drops what it sends before a
    subscription reaches it), so every later batch is received."""

    def __init__(self, pub: ZmqEventPublisher, topic: bytes = b"kv") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(pub.endpoint)
        deadline = time.monotonic() + 10
        while True:
            pub.publish([AllBlocksCleared()])
            if self.sock.poll(50):
                break
            assert time.monotonic() < deadline, "the SUB socket never received a batch"
        self.probe_seq = int.from_bytes(self.sock.recv_multipart()[1], "big")
        while self.sock.poll(200):  # probes still in flight
            self.probe_seq = int.from_bytes(self.sock.recv_multipart()[1], "big")

    def recv(self) -> tuple[bytes, int, list]:
        assert self.sock.poll(5000), "no batch within 5 s"
        topic, seq, payload = self.sock.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def replay(pub: ZmqEventPublisher, start: int, frames: list[bytes] | None = None) -> list[list[bytes]]:
    """Ask the ROUTER socket for batches from ``start`` (as vllm-router does, from a
    DEALER: an empty delimiter and the 8-byte start), until the end marker."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart(frames if frames is not None else [b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "no replay reply within 5 s"
            msg = dealer.recv_multipart()
            out.append(msg)
            if msg[2] == END_SEQ:
                return out
    finally:
        dealer.close(linger=0)
        ctx.term()


@pytest.fixture
def publisher():
    pubs = []

    def start(config: KVEventsConfig | None = None, **kw) -> ZmqEventPublisher:
        pub = ZmqEventPublisher(config or loopback(**kw))
        pub.start()
        pubs.append(pub)
        return pub

    yield start
    for pub in pubs:
        pub.shutdown()


def stored(hashes, parent=None, salt=None) -> BlockStored:
    return BlockStored(list(hashes), parent, [7] * (BS * len(hashes)), BS,
                       extra_keys=[(salt,) if salt is not None and i == 0 else None for i in range(len(hashes))],
                       isolated=salt is not None)


def test_wire_format_is_an_array_batch_of_type_tagged_maps(publisher):
    pub = publisher()
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
    sub = Subscriber(pub)
    try:
        pub.publish([stored([11, 12], parent=10), BlockRemoved([9]), AllBlocksCleared()])
        topic, seq, batch = sub.recv()
        assert topic == b"kv" and seq == sub.probe_seq + 1
        ts, events, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        assert events == [
            {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 10, "token_ids": [7] * 8,
             "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
             "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
            {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ]
        # A full 64-bit hash goes out as an unsigned msgpack int.
        pub.publish([stored([2**64 - 1])])
        assert sub.recv()[2][1][0]["block_hashes"] == [2**64 - 1]
    finally:
        sub.close()


def test_sequence_is_monotonic_and_salted_stores_travel_alone(publisher):
    pub = publisher()
    sub = Subscriber(pub)
    try:
        pub.publish([BlockRemoved([1]), stored([2], salt="t"), stored([3])])
        pub.publish([stored([4])])
        got = [sub.recv() for _ in range(4)]
        assert [seq for _, seq, _ in got] == [sub.probe_seq + i for i in range(1, 5)]
        kinds = [[(e["type"], e.get("extra_keys")) for e in batch[1]] for _, _, batch in got]
        assert kinds == [
            [("BlockRemoved", None)],
            [("BlockStored", [["t"]])],  # msgpack has no tuples: the key is an array
            [("BlockStored", [None])],
            [("BlockStored", [None])],
        ]
        assert pub.published_batches == sub.probe_seq + 5
    finally:
        sub.close()


def test_replay_returns_missed_batches_then_the_end_marker(publisher):
    pub = publisher()
    for h in range(5):  # nobody listens: a late subscriber gets these only by replay
        pub.publish([stored([100 + h])])
    deadline = time.monotonic() + 10
    while pub.published_batches < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    msgs = replay(pub, 2)
    assert [len(m) for m in msgs] == [4, 4, 4, 4]  # DEALER view: empty, topic, seq, payload
    *batches, end = msgs
    assert [int.from_bytes(m[2], "big") for m in batches] == [2, 3, 4]
    assert all(m[0] == b"" and m[1] == b"kv" for m in batches)
    assert [msgpack.unpackb(m[3])[1][0]["block_hashes"] for m in batches] == [[102], [103], [104]]
    assert end == [b"", b"", END_SEQ, b""]
    # Past the end: only the marker.
    assert replay(pub, 99) == [[b"", b"", END_SEQ, b""]]


def test_replay_buffer_keeps_buffer_steps_batches(publisher):
    pub = publisher(buffer_steps=2)
    for h in range(4):
        pub.publish([stored([h])])
    deadline = time.monotonic() + 10
    while pub.published_batches < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [int.from_bytes(m[2], "big") for m in replay(pub, 0)[:-1]] == [2, 3]


def test_a_malformed_replay_request_is_ignored(publisher):
    pub = publisher()
    pub.publish([stored([1])])
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart([b"", b"short"])
        assert not dealer.poll(300)  # no answer, and the publisher lives on
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert [m[2] for m in replay(pub, 0)] == [(0).to_bytes(8, "big"), END_SEQ]


def test_a_full_queue_drops_the_batch_and_leaves_a_gap():
    pub = ZmqEventPublisher(loopback(max_queue_size=1))
    try:
        pub.publish([stored([1])])  # queued (the thread is not running yet)
        pub.publish([stored([2])])  # queue full: dropped
        assert pub.dropped_batches == 1
        pub.start()
        deadline = time.monotonic() + 10
        while pub.published_batches < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pub.publish([stored([3])])
        while pub.published_batches < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        seqs = [int.from_bytes(m[2], "big") for m in replay(pub, 0)[:-1]]
        assert seqs == [0, 2]  # seq 1 is the dropped batch: subscribers see the gap
    finally:
        pub.shutdown()


def test_shutdown_closes_everything_and_a_restart_starts_at_seq_0(publisher):
    first = ZmqEventPublisher(loopback())
    first.start()
    for h in range(3):
        first.publish([stored([h])])
    endpoint, replay_endpoint = first.endpoint, first.replay_endpoint
    first.shutdown()
    assert not first._thread.is_alive()
    assert first.published_batches == 3  # what was queued was sent before stopping
    first.publish([stored([9])])  # after shutdown: ignored
    first.shutdown()  # idempotent
    # The same ports bind again at once (linger 0), and numbering restarts at 0.
    port, replay_port = endpoint.rpartition(":")[2], replay_endpoint.rpartition(":")[2]
    again = publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                                     replay_endpoint=f"tcp://*:{replay_port}", topic="kv"))
    assert again.endpoint == f"tcp://0.0.0.0:{port}"
    sub = Subscriber(again)
    try:
        assert sub.probe_seq >= 0
        assert int.from_bytes(replay(again, 0)[0][2], "big") == 0
    finally:
        sub.close()


@pytest.mark.parametrize(("endpoint", "bind"), [
    ("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/kv", True), ("inproc://kv", True),
    ("tcp://127.0.0.1:0", True), ("tcp://0.0.0.0:5557", True),
    ("tcp://indexer.ns.svc:5557", False), ("tcp://10.0.0.7:5557", False), ("tcp://127.0.0.1:5557", False),
])
def test_wildcards_bind_and_other_hosts_are_connected_to_as_in_vllm(endpoint, bind):
    assert binds(endpoint) is bind


def test_a_publisher_connects_to_a_subscriber_that_binds_and_extra_sockets_get_the_same_batches(publisher):
    """llm-d's indexer binds its SUB socket and engines connect to it with topic
    ``kv@<pod>@<model>``; an extra publisher sends the same batches (same seq) in
    vLLM 0.10's positional encoding beside the main map-encoded socket."""
    ctx = zmq.Context()
    indexer = ctx.socket(zmq.SUB)
    indexer.setsockopt(zmq.LINGER, 0)
    indexer.setsockopt(zmq.SUBSCRIBE, b"kv@")
    indexer.bind("tcp://127.0.0.1:0")
    address = indexer.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        pub = publisher(loopback(extra_publishers=[
            {"endpoint": address, "topic": "kv@pod-a@m", "event_encoding": "array"}]))
        assert pub.extra_endpoints == [address]
        main = Subscriber(pub)
        try:
            deadline = time.monotonic() + 10
            while not indexer.poll(50):  # a connect completes in the background
                assert time.monotonic() < deadline, "the bound SUB socket never received a batch"
                pub.publish([AllBlocksCleared()])
            while indexer.poll(200):
                indexer.recv_multipart()
            while main.sock.poll(200):
                main.sock.recv_multipart()
            pub.publish([stored([11, 12], parent=10), BlockRemoved([9])])
            topic, seq, payload = indexer.recv_multipart()
            _, main_seq, main_batch = main.recv()
            assert topic == b"kv@pod-a@m" and seq == main_seq.to_bytes(8, "big")
            _, events, rank = msgpack.unpackb(payload)
            assert events == [["BlockStored", [11, 12], 10, [7] * 8, BS, None], ["BlockRemoved", [9]]]
            assert main_batch[1][0]["type"] == "BlockStored" and rank == 0
        finally:
            main.close()
    finally:
        indexer.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(("extra", "expected"), [
    ("7", "extra_publishers must be a list"),
    ('[{"topic": "t"}]', "extra_publishers[0]: endpoint is required"),
    ('[{"endpoint": "tcp://x:1", "port": 2}]', "extra_publishers[0]: unknown key 'port'; allowed keys: endpoint"),
    ('[{"endpoint": "udp://x:1"}]', "extra_publishers[0].endpoint must be tcp://HOST:PORT"),
    ('[{"endpoint": "tcp://x:1", "event_encoding": "json"}]',
     "extra_publishers[0].event_encoding must be 'map' or 'array'; got 'json'"),
    ('[{"endpoint": "tcp://*:5557"}]', "extra_publishers[0].endpoint must be an address no other socket uses"),
    ('[3]', "extra_publishers[0] must be an object"),
])
def test_extra_publishers_are_validated_by_name(extra, expected):
    with pytest.raises(KVEventsConfigError) as e:
        KVEventsConfig.from_json(f'{{"enable_kv_cache_events": true, "extra_publishers": {extra}}}')
    assert expected in str(e.value)
    with pytest.raises(KVEventsConfigError, match="event_encoding must be 'map' or 'array'; got 'cbor'"):
        KVEventsConfig.from_json('{"event_encoding": "cbor"}')
    ok = KVEventsConfig.from_json('{"extra_publishers": [{"endpoint": "tcp://idx:5557"}]}')
    assert ok.extra_publishers == (ExtraPublisher("tcp://idx:5557"),)
    assert ok.to_dict()["extra_publishers"] == [{"endpoint": "tcp://idx:5557", "topic": "", "event_encoding": "map"}]


def test_binding_a_used_address_fails_naming_the_field(publisher):
    pub = publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0"))
    taken = f"tcp://*:{pub.endpoint.rpartition(':')[2]}"
    clash = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=taken))
    with pytest.raises(KVEventsConfigError, match=re.escape(f"cannot bind endpoint '{taken}'")):
        clash.start()
    clash.shutdown()  # nothing started: a no-op


# --------------------------------------------------------------------- engine
class ListPublisher:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        return None


def engine_args(**kw) -> EngineArgs:
    return EngineArgs(device="cpu", dtype="float32", kv_cache_memory=0.05, max_num_batched_tokens=16,
                      max_num_seqs=4, kv_events_config='{"enable_kv_cache_events": true}', **kw)


def test_engine_hands_each_steps_events_to_the_publisher_as_one_batch(smollm2):
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.sampling_params import SamplingParams

    pub = ListPublisher()
    engine = LLMEngine(engine_args(), loaded=smollm2, kv_event_publisher=pub)
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16, prefilled 16 per step
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    # Step 1 computes tokens 0..15 (block 0), step 2 tokens 16..31 (block 1), step 3 the
    # rest (no full block): two batches, one BlockStored each, chained across them.
    assert steps >= 3
    assert [[type(e) for e in b] for b in pub.batches] == [[BlockStored], [BlockStored]]
    first, second = pub.batches[0][0], pub.batches[1][0]
    assert first.token_ids == prompt[:16] and first.parent_block_hash is None
    assert second.token_ids == prompt[16:32] and second.parent_block_hash == first.block_hashes[0]
    hasher = engine.kv_events.hasher
    assert (hasher.algo, first.block_hashes) == ("sha256", [external_hash(hasher.hash_block(None, prompt[:16]))])
    assert engine.kv_events.events == []
    # Resetting the idle cache publishes at once.
    assert engine.reset_prefix_cache() == 2
    assert pub.batches[-1] == [AllBlocksCleared()]
    engine.close()


def test_engine_without_a_publisher_starts_and_stops_its_own(smollm2):
    from kvpilot.engine.llm_engine import LLMEngine

    cfg = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}'
    engine = LLMEngine(EngineArgs(device="cpu", dtype="float32", kv_cache_memory=0.05, kv_events_config=cfg),
                       loaded=smollm2)
    pub = engine._kv_publisher
    assert isinstance(pub, ZmqEventPublisher) and pub._thread.is_alive()
    engine.close()
    assert not pub._thread.is_alive()
    engine.close()  # idempotent


def test_serve_exits_2_before_loading_when_the_event_port_is_taken(capsys):
    import json

    from kvpilot.engine.server import cli

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.setsockopt(zmq.LINGER, 0)
    taken.bind("tcp://*:0")
    endpoint = f"tcp://*:{taken.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(':')[2]}"
    try:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(["--port", "1", "--log-level", "warning", "--kv-events-config",
                                  json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})])
        assert cli.run(args) == 2
    finally:
        taken.close(linger=0)
        ctx.term()
    assert f"kvpilot serve: --kv-events-config: cannot bind endpoint '{endpoint}'" in capsys.readouterr().err
