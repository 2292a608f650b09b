"""llm-d's precise prefix-cache indexer (llm-d-kv-cache-manager v0.3.0) for tests:
``LlmdIndexer`` runs the helper binary built from tests/interop/llmd_indexer (into
.tools/bin by scripts/install-tools.sh) on 127.0.0.1 with free ports, bounded waits, and
always stops it (SIGTERM, then SIGKILL) even when a test fails.

The helper's ZMQ SUB socket *binds* ``zmq_endpoint``; publishers (engines) *connect* to
it, as llm-d deploys it. ``keys`` returns llm-d's own block keys for token ids (its
ChunkedTokenDatabase), ``score`` llm-d's pod scores (its index Lookup and longest-prefix
scorer, as the scheduler's precise prefix scorer gets them).

Also here, for the tests: ``sha256_cbor_64bit`` and ``block_hashes``, a Python
implementation of the block hash v0.3.0 expects (vLLM's ``sha256_cbor_64bit``), and
``KvEventPublisher``, a ZMQ PUB that connects and sends vLLM's positional (array-like)
event batches on ``kv@<pod>@<model>`` topics.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from tests.operator.tools import TOOLS_BIN, tool
from tests.serverproc import free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests" / "interop" / "llmd_indexer"
BINARY_NAME = "llmd-indexer"
STAMP = TOOLS_BIN / ".llmd-indexer.sha256"
START_TIMEOUT_SECONDS = 30.0
PROBE_POD = "kvpilot-probe"
PROBE_MODEL = "kvpilot-probe-model"


# ------------------------------------------------------------------ block hashes
def sha256_cbor_64bit(value: Any) -> int:
    """vLLM's ``sha256_cbor_64bit``: the lower 64 bits of sha256 over canonical CBOR."""
    import cbor2

    return int.from_bytes(hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()[-8:], "big")


def block_hashes(token_ids: Sequence[int], block_size: int = 16, seed: str = "") -> list[int]:
    """Hashes of the full blocks of ``token_ids``: block i hashes ``[parent, tokens, None]``,
    the first block's parent being ``sha256_cbor_64bit(seed)`` (vLLM's NONE_HASH from
    PYTHONHASHSEED; llm-d's HashSeed)."""
    parent = sha256_cbor_64bit(seed)
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = sha256_cbor_64bit([parent, list(token_ids[start:start + block_size]), None])
        out.append(parent)
    return out


# ------------------------------------------------------------------ events
def block_stored(hashes: Sequence[int], token_ids: Sequence[int], block_size: int = 16,
                 parent: int | None = None, lora_id: int | None = None) -> list[Any]:
    """vLLM's array-like BlockStored, as v0.3.0 decodes it (exactly these six elements)."""
    return ["BlockStored", list(hashes), parent, list(token_ids), block_size, lora_id]


def block_removed(hashes: Sequence[int]) -> list[Any]:
    """vLLM's array-like BlockRemoved, as v0.3.0 decodes it (exactly these two elements)."""
    return ["BlockRemoved", list(hashes)]


def all_blocks_cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def event_batch(events: Iterable[Any], ts: float | None = None,
                data_parallel_rank: int | None = None) -> list[Any]:
    """vLLM's array-like batch ``[ts, events, data_parallel_rank]`` (three elements)."""
    return [time.time() if ts is None else ts, list(events), data_parallel_rank]


class KvEventPublisher:
    """A ZMQ PUB socket that *connects* to ``endpoint`` and sends msgpack batches as
    ``(topic, seq as 8 big-endian bytes, payload)`` on topic ``kv@<pod>@<model>``."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.seq = 0

    def send(self, pod: str, model: str, batch: Any) -> None:
        self.send_payload(f"kv@{pod}@{model}", msgpack.packb(batch))

    def send_payload(self, topic: str, payload: bytes) -> None:
        self.socket.send_multipart([topic.encode(), self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ the indexer
def source_hash() -> str:
    """The hash scripts/install-tools.sh stamps the binary with: sha256sum's lines for the
    module's .go files, go.mod and go.sum (paths sorted), hashed again."""
    paths = sorted(p for p in SOURCE.rglob("*") if p.is_file()
                   and (p.suffix == ".go" or p.name in ("go.mod", "go.sum")))
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(SOURCE)}\n"
                    for p in paths)
    return hashlib.sha256(lines.encode()).hexdigest()


def indexer_binary() -> str:
    """.tools/bin/llmd-indexer, built from the current sources; else one on PATH. A missing
    or stale binary fails the test with the command that builds it: never a skip."""
    found = tool(BINARY_NAME)
    if found == str(TOOLS_BIN / BINARY_NAME):
        stamp = STAMP.read_text().strip() if STAMP.exists() else ""
        if stamp != source_hash():
            pytest.fail(f"{found} was built from other sources than {SOURCE}: run `make tools` "
                        "(scripts/install-tools.sh) to rebuild it", pytrace=False)
    return found


