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
- :class:`KVEventsConfig` is vLLM's ``--kv-events-config`` JSON, validated, with two
  keys of kvpilot's: ``event_encoding`` and ``extra_publishers``.

Wire format (``"event_encoding": "map"``, vLLM 0.32's, what ``vllm-router`` 0.1.17
decodes; checked against the binary, see docs/engine.md, "KV cache events"):

- PUB message: three frames ``(topic, seq, payload)``; ``seq`` is 8 bytes big-endian,
  0 for the first batch of a process and +1 per batch (a batch dropped on a full queue
  leaves a gap, so subscribers see the loss).
- payload: a msgpack array ``[ts, events, data_parallel_rank]`` (``ts`` in seconds since
  the epoch, float); each event a msgpack map tagged by ``"type"``, as vLLM's msgspec
  encoder writes it (:meth:`~kvpilot.engine.core.kv_events.BlockStored.to_wire`).
  ``"array"`` sends vLLM 0.10's positional events instead (llm-d's KV cache indexer).
- replay: a client sends ``(identity, b"", start_seq)`` to the ROUTER; it gets every
  buffered batch with ``seq >= start_seq`` as ``(identity, b"", topic, seq, payload)``,
  then the end marker ``(identity, b"", b"", -1 as 8 signed big-endian bytes, b"")``.

``vllm-router`` 0.1.17 refuses a whole batch that holds a store whose ``extra_keys``
carry a salt ("dense batch rejected ... reason=ExtraKeys"; it cannot tell salts apart);
it accepts an adapter's unsalted stores and never credits them to a base-model request.
Stores of a salted prefix or of an adapter (``BlockStored.isolated``) go out in batches
of their own, so a base-model store or a removal of the same step is never lost with them
(checked against the binary: tests/engine/server/test_router_kv_aware.py).

Design after vLLM's ``vllm/distributed/kv_events.py`` (event types, PUB + ROUTER replay,
replay buffer, bind or connect) and TensorRT-LLM's publisher (the map-tagged events and the topic frame in
replay replies that current routers expect); the code is kvpilot's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvpilot.engine.core.kv_events import AllBlocksCleared, BlockStored, KVEvent

logger = logging.getLogger(__name__)

# The replay stream's last message carries this sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# /kv_event_sources advertises these two: vllm-router 0.1.17 subscribes to a rank only
# when its entry says `"encoding": "msgpack"` and `"schema_version": 1`.
WIRE_ENCODING: Final = "msgpack"
WIRE_SCHEMA_VERSION: Final = 1
PUBLISHERS = ("zmq", "null")
EVENT_ENCODINGS = ("map", "array")
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
        endpoint: the PUB socket's address: ``tcp://HOST:PORT``, ``ipc://PATH`` or
            ``inproc://NAME``. As vLLM decides: a wildcard host (``*``, ``::``), ``ipc``
            and ``inproc`` bind (subscribers connect to the engine); any other host is
            connected to (a subscriber that binds, as llm-d's KV cache indexer does).
            kvpilot also binds ``0.0.0.0`` and port 0 (:func:`binds`); with port 0 the
            OS picks a free port, and ``/kv_event_sources`` reports it.
        replay_endpoint: the ROUTER socket answering replay requests, or None (no replay).
        buffer_steps: batches kept for replay (one batch per engine step with events).
        hwm: ZMQ send high-water mark of the PUB socket (messages).
        max_queue_size: batches waiting for the publisher thread at most; a batch that
            finds the queue full is dropped (its ``seq`` stays unused: a visible gap).
        topic: the first frame of every PUB message (subscribers filter on it).
        event_encoding: kvpilot's key: ``"map"`` (default; vLLM 0.11 and later: each
            event a msgpack map tagged by ``type``, what vllm-router decodes) or
            ``"array"`` (vLLM 0.10's positional events, what llm-d's KV cache indexer
            v0.3.0 decodes).
        extra_publishers: kvpilot's key: more PUB sockets that send the same batches
            (same ``seq``) to another consumer, each ``{"endpoint", "topic",
            "event_encoding"}`` with the meanings above (no replay), e.g. llm-d's
            indexer beside vllm-router.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    event_encoding: str = "map"
    extra_publishers: tuple[ExtraPublisher, ...] = ()

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
        if self.event_encoding not in EVENT_ENCODINGS:
            raise bad("event_encoding", " or ".join(repr(e) for e in EVENT_ENCODINGS))
        extra: Any = self.extra_publishers
        if isinstance(extra, list):
            extra = tuple(extra)
        if not isinstance(extra, tuple):
            raise bad("extra_publishers", "a list of {\"endpoint\", \"topic\", \"event_encoding\"} objects")
        extra = tuple(ExtraPublisher.from_dict(item, i) if not isinstance(item, ExtraPublisher) else item
                      for i, item in enumerate(extra))
        object.__setattr__(self, "extra_publishers", extra)
        taken = [self.endpoint, self.replay_endpoint]
        for i, pub in enumerate(extra):
            if pub.endpoint in taken and not pub.endpoint.endswith(":0"):
                raise KVEventsConfigError(
                    f"--kv-events-config: extra_publishers[{i}].endpoint must be an address no other socket "
                    f"uses; got {pub.endpoint!r}")
            taken.append(pub.endpoint)

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
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["extra_publishers"] = [dataclasses.asdict(p) for p in self.extra_publishers]
        return out


