"""Two ``kvpilot serve`` engines behind the real ``vllm-router --policy kv_aware``
(0.1.17, from the ``router`` extra): a long shared-prefix request warmed on one engine
directly is routed, through the router, to that engine and served from its prefix cache.

The router learns where prefixes are only from the engines' KV events (ZMQ, discovered
through ``/get_server_info`` and ``/kv_event_sources``) and tokenizes requests with the
engines' render endpoints, so a correct routing decision needs all of them. Each prefix
is cached on one engine only, so a large ``cached_tokens`` in the routed answer, and the
engines' request counters, show where the router sent it.

The router's debug log tells when it has ingested an engine's batches ("sequence
advanced source=<instance id> ... seq=N"); the test waits for that rather than sleeping.
A ZMQ subscriber misses what is published before it joins, so a probe request is sent to
each engine until the router reports a batch from it.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.serverproc import ServerProcess, free_port

from .metrics_util import scrape

pytestmark = [pytest.mark.slow, pytest.mark.server]

EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"})
ANSI = re.compile(r"\x1b\[[0-9;]*m")
ADVANCED = re.compile(r"sequence advanced source=(\S+) rank=\d+ seq=(\d+)")
SUCCESS = "kvpilot:request_success_total"


def router_binary() -> str:
    path = Path(sys.executable).with_name("vllm-router")
    found = str(path) if path.exists() else shutil.which("vllm-router")
    if not found:
        pytest.skip("vllm-router is not installed (pip install -e '.[router]')")
    return found


class RouterProcess:
    """``vllm-router --policy kv_aware`` on 127.0.0.1 (free ports), debug log to a file,
    always stopped; ``extra`` are more router flags (``--api-key``)."""

    def __init__(self, *worker_urls: str, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log", delete=False)  # noqa: SIM115 - closed in stop()
        cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--policy", "kv_aware", "--log-level", "debug", "--worker-startup-timeout-secs", "60",
               *extra, "--worker-urls", *worker_urls]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"vllm-router not ready after {timeout}s:\n{self.logs()[-4000:]}")

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return ANSI.sub("", f.read())

    def last_seq(self, instance_id: str) -> int:
        """The highest event batch seq the router has applied from this engine (-1: none)."""
        seqs = [int(seq) for src, seq in ADVANCED.findall(self.logs()) if src == instance_id]
        return max(seqs, default=-1)

    def wait_seq_above(self, instance_id: str, seq: int, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.last_seq(instance_id)
            if got > seq:
                return got
            time.sleep(0.1)
        raise AssertionError(f"the router applied no batch of {instance_id} above seq {seq} in {timeout}s:\n"
                             f"{self.logs()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def engines():
    procs = [ServerProcess("--kv-cache-memory", "0.1", "--max-model-len", "2048", "--log-level", "warning",
                           "--kv-events-config", EVENTS) for _ in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        for p in procs:
            p.instance_id = httpx.get(f"{p.url}/get_server_info", timeout=10).json()["instance_id"]
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def router_for():
    routers: list[RouterProcess] = []

    def start(*urls: str) -> RouterProcess:
        r = RouterProcess(*urls)
        routers.append(r)
        r.wait_ready()
        return r

    yield start
    for r in routers:
        r.stop()


_probe = iter(range(10_000))


def subscribe(router: RouterProcess, engine: ServerProcess) -> None:
    """Send small requests straight to ``engine`` until the router reports one of its
    batches (it has joined the engine's PUB socket; what it missed before comes by replay)."""
    deadline = time.monotonic() + 60
    while router.last_seq(engine.instance_id) < 0:
        assert time.monotonic() < deadline, f"the router never ingested {engine.url}'s events:\n{router.logs()[-4000:]}"
        k = next(_probe)
        prompt = [3000 + 50 * k + i for i in range(40)]  # two full blocks, unique per probe
        r = httpx.post(f"{engine.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        end = time.monotonic() + 2
        while time.monotonic() < end and router.last_seq(engine.instance_id) < 0:
            time.sleep(0.1)


def prefix(topic: str) -> str:
    return " ".join(f"Fact {i}: the {topic} of district {i} is marked on the old map." for i in range(36))


def chat(url: str, system: str, question: str) -> dict:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def warm(router: RouterProcess, engine: ServerProcess, system: str) -> int:
    """Cache ``system`` on ``engine`` (a request sent to it directly) and wait until the
    router has applied the batches that announce it. Returns the prompt's length."""
    before = router.last_seq(engine.instance_id)
    usage = chat(engine.url, system, "Which district is first?")["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    router.wait_seq_above(engine.instance_id, before)
    return usage["prompt_tokens"]


def successes(engine: ServerProcess) -> float:
    """Finished requests of the engine, whatever their finish reason."""
    return sum(v for k, v in scrape(engine.url).items() if k.startswith(SUCCESS))


def routed_to(router: RouterProcess, engines: list[ServerProcess], system: str) -> tuple[int, int]:
    """Send a same-prefix request through the router: (index of the engine that served
    it, by the engines' request counters; its cached prompt tokens)."""
    before = [successes(e) for e in engines]
    usage = chat(router.url, system, "Which district is last?")["usage"]
    deadline = time.monotonic() + 10
    while True:
        grew = [i for i, e in enumerate(engines) if successes(e) > before[i]]
        if grew or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(grew) == 1, f"request counters moved on engines {grew}"
    return grew[0], usage["prompt_tokens_details"]["cached_tokens"]


def test_kv_aware_router_sends_a_prefix_to_the_engine_that_caches_it(engines, router_for):
    a, b = engines
    router = router_for(a.url, b.url)
    for e in engines:
        subscribe(router, e)
    # One prefix cached on each engine: a router that ignored the events could not get
    # both right (and a wrong guess would find nothing cached).
    p, q = prefix("river"), prefix("bridge")
    n_p = warm(router, a, p)
    n_q = warm(router, b, q)
    assert n_p > 400 and n_q > 400
    served, cached = routed_to(router, engines, p)
    assert served == 0 and cached >= n_p - 48, (served, cached, n_p)
    served, cached = routed_to(router, engines, q)
    assert served == 1 and cached >= n_q - 48, (served, cached, n_q)
    # The router tokenized with the render endpoints and credited the cached prefix.
    decisions = re.findall(r'KV prefix decision outcome="prefix_cost" worker="([^"]+)" input_tokens=(\d+) '
                           r"new_prefill_tokens=\d+ credited_prefix_tokens=(\d+)", router.logs())
    assert [(w, int(c) > 400) for w, _, c in decisions[-2:]] == [(a.url, True), (b.url, True)]


def test_a_worker_added_at_run_time_is_indexed_too(engines, router_for):
    a, b = engines
    router = router_for(a.url)
    subscribe(router, a)
    r = httpx.post(f"{router.url}/add_worker", params={"url": b.url}, timeout=30)
    assert r.status_code == 200, r.text
    subscribe(router, b)
    q = prefix("lighthouse")
    n_q = warm(router, b, q)
    warm(router, a, prefix("orchard"))  # something on A too, so A is not simply empty
    served, cached = routed_to(router, engines, q)
    assert served == 1 and cached >= n_q - 48, (served, cached, n_q)


def credited(router: RouterProcess) -> list[tuple[str, int]]:
    """The router's KV routing decisions so far: (worker, prefix tokens it credited)."""
    return [(w, int(c)) for w, _, c in re.findall(
        r'KV prefix decision outcome="prefix_cost" worker="([^"]+)" input_tokens=(\d+) '
        r"new_prefill_tokens=\d+ credited_prefix_tokens=(\d+)", router.logs())]


def test_a_restarted_router_rebuilds_its_index_from_replayed_events(engines, router_for):
    """Blocks announced while no router listened (the router restarted) come back by
    replay from the engine's buffer, so the new router credits them at once."""
    a, b = engines
    first = router_for(a.url, b.url)
    for e in engines:
        subscribe(first, e)
    q = prefix("harbor")
    n_q = warm(first, b, q)
    first.stop()
    again = router_for(a.url, b.url)
    for e in engines:
        subscribe(again, e)  # a live batch after the gap makes the router ask for a replay
    time.sleep(2)
    served, cached = routed_to(again, engines, q)
    assert served == 1 and cached >= n_q - 48, (served, cached, n_q, again.logs()[-3000:])
    assert credited(again)[-1] == (b.url, credited(again)[-1][1]) and credited(again)[-1][1] > 400


def test_a_killed_replica_gets_no_new_requests(router_for):
    """An engine killed (SIGKILL) under the router: its open stream ends with an error
    rather than hanging, and every later request is served by the live engine."""
    procs = [ServerProcess("--kv-cache-memory", "0.05", "--max-model-len", "1024", "--log-level", "warning",
                           "--kv-events-config", EVENTS) for _ in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        router = router_for(procs[0].url, procs[1].url)
        # Stream through the router; whichever engine the stream lands on is killed (the
        # router's choice between two idle engines is its own business).
        body = {"prompt": "Count slowly:", "max_tokens": 400, "stream": True, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # the first chunk: the stream is running on some engine
            loads = [httpx.get(f"{p.url}/get_load", timeout=5).json()["load"] for p in procs]
            assert sorted(loads) == [0, 1], loads
            doomed, live = (procs[0], procs[1]) if loads[0] else (procs[1], procs[0])
            doomed.proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            try:
                rest = list(lines)
                ended_cleanly = any('"finish_reason":"length"' in x.replace(" ", "") for x in rest)
            except httpx.HTTPError:
                ended_cleanly = False
            assert time.monotonic() - t0 < 30, "the cut stream hung"
        assert ended_cleanly is False, "the stream on the killed engine claimed to finish normally"
        # New requests: all served, by the live engine, from the first one on (a failed
        # attempt on the dead one is retried once, elsewhere).
        before = successes(live)
        for i in range(6):
            r = httpx.post(f"{router.url}/v1/completions",
                           json={"prompt": f"Question {i}:", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, (i, r.status_code, r.text, router.logs()[-3000:])
        assert successes(live) - before == 6
    finally:
        for p in procs:
            p.stop()


# ------------------------------------------- adapter stores beside base-model stores
class MirrorWorker:
    """A worker URL for the router that forwards every request to ``engine`` but
    advertises its own KV event source: a :class:`ZmqEventPublisher` the test publishes
    on (``/kv_event_sources``), under its own ``instance_id`` (``/get_server_info``). So
    the test decides exactly which event batches the real router gets from this worker,
    while rendering and generation are the engine's."""

    def __init__(self, engine: ServerProcess) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from kvpilot.engine.kv_events import KVEventsConfig, ZmqEventPublisher

        self.publisher = ZmqEventPublisher(KVEventsConfig(
            enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"))
        self.publisher.start()
        self.instance_id = f"mirror-{engine.instance_id}"
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.command == "GET" and self.path == "/kv_event_sources":
                    r = httpx.get(f"{engine.url}{self.path}", timeout=30)
                    data = r.json()
                    data["0"]["endpoint"] = mirror.publisher.endpoint
                    data["0"]["replay_endpoint"] = mirror.publisher.replay_endpoint
                    return self._reply(200, json.dumps(data).encode(), "application/json")
                if self.command == "GET" and self.path == "/get_server_info":
                    data = httpx.get(f"{engine.url}{self.path}", timeout=30).json()
                    data["instance_id"] = mirror.instance_id
                    return self._reply(200, json.dumps(data).encode(), "application/json")
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "connection")}
                r = httpx.request(self.command, f"{engine.url}{self.path}", content=body, headers=headers, timeout=120)
                self._reply(r.status_code, r.content, r.headers.get("content-type", "application/json"))

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _forward

            def log_message(self, *args: object) -> None:
                return None

        self.http = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.publisher.shutdown()


def rendered_ids(engine: ServerProcess, system: str, question: str) -> list[int]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{engine.url}/v1/chat/completions/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def stores(ids: list[int], block_size: int, lora: tuple[str, int] | None = None, salt: str | None = None) -> list:
    """The BlockStored events the engine's prefix cache would emit for ``ids``' full
    blocks (one chain), for the base model or for adapter ``(name, lora_int_id)``, with
    an optional cache salt."""
    from kvpilot.engine.core.kv_events import KVEventCollector
    from kvpilot.engine.lora.request import LoRARequest

    c = KVEventCollector(block_size)
    adapter = LoRARequest(lora[0], lora[1], f"/adapters/{lora[0]}") if lora else None
    parent = None
    for i in range(0, len(ids) - block_size + 1, block_size):
        parent = c.block_stored(parent, ids[i:i + block_size], salt, adapter)
    return c.drain()


def test_a_base_block_published_beside_an_adapter_block_is_still_credited(engines, router_for, monkeypatch):
    """An engine step that stores an adapter's blocks and base-model blocks: the real
    router (0.1.17) still credits the base-model prefix, and never credits the adapter's
    blocks to a base-model request with the same tokens. vllm-router 0.1.17 drops a whole
    batch holding a store whose ``extra_keys`` carry a salt ("dense batch rejected ...
    reason=ExtraKeys"), an adapter's salted blocks included; the control shows that
    such a store in one batch with a base store loses the base store, which is why the
    publisher sends salted and adapter stores in batches of their own (``split_salted``)."""
    import kvpilot.engine.kv_events as wire

    a, b = engines
    mirror = MirrorWorker(b)
    try:
        bs = httpx.get(f"{b.url}/get_server_info", timeout=10).json()["kv_block_size"]
        router = router_for(a.url, mirror.url)
        subscribe(router, a)
        deadline = time.monotonic() + 60
        k = 0
        while router.last_seq(mirror.instance_id) < 0:  # the router has joined the mirror's PUB socket
            assert time.monotonic() < deadline, router.logs()[-4000:]
            mirror.publisher.publish(stores([5000 + 50 * k + i for i in range(bs)], bs))
            k += 1
            time.sleep(0.3)

        def step(events: list) -> None:
            """Publish one engine step's events and wait until the router has seen them."""
            before = router.last_seq(mirror.instance_id)
            mirror.publisher.publish(events)
            deadline = time.monotonic() + 15
            while router.last_seq(mirror.instance_id) <= before and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # every batch of the step has arrived (the last may be rejected)

        def credit(system: str) -> int:
            """Prefix tokens the router credits to the mirror for a base-model request."""
            n = len(credited(router))
            chat(router.url, system, "Which district is last?")
            return sum(c for w, c in credited(router)[n:] if w == mirror.url)

        def ids(topic: str) -> list[int]:
            return rendered_ids(b, prefix(topic), "Which district is last?")

        # Control: a salted adapter store and a base store in one batch: all is dropped.
        monkeypatch.setattr(wire, "split_salted", lambda events: [list(events)])
        step(stores(ids("quarry"), bs, ("sql-lora", 1), salt="tenant-a") + stores(ids("meadow"), bs))
        assert credit(prefix("meadow")) == 0, router.logs()[-3000:]
        assert "reason=ExtraKeys" in router.logs()
        monkeypatch.undo()

        # One engine step: an adapter's salted and unsalted prompts and a base prompt.
        base_ids = ids("tower")
        step(stores(ids("canal"), bs, ("sql-lora", 1), salt="tenant-a") + stores(ids("harbour"), bs, ("sql-lora", 1))
             + stores(base_ids, bs))
        got = credit(prefix("tower"))
        assert got >= len(base_ids) - 2 * bs, (got, len(base_ids), router.logs()[-3000:])
        # The adapter's blocks are never credited to a base-model request.
        assert credit(prefix("canal")) == 0, router.logs()[-3000:]
        assert credit(prefix("harbour")) == 0, router.logs()[-3000:]
    finally:
        mirror.close()