class LlmdIndexerError(RuntimeError):
    """The helper answered an HTTP error (llm-d refused the query)."""


class LlmdIndexer:
    """``with LlmdIndexer(hash_seed="0") as idx:`` llm-d's indexer on free loopback ports."""

    def __init__(self, hash_seed: str = "", block_size: int = 16, topic_filter: str = "kv@",
                 verbosity: int = 0) -> None:
        self.hash_seed = hash_seed
        self.block_size = block_size
        self.zmq_port = free_port()
        self.http_port = free_port()
        self.zmq_endpoint = f"tcp://127.0.0.1:{self.zmq_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.args = [indexer_binary(), f"--zmq-endpoint={self.zmq_endpoint}",
                     f"--http=127.0.0.1:{self.http_port}", f"--hash-seed={hash_seed}",
                     f"--block-size={block_size}", f"--topic-filter={topic_filter}",
                     f"--v={verbosity}"]
        self.dir = Path(tempfile.mkdtemp(prefix="kvpilot-llmd-indexer-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url, timeout=10)

    def start(self, timeout: float = START_TIMEOUT_SECONDS) -> LlmdIndexer:
        # The child keeps its own descriptors; the parent's are closed at once.
        with open(self.dir / "stdout.log", "wb") as stdout, \
                open(self.dir / "stderr.log", "wb") as stderr:
            self.proc = subprocess.Popen(self.args, stdout=stdout, stderr=stderr,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmd-indexer exited with {self.proc.returncode}:\n{self.logs()}")
            if (self.dir / "stdout.log").read_text().startswith("ready "):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"llmd-indexer not ready after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for name in ("stdout.log", "stderr.log"):
            path = self.dir / name
            if path.exists():
                out.append(path.read_text(errors="replace")[-6000:])
        return "\n".join(out)

    def stop(self, timeout: float = 10.0) -> int | None:
        self.client.close()
        if self.proc is None:
            return None
        return stop_process(self.proc, timeout)

    def __enter__(self) -> LlmdIndexer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(path, json=body)
        if response.status_code != 200:
            raise LlmdIndexerError(f"{path} answered {response.status_code}: {response.text}")
        result: dict[str, Any] = response.json()
        return result

    def keys(self, model: str, token_ids: Sequence[int]) -> list[int]:
        """llm-d's block keys (ChunkHash) for ``token_ids`` under its seed and block size."""
        return list(self._post("/keys", {"model": model, "token_ids": list(token_ids)})["keys"])

    def score(self, model: str, token_ids: Sequence[int],
              pods: Sequence[str] | None = None) -> dict[str, int]:
        """llm-d's pod scores (consecutive blocks held from the first) for ``token_ids``;
        a pod that holds no leading block is absent. ``pods`` limits the pods considered.
        Fewer tokens than one block is an error in v0.3.0 (LlmdIndexerError)."""
        body: dict[str, Any] = {"model": model, "token_ids": list(token_ids)}
        if pods is not None:
            body["pods"] = list(pods)
        return dict(self._post("/score", body)["scores"])

    def publisher(self, timeout: float = 10.0) -> KvEventPublisher:
        """A KvEventPublisher connected to this indexer, returned once a probe it sends
        (one block under PROBE_POD and PROBE_MODEL, hashed by llm-d's own /keys) has reached
        the index: a PUB drops what it sends before the SUB's subscription arrives."""
        pub = KvEventPublisher(self.zmq_endpoint)
        tokens = list(range(self.block_size))
        probe = event_batch([block_stored(self.keys(PROBE_MODEL, tokens), tokens,
                                          self.block_size)])
        try:
            self.wait_for(lambda: self.score(PROBE_MODEL, tokens).get(PROBE_POD) == 1,
                          "the publisher's probe batch", timeout,
                          retry=lambda: pub.send(PROBE_POD, PROBE_MODEL, probe))
        except BaseException:
            pub.close()
            raise
        return pub

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = 10.0,
                 retry: Callable[[], object] | None = None, retry_every: float = 0.5) -> None:
        """Poll ``predicate`` until it holds or ``timeout`` passes (then fail, with the
        helper's log). ``retry`` (e.g. a re-publish) runs first and every ``retry_every`` s."""
        deadline = time.monotonic() + timeout
        next_retry = time.monotonic()
        while True:
            if retry is not None and time.monotonic() >= next_retry:
                retry()
                next_retry = time.monotonic() + retry_every
            if predicate():
                return
            if time.monotonic() >= deadline:
                raise AssertionError(f"llm-d indexer: {what} not seen within {timeout}s\n"
                                     f"{self.logs()}")
            time.sleep(0.05)