@dataclass(frozen=True)
class ExtraPublisher:
    """One of ``--kv-events-config``'s ``extra_publishers``: a PUB socket sending the
    same batches as the main one (see :class:`KVEventsConfig` for the fields)."""

    endpoint: str
    topic: str = ""
    event_encoding: str = "map"

    @classmethod
    def from_dict(cls, data: object, index: int) -> ExtraPublisher:
        """Build ``extra_publishers[index]`` from its JSON object.

        Raises:
            KVEventsConfigError: not an object, an unknown or missing key, a bad value.
        """
        where = f"--kv-events-config: extra_publishers[{index}]"
        if not isinstance(data, Mapping):
            raise KVEventsConfigError(f"{where} must be an object with endpoint, topic and event_encoding; "
                                      f"got {data!r:.80}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise KVEventsConfigError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")
        if "endpoint" not in data:
            raise KVEventsConfigError(f"{where}: endpoint is required")
        problem = _endpoint_problem(data["endpoint"])
        if problem:
            raise KVEventsConfigError(f"{where}.endpoint must be tcp://HOST:PORT, ipc://PATH or inproc://NAME "
                                      f"({problem}); got {data['endpoint']!r}")
        if not isinstance(data.get("topic", ""), str):
            raise KVEventsConfigError(f"{where}.topic must be a string; got {data['topic']!r}")
        if data.get("event_encoding", "map") not in EVENT_ENCODINGS:
            raise KVEventsConfigError(f"{where}.event_encoding must be "
                                      f"{' or '.join(repr(e) for e in EVENT_ENCODINGS)}; got {data['event_encoding']!r}")
        return cls(**data)


