"""Fixtures the operator's metric-source tests share."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from kvpilot.operator.autoscaling.metrics_source import PodScrapeSource

from .engine_pages import Pages
from .fake_apiserver import send_json


@pytest.fixture
def scraped():
    """A pod-scraping source over a mock transport: ``(pages, source)``."""
    pages = Pages()
    client = httpx.Client(transport=httpx.MockTransport(pages))
    yield pages, PodScrapeSource("llm/chat", client=client)
    client.close()


class ScriptedPrometheus(BaseHTTPRequestHandler):
    """/api/v1/query: answers ``server.answers`` by the query's first matching key."""

    def do_GET(self):
        query = parse_qs(urlsplit(self.path).query)["query"][0]
        self.server.queries.append(query)
        status, payload = 200, {"status": "success", "data": {"resultType": "vector",
                                                              "result": []}}
        for key, answer in self.server.answers.items():
            if key in query:
                status, payload = answer if isinstance(answer, tuple) else (200, {
                    "status": "success", "data": {"resultType": "vector", "result": answer}})
                break
        send_json(self, status, payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def prom():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedPrometheus)
    server.answers, server.queries = {}, []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
