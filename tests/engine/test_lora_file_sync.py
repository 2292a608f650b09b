"""The adapters file applied to an engine: loads, unloads, URI changes, failures retried,
adapters loaded through the API alone left alone."""

from __future__ import annotations

import json

import pytest

from kvpilot.engine.lora.file_sync import AdapterFileSync

from .test_model_families import make_engine, tiny_checkpoint

peft = pytest.importorskip("peft", reason="peft is a dev dependency (pyproject's dev extra)")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from .test_lora import make_adapter

    root = tmp_path_factory.mktemp("filesync")
    hf = tiny_checkpoint("llama", root / "base")
    for i in range(3):
        make_adapter(hf, root / f"a{i}", 4, 8, ["q_proj"], False, seed=i)
    return root


def write(path, entries):
    path.write_text(json.dumps([{"name": n, "uri": str(u)} for n, u in entries]))


def names(engine):
    return sorted(r.lora_name for r in engine.lora.list())


def test_the_file_drives_loads_and_unloads(setup, tmp_path):
    engine = make_engine(setup / "base", enable_lora=True)
    f = tmp_path / "adapters.json"
    now = [0.0]
    sync = AdapterFileSync(engine.lora, f, retry_seconds=30, clock=lambda: now[0])
    write(f, [("x", setup / "a0"), ("y", setup / "a1")])
    assert sorted(sync.sync().loaded) == ["x", "y"] and names(engine) == ["x", "y"]
    engine.lora.register("api-only", setup / "a2")  # through the API: not the file's
    write(f, [("x", setup / "a0")])
    r = sync.sync()
    assert r.unloaded == ["y"] and names(engine) == ["api-only", "x"]
    write(f, [("x", setup / "a2")])  # the same name, another URI
    r = sync.sync()
    assert r.loaded == ["x"] and engine.lora.get("x").lora_path == str(setup / "a2")
    write(f, [("x", setup / "a2"), ("bad", tmp_path / "missing")])
    r = sync.sync()
    assert "is not a folder" in r.failed["bad"] and names(engine) == ["api-only", "x"]
    assert sync.sync().failed == {}  # not retried before retry_seconds while the file is unchanged
    now[0] = 31.0
    assert "bad" in sync.sync().failed  # retried after
    f.write_text("not json")
    assert sync.sync().loaded == [] and names(engine) == ["api-only", "x"]  # a bad file changes nothing
