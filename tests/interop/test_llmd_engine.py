"""Two ``kvpilot serve`` engines feed llm-d's precise prefix-cache indexer (v0.3.0, the
helper in tests/interop/llmd_indexer), as they would in an llm-d stack: each engine's
publisher *connects* to the indexer's bound SUB socket with its own ``kv@<pod>@<model>``
topic, in vLLM 0.10's positional encoding (``extra_publishers``; the main socket stays
vLLM 0.32's map encoding for vllm-router), hashing blocks with
``--prefix-caching-hash-algo sha256_cbor_64bit`` under the indexer's seed
(``PYTHONHASHSEED`` = llm-d's ``hashSeed``).

llm-d recomputes the block keys of a prompt from its token ids and looks them up among
the hashes the engines published, so a pod scores only if its hashes are byte for byte
the ones llm-d computes: the pod that served a prompt scores highest for it and for a
prompt that extends it, the other pod not at all. A connecting PUB drops what it sends
before its connection is up, so each engine first serves a small probe prompt until
llm-d has indexed it (no blind sleeps)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.interop.llmd import LlmdIndexer
from tests.serverproc import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.tools]

SEED = "4242"
BS = 16
MODEL = "smollm2-135m-instruct"
PODS = ("pod-a", "pod-b")


def engine(pod: str, indexer: LlmdIndexer) -> ServerProcess:
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
              "extra_publishers": [{"endpoint": indexer.zmq_endpoint, "topic": f"kv@{pod}@{MODEL}",
                                    "event_encoding": "array"}]}
    return ServerProcess("--kv-cache-memory", "0.1", "--max-model-len", "1024", "--served-model-name", MODEL,
                         "--prefix-caching-hash-algo", "sha256_cbor_64bit",
                         "--kv-events-config", json.dumps(events), env={"PYTHONHASHSEED": SEED})


def complete(server: ServerProcess, token_ids: list[int]) -> None:
    """Serve ``token_ids`` as the prompt (so the cached blocks are exactly these)."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": token_ids, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def test_llmd_scores_the_pod_whose_engine_holds_the_prefix():
    with LlmdIndexer(hash_seed=SEED, block_size=BS) as indexer:
        servers = {pod: engine(pod, indexer) for pod in PODS}
        try:
            for server in servers.values():
                server.wait_ready()
            for i, (pod, server) in enumerate(servers.items()):
                sent: list[list[int]] = []

                def send_probe(server: ServerProcess = server, base: int = 20000 + 5000 * i,
                               sent: list[list[int]] = sent) -> None:
                    # A new one-block prompt each time (a repeated one would hit the cache
                    # and publish nothing); the first one indexed proves the link is up.
                    sent.append(prompt(base + BS * len(sent), 1))
                    complete(server, [*sent[-1], 0])

                indexer.wait_for(lambda pod=pod, sent=sent: any(indexer.score(MODEL, p).get(pod) == 1 for p in sent),
                                 f"{pod}'s probe", timeout=60, retry=send_probe, retry_every=1.0)

            # pod-a serves a 6-block prompt (+1 token), pod-b another one.
            a_prompt, b_prompt = prompt(1000, 6), prompt(3000, 6)
            complete(servers["pod-a"], [*a_prompt, 7])
            complete(servers["pod-b"], [*b_prompt, 7])
            indexer.wait_for(lambda: indexer.score(MODEL, a_prompt) == {"pod-a": 6}
                             and indexer.score(MODEL, b_prompt) == {"pod-b": 6},
                             "both engines' six blocks", timeout=30)
            # A request extending pod-a's prefix: pod-a scores its 6 blocks, pod-b none;
            # sharing only the first 2 blocks: 2.
            assert indexer.score(MODEL, [*a_prompt, *prompt(9000, 2)]) == {"pod-a": 6}
            assert indexer.score(MODEL, [*a_prompt[:2 * BS], *prompt(9000, 2)]) == {"pod-a": 2}
            assert indexer.score(MODEL, prompt(9000, 3)) == {}
            # llm-d's keys are the engine's hashes: the engine recomputed nothing else.
            from kvpilot.engine.core.kv_events import BlockHasher

            h, parent, ours = BlockHasher("sha256_cbor_64bit", SEED), None, []
            for k in range(6):
                parent = h.hash_block(parent, a_prompt[k * BS:(k + 1) * BS])
                ours.append(parent)
            assert indexer.keys(MODEL, a_prompt) == ours
        finally:
            logs = {pod: s.logs() for pod, s in servers.items()}
            for server in servers.values():
                server.stop()
    for pod, text in logs.items():
        assert "KV events: block hashes sha256_cbor_64bit, NONE_HASH seed from PYTHONHASHSEED" in text, (pod, text)
