"""Where adapters come from: local folders, ``file://``, an S3 store (moto's server, as
the engine pod fetches at run time) and the operator's adapters file."""

from __future__ import annotations

import io
import json

import pytest
import torch

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.lora import sources

from .test_model_families import make_engine, tiny_checkpoint

peft = pytest.importorskip("peft", reason="peft is a dev dependency (pyproject's dev extra)")


def test_local_paths_and_file_uris_are_used_as_they_are(tmp_path):
    assert sources.resolve(str(tmp_path), "a", print) == tmp_path
    assert sources.resolve(f"file://{tmp_path}", "a", print) == tmp_path


@pytest.mark.parametrize("uri,message", [
    ("ftp://host/x", "unknown scheme"),
    ("hf://only-one-part", "is not hf://ORG/NAME"),
    ("s3://Bad_Bucket/x", "fetching s3://Bad_Bucket/x failed"),
])
def test_bad_uris_are_refused_naming_lora_path(uri, message, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPILOT_ADAPTER_CACHE", str(tmp_path))
    with pytest.raises(InvalidRequestError, match=message) as e:
        sources.resolve(uri, "a", print)
    assert e.value.param == "lora_path"
    assert not any(tmp_path.iterdir())  # nothing half-fetched is left behind


def test_the_adapters_file(tmp_path):
    f = tmp_path / "adapters.json"
    f.write_text(json.dumps([{"name": "a", "uri": "s3://b/a"}, {"name": "b", "uri": "/x"}]))
    assert sources.read_adapters_file(f) == [("a", "s3://b/a"), ("b", "/x")]
    for bad, message in [({"name": "a"}, "must be a JSON list"), ([{"name": "a"}], "entry 0 must be an object"),
                         ([{"name": "a", "uri": "x", "rank": 1}], "unknown fields"),
                         ([{"name": "a", "uri": "x"}, {"name": "a", "uri": "y"}], "listed twice")]:
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            sources.read_adapters_file(f)


@pytest.mark.tools
@pytest.mark.server
def test_an_s3_adapter_is_fetched_once_and_serves_like_the_local_one(tmp_path, monkeypatch):
    from minio import Minio

    from kvpilot.fetch.s3 import s3_client
    from tests.fetch.servers import s3_server

    from .test_lora import make_adapter

    hf = tiny_checkpoint("llama", tmp_path / "base")
    make_adapter(hf, tmp_path / "local", 4, 8, ["q_proj", "v_proj"], False, seed=3)
    monkeypatch.setenv("KVPILOT_ADAPTER_CACHE", str(tmp_path / "cache"))
    with s3_server() as endpoint:
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
               "AWS_REGION": "us-east-1"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        client: Minio = s3_client(env)
        client.make_bucket("adapters")
        for f in (tmp_path / "local").iterdir():
            data = f.read_bytes()
            client.put_object("adapters", f"team/qv/{f.name}", io.BytesIO(data), len(data))
        engine = make_engine(tmp_path / "base", enable_lora=True)
        remote = engine.lora.register("remote", "s3://adapters/team/qv")
        local = engine.lora.register("local", tmp_path / "local")
        assert remote.lora_path == "s3://adapters/team/qv"  # as given: /v1/models shows it
        a, b = engine.lora.acquire(remote), engine.lora.acquire(local)
        assert a.modules.keys() == b.modules.keys()
        assert all(torch.equal(a.modules[k][i], b.modules[k][i]) for k in a.modules for i in (0, 1))
        (fetched,) = (tmp_path / "cache").iterdir()
        engine.lora.unregister("remote")
        engine.lora.register("remote", "s3://adapters/team/qv")  # the cached copy, not a second fetch
        assert list((tmp_path / "cache").iterdir()) == [fetched]