def binds(endpoint: str) -> bool:
    """Whether a publisher binds ``endpoint`` (else it connects to it): vLLM's rule (a
    wildcard host ``*`` or ``::``, ``ipc``, ``inproc``), plus two kvpilot keeps from
    ever connecting: the wildcard ``0.0.0.0`` (a connection there reaches this host
    only, a publisher talking to nobody) and TCP port 0 (see :class:`KVEventsConfig`)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host == "0.0.0.0" or port == "0"


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
    """A store that travels in batches of its own: of a salted chain or of a LoRA
    adapter (``BlockStored.isolated``)."""
    return type(ev) is BlockStored and ev.isolated


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


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int = 0,
                 event_encoding: str = "map") -> bytes:
    """One PUB payload: msgpack ``[ts, [events], data_parallel_rank]``, each event its
    tagged map (``"map"``) or its positional array (``"array"``; an ``AllBlocksCleared``
    preceded by a ``BlockRemoved`` of what it dropped, which llm-d's indexer needs)."""
    import msgpack

    if event_encoding == "array":
        arrays = [a for ev in events for a in (ev.to_arrays() if isinstance(ev, AllBlocksCleared) else [ev.to_array()])]
        return msgpack.packb([ts, arrays, data_parallel_rank], use_bin_type=True)
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
        endpoint, replay_endpoint: the addresses after :meth:`start` (a bound ``:0``
            port resolved to the one the OS picked; a connected endpoint as given), as
            ``/kv_event_sources`` reports.
        extra_endpoints: the ``extra_publishers``' addresses after :meth:`start`.
        published_batches, dropped_batches: counts since start (a batch sent to every
            socket counts once).
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
        self.extra_endpoints: list[str] = []
        self.published_batches = 0
        self.dropped_batches = 0
        self._drops_pending = 0  # engine thread only: drops since the last queued batch
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._extra: list[tuple[Any, bytes, str]] = []  # (PUB socket, topic, event encoding)
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Bind or connect the sockets and start the thread.

        Raises:
            KVEventsConfigError: an address cannot be bound (in use, no such
                interface) or connected to; nothing stays open then.
        """
        import zmq

        if self._thread is not None:
            return
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(self.config.hwm)
            self.endpoint = self._open(self._pub, "endpoint", self.config.endpoint)
            if self.config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._bind(self._replay, "replay_endpoint", self.config.replay_endpoint)
            for i, extra in enumerate(self.config.extra_publishers):
                sock = self._ctx.socket(zmq.PUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.set_hwm(self.config.hwm)
                self._extra.append((sock, extra.topic.encode(), extra.event_encoding))
                self.extra_endpoints.append(self._open(sock, f"extra_publishers[{i}].endpoint", extra.endpoint))
        except BaseException:
            self._close_sockets()
            self._ctx.term()
            self._ctx = None
            raise
        if not binds(self.config.endpoint):
            logger.warning("KV events: connecting to %s, as vLLM connects to any endpoint that is not a wildcard: "
                           "a consumer must bind there (llm-d's indexer does); a router that subscribes "
                           "(vllm-router) cannot reach it. To bind, use tcp://*:PORT or port 0.",
                           self.config.endpoint)
        self._thread = threading.Thread(target=self._run, name="kvpilot-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (%s, replay: %s, topic %r, %s events)%s",
                    self.endpoint, "bound" if binds(self.config.endpoint) else "connected", self.replay_endpoint,
                    self.config.topic, self.config.event_encoding,
                    "".join(f"; also on {e} (topic {x.topic!r}, {x.event_encoding} events)"
                            for e, x in zip(self.extra_endpoints, self.config.extra_publishers, strict=True)))

    @classmethod
    def _open(cls, sock: Any, field: str, address: str) -> str:
        """Bind ``address`` or connect to it (:func:`binds`); returns the address."""
        import zmq

        if binds(address):
            return cls._bind(sock, field, address)
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            raise KVEventsConfigError(f"--kv-events-config: cannot connect {field} to {address!r}: {e}") from None
        return address

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
                        payload = encode_batch(ts, run, self.data_parallel_rank, self.config.event_encoding)
                        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    except Exception:  # a broken batch must not stop the stream; its seq is a gap
                        logger.exception("KV events: batch %d could not be sent", seq)
                        seq += 1
                        continue
                    if self._extra:
                        self._send_extra(ts, run, seq, payload)
                    self._buffer.append((seq, payload))
                    self.published_batches += 1
                    seq += 1
        finally:
            self._close_sockets()

    def _send_extra(self, ts: float, run: Sequence[KVEvent], seq: int, payload: bytes) -> None:
        """Send batch ``seq`` on the ``extra_publishers`` sockets, encoded once per
        encoding (``payload`` is the main socket's); a failure is logged, never raised."""
        payloads = {self.config.event_encoding: payload}
        for sock, topic, encoding in self._extra:
            try:
                if encoding not in payloads:
                    payloads[encoding] = encode_batch(ts, run, self.data_parallel_rank, encoding)
                sock.send_multipart((topic, seq.to_bytes(8, "big"), payloads[encoding]))
            except Exception:
                logger.exception("KV events: batch %d could not be sent to an extra publisher", seq)

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
        for sock in (self._pub, self._replay, *(x[0] for x in self._extra)):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._extra = []


def make_publisher(config: KVEventsConfig) -> ZmqEventPublisher | NullEventPublisher:
    """The publisher ``config`` asks for (not started)."""
    return ZmqEventPublisher(config) if config.publishes else NullEventPublisher()
