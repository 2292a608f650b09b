"""KV cache events: the blocks the prefix cache stores and evicts, as plain objects,
and the block hashes that identify them.

The radix cache reports each full block it inserts (``BlockStored``), each block it
evicts (``BlockRemoved``) and emptying the whole tree (``AllBlocksCleared``) to a
:class:`KVEventCollector`; the engine drains the collector once per step and hands the
list to a publisher (:mod:`kvpilot.engine.kv_events`: the ZMQ thread, msgpack encoding,
replay), which KV-aware routers and prefix indexers subscribe to.

Block hashes are vLLM's, byte for byte (:class:`BlockHasher`,
``--prefix-caching-hash-algo``): a block's hash is ``hash_fn((parent, tokens,
extra_keys))`` over the parent block's full hash (the seed's hash ``NONE_HASH`` at a
prefix's first block), the block's token ids as a tuple and the keys mixed into it
(the LoRA adapter, and the cache salt in the first block only), serialized with pickle
or canonical CBOR and hashed with SHA-256 or xxHash (128 bit). The wire carries the
hash's last 8 bytes as an unsigned 64-bit int (vLLM's ``maybe_convert_block_hash``,
on by default). Sources: ``vllm/utils/hashing.py`` and ``hash_block_tokens``,
``init_none_hash``, ``generate_block_hash_extra_keys`` and ``to_event_extra_keys`` in
``vllm/v1/core/kv_cache_utils.py`` (vLLM 0.32); ``sha256_cbor_64bit`` is vLLM 0.10's
algorithm, which llm-d's KV cache indexer (v0.3.0) recomputes.

Event types and fields after vLLM 0.32's ``vllm/distributed/kv_events.py`` and what its
``BlockPool`` fills in (``vllm/v1/core/block_pool.py``); the code is kvpilot's own.
Standard library only, besides the two serializers the algorithms name (``cbor2``,
``xxhash``), imported when an algorithm needs them.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvpilot.flags.serve import PREFIX_CACHING_HASH_ALGOS

if TYPE_CHECKING:
    from kvpilot.engine.lora.request import LoRARequest

# The medium of the engine's own KV cache, as vLLM names its device pool.
MEDIUM_GPU = "GPU"
# The KV cache group of every block: kvpilot keeps one group per model (vLLM's
# ``kv_cache_group_id`` 0 for a model whose layers share one cache spec).
GROUP_IDX = 0
# The group's kind as vLLM's KVCacheSpecKind names it: every layer attends to the whole
# context, or (an all-layer sliding window, ``kv_cache_spec_sliding_window`` tokens) not.
SPEC_FULL_ATTENTION = "full_attention"
SPEC_SLIDING_WINDOW = "sliding_window"

# --prefix-caching-hash-algo: vLLM 0.32's four choices, then vLLM 0.10's 64-bit CBOR one.
HASH_ALGOS: Final = PREFIX_CACHING_HASH_ALGOS
DEFAULT_HASH_ALGO: Final = "sha256"  # vLLM's default
# The seed NONE_HASH derives from when PYTHONHASHSEED is unset, for the cryptographic
# algorithms (vLLM's DEFAULT_NONE_HASH_SEED); xxHash gets a random one per process.
DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
NON_CRYPTO_HASH_ALGOS: Final = frozenset({"xxhash", "xxhash_cbor"})
_MASK64 = (1 << 64) - 1

# A block's full hash as the chain carries it: bytes (32 for SHA-256, 16 for xxHash) or,
# for sha256_cbor_64bit, an int below 2**64.
ChainHash = bytes | int


@dataclass(slots=True)
class BlockStored:
    """Full blocks entered the prefix cache, a contiguous chain: block ``i``'s parent is
    block ``i - 1``, the first one's is ``parent_block_hash`` (None at a prefix's first
    block). Hashes are the wire's 64-bit ints (:func:`external_hash`).

    ``token_ids`` holds ``len(block_hashes) * block_size`` ids; ``extra_keys`` has one
    entry per block (vLLM 0.32 sends the list for plain blocks too): None, or the
    block's untagged hash keys (:func:`event_keys`: ``(lora_name,)``, ``(salt,)`` or
    ``(lora_name, salt)``, the salt in a prefix's first block only). ``lora_id`` and
    ``lora_name`` name the adapter (None: the base model). ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window`` describe the cache group, as vLLM's
    ``KVCacheManager.take_events`` annotates stores. ``isolated`` is not on the
    wire: the chain is salted or an adapter's, so the publisher sends it in a batch of
    its own (:func:`kvpilot.engine.kv_events.split_salted`)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[str, ...] | None] | None = None
    group_idx: int | None = GROUP_IDX
    kv_cache_spec_kind: str | None = SPEC_FULL_ATTENTION
    kv_cache_spec_sliding_window: int | None = None
    isolated: bool = False

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map vLLM's msgspec encoder writes (tagged, defaults omitted)."""
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
            "lora_name": self.lora_name,
        }
        if self.extra_keys is not None:  # vLLM omits defaults (omit_defaults=True)
            out["extra_keys"] = self.extra_keys
        if self.group_idx is not None:
            out["group_idx"] = self.group_idx
        if self.kv_cache_spec_kind is not None:
            out["kv_cache_spec_kind"] = self.kv_cache_spec_kind
        if self.kv_cache_spec_sliding_window is not None:
            out["kv_cache_spec_sliding_window"] = self.kv_cache_spec_sliding_window
        return out

    def to_array(self) -> list[Any]:
        """vLLM 0.10's positional form (``array_like`` events), what llm-d's KV cache
        indexer v0.3.0 decodes: ``[tag, block_hashes, parent_block_hash, token_ids,
        block_size, lora_id]``."""
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id]


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted); vLLM sends one event per block."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = GROUP_IDX

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": self.block_hashes, "medium": self.medium}
        if self.group_idx is not None:
            out["group_idx"] = self.group_idx
        return out

    def to_array(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes]


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was emptied (``reset_prefix_cache`` with no block in use).

    ``removed`` is not on the map wire: the hashes of the blocks the reset dropped, for
    consumers that ignore this event (llm-d's indexer v0.3.0 does; the positional
    encoding sends them a ``BlockRemoved`` first, see :meth:`to_arrays`)."""

    removed: list[int] = field(default_factory=list, compare=False)

    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}

    def to_array(self) -> list[Any]:
        return ["AllBlocksCleared"]

    def to_arrays(self) -> list[list[Any]]:
        """The positional events: a ``BlockRemoved`` of every dropped block, then this."""
        return [["BlockRemoved", self.removed], self.to_array()] if self.removed else [self.to_array()]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


# --------------------------------------------------------------------- hashing
def _cbor(value: Any) -> bytes:
    import cbor2

    return cbor2.dumps(value, canonical=True)


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _xxh3_128(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _low64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & _MASK64


# name -> value -> chain hash, each as vLLM defines it
_HASH_FUNCTIONS: Final[dict[str, Callable[[Any], ChainHash]]] = {
    "sha256": lambda v: _sha256(_pickle(v)),
    "sha256_cbor": lambda v: _sha256(_cbor(v)),
    "xxhash": lambda v: _xxh3_128(_pickle(v)),
    "xxhash_cbor": lambda v: _xxh3_128(_cbor(v)),
    "sha256_cbor_64bit": lambda v: _low64(_sha256(_cbor(v))),
}


def resolve_hash_seed(algo: str, environ: dict[str, str] | None = None) -> tuple[str, str]:
    """The seed ``NONE_HASH`` derives from, and where it came from, as vLLM resolves it
    (``resolve_none_hash_seed``): ``PYTHONHASHSEED`` when set; else the fixed
    ``"vllm-none-hash"`` for the SHA-256 algorithms (so engines agree without
    configuration) and 32 random bytes in hex for xxHash (a predictable seed would let
    an attacker build colliding blocks offline). Returns ``(seed, source)``, the source
    being ``"PYTHONHASHSEED"``, ``"default"`` or ``"random"``."""
    env = os.environ if environ is None else environ
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed, "PYTHONHASHSEED"
    if algo in NON_CRYPTO_HASH_ALGOS:
        return os.urandom(32).hex(), "random"
    return DEFAULT_NONE_HASH_SEED, "default"


class BlockHasher:
    """vLLM's prefix-caching block hash for one algorithm and seed.

    Args:
        algo: one of :data:`HASH_ALGOS`.
        seed: the seed ``NONE_HASH`` derives from (None: :func:`resolve_hash_seed`).

    Attributes:
        algo, seed, seed_source: what the hashes derive from (``seed_source`` is
            ``"PYTHONHASHSEED"``, ``"default"``, ``"random"`` or ``"argument"``).
        none_hash: the parent hash of every prefix's first block, ``hash_fn(seed)``.

    Raises:
        ValueError: ``algo`` is not one of :data:`HASH_ALGOS`.
    """

    __slots__ = ("_fn", "algo", "none_hash", "seed", "seed_source", "tagged_keys")

    def __init__(self, algo: str = DEFAULT_HASH_ALGO, seed: str | None = None) -> None:
        if algo not in _HASH_FUNCTIONS:
            raise ValueError(f"--prefix-caching-hash-algo must be one of {', '.join(HASH_ALGOS)}; got {algo!r}")
        self.algo = algo
        self._fn = _HASH_FUNCTIONS[algo]
        if seed is None:
            self.seed, self.seed_source = resolve_hash_seed(algo)
        else:
            self.seed, self.seed_source = seed, "argument"
        self.none_hash: ChainHash = self._fn(self.seed)
        # vLLM 0.32 tags each key with its source; vLLM 0.10 (sha256_cbor_64bit) did not.
        self.tagged_keys = algo != "sha256_cbor_64bit"

    def hash_block(self, parent: ChainHash | None, token_ids: Sequence[int],
                   extra_keys: tuple[Any, ...] | None = None) -> ChainHash:
        """``hash_fn((parent or NONE_HASH, tuple(token_ids), extra_keys))``, vLLM's
        ``hash_block_tokens``. ``extra_keys`` as :meth:`hash_keys` makes them."""
        return self._fn((self.none_hash if parent is None else parent, tuple(token_ids), extra_keys))

    def hash_keys(self, lora: LoRARequest | None, salt: str | None, first: bool) -> tuple[Any, ...] | None:
        """The keys a block's hash mixes in besides its parent and tokens, in vLLM's
        order (``generate_block_hash_extra_keys``): the adapter (``("lora", name,
        path)``; vLLM 0.10: the bare name), then the cache salt in a prefix's first
        block only (``("cache_salt", salt)``; vLLM 0.10: the bare salt). None when
        there are none."""
        keys: list[Any] = []
        if lora is not None:
            keys.append(("lora", lora.lora_name, lora.lora_path) if self.tagged_keys else lora.lora_name)
        if first and salt:
            keys.append(("cache_salt", salt) if self.tagged_keys else salt)
        return tuple(keys) if keys else None


def external_hash(h: ChainHash) -> int:
    """The hash a KV event carries: the last 8 bytes of the full hash as an unsigned
    big-endian int (vLLM's ``maybe_convert_block_hash``); an int hash as it is."""
    return h if isinstance(h, int) else int.from_bytes(h, "big") & _MASK64


def event_keys(hash_keys: tuple[Any, ...] | None) -> tuple[str, ...] | None:
    """One block's entry in ``BlockStored.extra_keys``: the keys of its hash
    (:meth:`BlockHasher.hash_keys`) untagged, as vLLM's ``to_event_extra_keys`` publishes
    them: the adapter's name, then the salt in a prefix's first block. None when there
    are none."""
    if hash_keys is None:
        return None
    return tuple(k[1] if isinstance(k, tuple) else k for k in hash_keys)


class KVEventCollector:
    """The events of the current engine step, in order (engine thread only).

    The radix cache calls :meth:`block_stored`, :meth:`blocks_removed` and
    :meth:`all_cleared`; the engine calls :meth:`drain` once per step. Nothing is
    encoded here.

    Args:
        block_size: tokens per block (the ``block_size`` field of ``BlockStored``).
        hasher: the block hash (default: vLLM's default algorithm and seed).
        sliding_window: the window of an all-layer sliding-window model, in tokens
            (stores then say ``kv_cache_spec_kind`` ``"sliding_window"``); None: full
            attention.
    """

    __slots__ = ("block_size", "events", "hasher", "sliding_window", "spec_kind")

    def __init__(self, block_size: int, hasher: BlockHasher | None = None,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.hasher = hasher if hasher is not None else BlockHasher()
        self.sliding_window: int | None = None
        self.spec_kind = SPEC_FULL_ATTENTION
        self.set_sliding_window(sliding_window)
        self.events: list[KVEvent] = []

    def set_sliding_window(self, window: int | None) -> None:
        """The model's all-layer sliding window in tokens (None: full attention), known
        once the model config is read; later stores describe the group with it."""
        self.sliding_window = window
        self.spec_kind = SPEC_FULL_ATTENTION if window is None else SPEC_SLIDING_WINDOW

    def block_stored(self, parent_hash: ChainHash | None, token_ids: Sequence[int], salt: str | None = None,
                     lora: LoRARequest | None = None) -> ChainHash:
        """Record one block entering the tree under a parent whose full hash is
        ``parent_hash`` (None at a prefix's first block) and return the block's full
        hash (:meth:`BlockHasher.hash_block`; the event carries :func:`external_hash`).
        ``salt`` is the tree's cache salt and ``lora`` its adapter (None: the base
        model).

        A block whose parent is the last block of the previous event (a request
        publishing several blocks) extends that event, as vLLM sends one ``BlockStored``
        per request and step; a chain has one adapter and one salt, so the event's
        ``lora_id`` and ``lora_name`` hold for every block."""
        hash_keys = self.hasher.hash_keys(lora, salt, parent_hash is None)
        h = self.hasher.hash_block(parent_hash, token_ids, hash_keys)
        ext = external_hash(h)
        keys = event_keys(hash_keys)
        lora_id = lora.lora_int_id if lora is not None else None
        events = self.events
        last = events[-1] if events else None
        if (type(last) is BlockStored and parent_hash is not None
                and last.block_hashes[-1] == external_hash(parent_hash) and last.lora_id == lora_id):
            last.block_hashes.append(ext)
            last.token_ids.extend(token_ids)
            assert last.extra_keys is not None
            last.extra_keys.append(keys)
        else:
            events.append(BlockStored(
                [ext], None if parent_hash is None else external_hash(parent_hash), list(token_ids),
                self.block_size, lora_id=lora_id, lora_name=lora.lora_name if lora is not None else None,
                extra_keys=[keys], kv_cache_spec_kind=self.spec_kind,
                kv_cache_spec_sliding_window=self.sliding_window, isolated=bool(salt) or lora is not None))
        return h

    def blocks_removed(self, hashes: Sequence[ChainHash]) -> None:
        """Record evicted blocks, one ``BlockRemoved`` per block as vLLM sends them."""
        self.events.extend(BlockRemoved([external_hash(h)]) for h in hashes)

    def all_cleared(self, removed: Sequence[ChainHash] = ()) -> None:
        """Record the whole cache emptied; ``removed`` are the blocks it dropped."""
        self.events.append(AllBlocksCleared([external_hash(h) for h in removed]))

    def drain(self) -> list[KVEvent]:
        """The events so far, in order; the collector starts empty again."""
        events, self.events = self.events, []
        return events
