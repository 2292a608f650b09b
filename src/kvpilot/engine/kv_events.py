"""KV cache events on the wire: the ZMQ publisher KV-aware routers subscribe to.

The engine core collects the prefix cache's events as plain objects
(:mod:`kvpilot.engine.core.kv_events`: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, the block hash and the per-step collector). This module sends them.
A router that subscribes (the vLLM project's ``vllm-router --policy kv_aware``) keeps an
index of each engine's cached prefixes and sends a request to the engine that already
holds the most of its prompt.

Split so the engine step stays cheap:

- the engine drains the core's :class:`~kvpilot.engine.core.kv_events.KVEventCollector`
  once per step and hands the list to :meth:`ZmqEventPublisher.publish` (a queue put, no
  encoding);
- :class:`ZmqEventPublisher`, in its own thread, cuts the list into batches
  (:func:`split_salted`), encodes each with msgpack (:func:`encode_batch`), sends it on a
  ZMQ PUB socket, keeps the last ``buffer_steps`` batches and answers replay requests on
  a ZMQ ROUTER socket;
- :class:`KVEventsConfig` is vLLM's ``--kv-events-config`` JSON, validated.

Wire format (what ``vllm-router`` 0.1.17 decodes; checked against the binary, see
docs/engine.md, "KV cache events"):

- PUB message: three frames ``(topic, seq, payload)``; ``seq`` is 8 bytes big-endian,
  0 for the first batch of a process and +1 per batch (a batch dropped on a full queue
  leaves a gap, so subscribers see the loss).
- payload: a msgpack array ``[ts, events, data_parallel_rank]`` (``ts`` in seconds since
  the epoch, float); each event a msgpack map tagged by ``"type"``:
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
  "block_size", "lora_id", "medium", "lora_name"[, "extra_keys"]}``,
  ``{"type": "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``.
- replay: a client sends ``(identity, b"", start_seq)`` to the ROUTER; it gets every
  buffered batch with ``seq >= start_seq`` as ``(identity, b"", topic, seq, payload)``,
  then the end marker ``(identity, b"", b"", -1 as 8 signed big-endian bytes, b"")``.

Block hashes are unsigned 64-bit ints
(:func:`~kvpilot.engine.core.kv_events.block_hash`). A salted block, and a block of a
LoRA adapter, carries its keys in ``extra_keys`` (one entry per block: adapter name,
then salt), as vLLM does for the keys it mixes into a hash; an adapter's block also sets
``lora_id`` and ``lora_name``. ``vllm-router`` 0.1.17 refuses a whole batch that holds
a store whose ``extra_keys`` carry a salt, an adapter's salted blocks included ("dense
batch rejected ... reason=ExtraKeys"; it cannot tell salts apart); it accepts an
adapter's unsalted stores (``extra_keys`` of the adapter name only) and never credits
them to a base-model request. Salted and adapter stores go out in batches of their own,
so a base-model store or a removal of the same step is never lost with them (checked
against the binary: tests/engine/server/test_router_kv_aware.py).

Design after vLLM's ``vllm/distributed/kv_events.py`` (event types, PUB + ROUTER replay,
replay buffer) and TensorRT-LLM's publisher (the map-tagged events and the topic frame in
replay replies that current routers expect); the code is kvpilot's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvpilot.engine.core.kv_events import BlockStored, KVEvent

logger = logging.getLogger(__name__)

# The replay stream's last message carries this sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# /kv_event_sources advertises these two: vllm-router 0.1.17 subscribes to a rank only
# when its entry says `"encoding": "msgpack"` and `"schema_version": 1`.
WIRE_ENCODING: Final = "msgpack"
WIRE_SCHEMA_VERSION: Final = 1
PUBLISHERS = ("zmq", "null")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class KVEventsConfigError(ValueError):
    """A ``--kv-events-config`` value is refused; the message names the field, the value
    and what is allowed."""


# ---------------------------------------------------------------------- config
@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (same keys, same defaults).

    Attributes:
        enable_kv_cache_events: publish events at all.
        publisher: ``"zmq"`` (default when events are on) or ``"null"`` (collect, send
            nothing; the default when they are off).
        endpoint: the PUB socket's address: ``tcp://HOST:PORT`` (``*`` for every
            interface; port 0 picks a free one, and ``/kv_event_sources`` reports it),
            ``ipc://PATH`` or ``inproc://NAME``. The socket always binds (subscribers
            connect to it).
        replay_endpoint: the ROUTER socket answering replay requests, or None (no replay).
        buffer_steps: batches kept for replay (one batch per engine step with events).
        hwm: ZMQ send high-water mark of the PUB socket (messages).
        max_queue_size: batches waiting for the publisher thread at most; a batch that
            finds the queue full is dropped (its ``seq`` stays unused: a visible gap).
        topic: the first frame of every PUB message (subscribers filter on it).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> KVEventsConfigError:
            return KVEventsConfigError(
                f"--kv-events-config: {field} must be {allowed}; got {getattr(self, field)!r}")

        if not isinstance(self.enable_kv_cache_events, bool):
            raise bad("enable_kv_cache_events", "true or false")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        elif self.publisher not in PUBLISHERS:
            raise bad("publisher", " or ".join(repr(p) for p in PUBLISHERS))
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            problem = _endpoint_problem(value)
            if problem:
                raise bad(name, f"tcp://HOST:PORT, ipc://PATH or inproc://NAME ({problem})")
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":0"):
            raise bad("replay_endpoint", "an address other than endpoint")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise bad(name, f"an integer >= {low}")
        if not isinstance(self.topic, str):
            raise bad("topic", "a string")

    @property
    def publishes(self) -> bool:
        """Events are collected and sent on ZMQ (what ``/kv_event_sources`` advertises)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVEventsConfig:
        """Build from the parsed JSON object.

        Raises:
            KVEventsConfigError: not an object, an unknown key, or a bad value.
        """
        if not isinstance(data, Mapping):
            raise KVEventsConfigError(
                f"--kv-events-config must be a JSON object; got {type(data).__name__} {data!r:.80}")
        allowed = [f.name for f in cls.__dataclass_fields__.values()]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise KVEventsConfigError(
                f"--kv-events-config: unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse vLLM's ``--kv-events-config`` JSON text.

        Raises:
            KVEventsConfigError: invalid JSON, or any :meth:`from_dict` refusal.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise KVEventsConfigError(f"--kv-events-config is not valid JSON ({e}); got {text!r:.200}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def _endpoint_problem(value: object) -> str:
    """Why ``value`` is no usable ZMQ endpoint ('' when it is one)."""
    if not isinstance(value, str):
        return "not a string"
    if not value.startswith(ENDPOINT_SCHEMES):
        return "unknown scheme"
    if value.startswith("tcp://"):
        host, sep, port = value[len("tcp://"):].rpartition(":")
        if not sep or not host:
            return "no HOST:PORT"
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            return f"port {port!r} is not in 0..65535"
    elif value.endswith("://"):
        return "empty address"
    return ""


# ------------------------------------------------------------------- batches
def _is_salted_store(ev: KVEvent) -> bool:
    """A store that travels in batches of its own: salted or of a LoRA adapter
    (``extra_keys``, ``lora_id`` or ``lora_name`` set)."""
    return type(ev) is BlockStored and (
        ev.extra_keys is not None or ev.lora_id is not None or ev.lora_name is not None)


def split_salted(events: Iterable[KVEvent]) -> list[list[KVEvent]]:
    """Cut ``events`` into maximal consecutive runs of stores with extra keys (salted
    or of a LoRA adapter) and of everything else (base-model unsalted stores, removals,
    clears), keeping the order. Returns the runs (``[]`` for no events); the input is
    not mutated. vllm-router 0.1.17 drops a whole batch that holds a salted store (an
    adapter's salted ones included), so each run is sent as a batch of its own: the
    router loses at most the salted stores, never a removal or a base-model store sent
    in the same step. An adapter's unsalted stores are accepted by 0.1.17; they travel
    apart all the same, so a router that refuses adapter stores loses only those."""
    runs: list[list[KVEvent]] = []
    previous: bool | None = None
    for ev in events:
        salted = _is_salted_store(ev)
        if salted is not previous:
            runs.append([])
            previous = salted
        runs[-1].append(ev)
    return runs


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int = 0) -> bytes:
    """One PUB payload: msgpack ``[ts, [event maps], data_parallel_rank]``."""
    import msgpack

    return msgpack.packb([ts, [ev.to_wire() for ev in events], data_parallel_rank], use_bin_type=True)


# ------------------------------------------------------------------ publishers
class EventPublisher(Protocol):
    """Where the engine hands each step's events."""

    def publish(self, events: list[KVEvent]) -> None: ...

    def shutdown(self) -> None: ...


class NullEventPublisher:
    """Drops every batch (``"publisher": "null"``)."""

    endpoint: str | None = None
    replay_endpoint: str | None = None

    def start(self) -> None:
        return None

    def publish(self, events: list[KVEvent]) -> None:
        return None

    def shutdown(self) -> None:
        return None


_STOP = object()


class ZmqEventPublisher:
    """PUB socket for event batches, ROUTER socket for replays, one background thread.

    :meth:`publish` only stamps the time and queues the list (the engine thread never
    encodes or touches a socket); the thread encodes, numbers, sends and buffers.

    Args:
        config: the validated ``--kv-events-config``.
        data_parallel_rank: the third element of every batch (kvpilot runs rank 0).
        clock: wall-clock seconds for the batch timestamp.

    Attributes:
        endpoint, replay_endpoint: the bound addresses after :meth:`start` (a ``:0``
            port resolved to the one the OS picked), as ``/kv_event_sources`` reports.
        published_batches, dropped_batches: counts since start.
    """

    JOIN_TIMEOUT = 2.0
    POLL_SECONDS = 0.05

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.clock = clock
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.published_batches = 0
        self.dropped_batches = 0
        self._drops_pending = 0  # engine thread only: drops since the last queued batch
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Bind the sockets and start the thread.

        Raises:
            KVEventsConfigError: an address cannot be bound (in use, no such
                interface); nothing stays open then.
        """
        import zmq

        if self._thread is not None:
            return
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(self.config.hwm)
            self.endpoint = self._bind(self._pub, "endpoint", self.config.endpoint)
            if self.config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._bind(self._replay, "replay_endpoint", self.config.replay_endpoint)
        except BaseException:
            self._close_sockets()
            self._ctx.term()
            self._ctx = None
            raise
        self._thread = threading.Thread(target=self._run, name="kvpilot-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay: %s, topic %r)",
                    self.endpoint, self.replay_endpoint, self.config.topic)

    @staticmethod
    def _bind(sock: Any, field: str, address: str) -> str:
        import zmq

        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            raise KVEventsConfigError(f"--kv-events-config: cannot bind {field} {address!r}: {e}") from None
        bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        return bound.decode() if isinstance(bound, bytes) else str(bound)

    def shutdown(self) -> None:
        """Send what is queued, stop the thread (bounded wait), close the sockets
        (linger 0) and the context. Idempotent; :meth:`publish` is a no-op after it."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=self.JOIN_TIMEOUT)
        thread.join(self.JOIN_TIMEOUT)
        if thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %.1fs", self.JOIN_TIMEOUT)
            return  # its sockets are still in use there; the daemon thread dies with the process
        self._ctx.term()

    # -------------------------------------------------------------- publishing
    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (engine thread; never blocks). On a full queue the
        batch is dropped and counted, and the next one skips its ``seq``."""
        if self._closed or not events:
            return
        try:
            self._queue.put_nowait((self.clock(), events, self._drops_pending))
        except queue.Full:
            self.dropped_batches += 1
            self._drops_pending += 1
            if self.dropped_batches & (self.dropped_batches - 1) == 0:  # 1, 2, 4, 8, ...
                logger.warning("KV events: publisher queue full (%d batches); %d batches dropped so far",
                               self.config.max_queue_size, self.dropped_batches)
            return
        self._drops_pending = 0

    def _run(self) -> None:
        import zmq

        seq = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                if self._replay is not None and poller.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=self.POLL_SECONDS)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                ts, events, drops = item
                seq += drops
                for run in split_salted(events):
                    try:
                        payload = encode_batch(ts, run, self.data_parallel_rank)
                        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    except Exception:  # a broken batch must not stop the stream; its seq is a gap
                        logger.exception("KV events: batch %d could not be sent", seq)
                        seq += 1
                        continue
                    self._buffer.append((seq, payload))
                    self.published_batches += 1
                    seq += 1
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        """Answer one replay request: every buffered batch from ``start_seq`` on, then
        the end marker. A malformed request is logged and ignored."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a replay request of %d frames (want identity, empty, "
                           "8-byte start seq)", len(frames))
            return
        identity, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None


def make_publisher(config: KVEventsConfig) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config`` asks for (not started)."""
    return ZmqEventPublisher(config) if config.publishes else NullEventPublisher()
