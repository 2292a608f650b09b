"""`kvpilot fetch-model s3://...` against a real S3 server (moto's), as the init container
runs it: the model files under the prefix arrive with their paths and bytes, the rest
(other prefixes, pickled weights) stay behind, progress is in the log, a rerun resumes,
and every failure is one line naming the URI."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from minio import Minio

from kvpilot.fetch import FetchError
from kvpilot.fetch.s3 import s3_client
from kvpilot.fetch.uris import parse_s3
from tests.fetch.servers import s3_server

pytestmark = [pytest.mark.tools, pytest.mark.server]
KVPILOT = str(Path(sys.executable).with_name("kvpilot"))
WEIGHTS = os.urandom(3 << 20)
OBJECTS = {
    "llama/llama-3-8b/config.json": b'{"model_type": "llama"}',
    "llama/llama-3-8b/model.safetensors": WEIGHTS,
    "llama/llama-3-8b/tokenizer.json": b"{}",
    "llama/llama-3-8b/sub/generation_config.json": b"{}",
    "llama/llama-3-8b/pytorch_model.bin": b"pickle",  # not a model file we fetch
    "llama/llama-3-8b-extra/config.json": b"{}",  # another prefix that starts the same
}


@pytest.fixture(scope="module")
def store():
    with s3_server() as endpoint:
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}
        client: Minio = s3_client(env)
        client.make_bucket("models")
        for key, data in OBJECTS.items():
            client.put_object("models", key, io.BytesIO(data), len(data))
        yield env


def fetch(env: dict, uri: str, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run([KVPILOT, "fetch-model", uri, str(dest)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_the_model_files_under_the_prefix_arrive_with_progress(store, tmp_path):
    dest = tmp_path / "llama-3-8b"
    result = fetch(store, "s3://models/llama/llama-3-8b", dest)
    assert result.returncode == 0, result.stderr
    got = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
    assert got == {"config.json", "model.safetensors", "tokenizer.json", "sub/generation_config.json"}
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    lines = result.stdout.splitlines()
    assert lines[0].startswith("fetch s3://models/llama/llama-3-8b: 4 files, 3.0 MiB ->")
    assert any("model.safetensors (3.0 MiB)" in line for line in lines)
    assert lines[-1].startswith("fetch s3://models/llama/llama-3-8b: done, 4 files, 3.0 MiB in")
    assert not list(dest.rglob("*.part.minio"))  # no partial file left behind

    again = fetch(store, "s3://models/llama/llama-3-8b/", dest)  # a restarted init container
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("(already here)") == 4


@pytest.mark.parametrize(("uri", "env_change", "message"), [
    ("s3://nosuchbucket/x", {}, "s3://nosuchbucket/x: S3 error NoSuchBucket"),
    ("s3://models/nothing-here", {}, "s3://models/nothing-here: no model file"),
    ("s3://models/llama/llama-3-8b", {"AWS_ENDPOINT_URL": "ftp://127.0.0.1:1"},
     "AWS_ENDPOINT_URL 'ftp://127.0.0.1:1': use http(s)://HOST[:PORT]"),
    ("s3://Models", {}, "model URI 's3://Models'"),
    ("s3://models/llama/llama-3-8b", {"AWS_ENDPOINT_URL": "http://127.0.0.1:1"},
     "s3://models/llama/llama-3-8b: MaxRetryError"),
])
def test_failures_are_one_line_naming_the_uri(store, tmp_path, uri, env_change, message):
    result = fetch({**store, **env_change}, uri, tmp_path / "m")
    assert result.returncode == 1
    assert result.stderr.startswith("kvpilot fetch-model: ") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_store_that_never_answers_fails_the_fetch(tmp_path, monkeypatch):
    """MinIO's client waits 5 minutes per attempt, with retries: a store that accepts the
    connection and stays silent would hold the init container for half an hour. Each
    request now gives up after REQUEST_TIMEOUT (here 1 s), then the retries end."""
    import socket
    import time

    import kvpilot.fetch.s3 as s3

    monkeypatch.setattr(s3, "REQUEST_TIMEOUT", (1, 1))
    with socket.socket() as silent:  # the kernel completes the handshake; nobody reads
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}
        started = time.monotonic()
        with pytest.raises(FetchError, match="s3://models/m"):
            s3.fetch_s3(parse_s3("s3://models/m"), tmp_path / "m", print, client=s3.s3_client(env))
        assert time.monotonic() - started < 30
