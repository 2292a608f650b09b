"""Multi-LoRA serving through the API, as vLLM's: adapters picked by name in ``model``,
listed by ``/v1/models``, loaded and unloaded at runtime with vLLM's routes, bodies,
statuses and messages.

The base model is a tiny random Llama (hidden 64, two layers) with SmolLM2's vocabulary
and tokenizer, so chat templates and text prompts work; its adapters are made by the
``peft`` package with random, non-zero A and B. The app runs in-process over the real
engine (start-up registration through the CLI's own function); one ``kvpilot serve``
process checks that a bad ``--lora-modules`` entry stops start-up by name.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from kvpilot.engine.config import EngineArgs, LoRAModulePath
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.server.api_server import build_app
from kvpilot.engine.server.async_engine import AsyncEngine, wait_until
from kvpilot.engine.server.cli import register_lora_modules
from kvpilot.engine.server.metrics import EngineMetrics
from kvpilot.engine.server.state import ServerState, runtime_lora_updating

peft = pytest.importorskip("peft", reason="peft is a dev dependency (pyproject's dev extra)")

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PROMPT = [1, 17, 300, 4000, 12, 99, 512, 7]  # token ids: no tokenizer work


def _tiny_llama(path: Path, tokenizer) -> object:
    """A random two-layer Llama with the tokenizer's vocabulary, saved with the tokenizer."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # well-separated logits
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return model


def _adapter(hf, folder: Path, r: int, targets: list[str], seed: int) -> Path:
    """A PEFT adapter with random, non-zero A and B, saved to ``folder``."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False,
                          lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(hf), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    """{"base", "sql", "chat", "late", "wide"}: the checkpoint and four adapter folders
    ("wide" has rank 32, over the server's --max-lora-rank 16)."""
    root = tmp_path_factory.mktemp("lora-server")
    hf = _tiny_llama(root / "base", tokenizer)
    return {
        "base": root / "base",
        "sql": _adapter(hf, root / "sql", 4, ["q_proj", "v_proj"], seed=1),
        "chat": _adapter(hf, root / "chat", 8, ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"], seed=2),
        "late": _adapter(hf, root / "late", 4, ["v_proj", "gate_proj"], seed=3),
        "wide": _adapter(hf, root / "wide", 32, ["q_proj"], seed=4),
    }


def _engine_args(base: Path, **kw) -> EngineArgs:
    return EngineArgs(model=str(base), served_model_name=MODEL, device="cpu", dtype="float32",
                      max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory=0.05,
                      **kw)


def _serve(args: EngineArgs, **state_kw):
    """(AsyncEngine, ServerState) started as ``kvpilot serve`` would (--lora-modules
    registered after the model loads); the caller shuts the engine down."""
    def factory() -> LLMEngine:
        llm = LLMEngine(args)
        register_lora_modules(llm, args.lora_modules, MODEL)
        return llm

    engine = AsyncEngine(factory)
    engine.start()
    assert wait_until(lambda: engine.is_ready, 120), engine.failure
    return engine, ServerState(engine, EngineMetrics(MODEL), MODEL, enable_lora=args.enable_lora, **state_kw)


@pytest.fixture(scope="module")
def lora(folders):
    """A client of a LoRA server: adapters "sql" and "chat" (base_model_name "hf-base")
    from --lora-modules, runtime loading allowed."""
    args = _engine_args(folders["base"], enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules=(
        LoRAModulePath("sql", str(folders["sql"])),
        LoRAModulePath("chat", str(folders["chat"]), "hf-base")))
    engine, state = _serve(args, allow_runtime_lora_updating=True)
    try:
        with TestClient(build_app(state)) as client:
            yield client, state
    finally:
        engine.shutdown()


def completion(client, model: str | None, **kw):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **kw}
    if model is not None:
        body["model"] = model
    return client.post("/v1/completions", json=body)


def load(client, name: str, path) -> object:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def unload(client, name: str, **kw) -> object:
    return client.post("/v1/unload_lora_adapter", json={"lora_name": name, **kw})


def error_of(r) -> dict:
    return r.json()["error"]


# ---------------------------------------------------------------- selecting by name

def test_models_lists_the_base_then_each_adapter(lora, folders):
    client, _ = lora
    r = client.get("/v1/models")
    assert r.status_code == 200
    cards = r.json()["data"]
    assert [c["id"] for c in cards[:3]] == [MODEL, "sql", "chat"]
    base, sql, chat = cards[:3]
    assert "parent" not in base and base["root"] == MODEL and base["max_model_len"] == 256
    assert (sql["root"], sql["parent"], sql["object"]) == (str(folders["sql"]), MODEL, "model")
    assert (chat["root"], chat["parent"]) == (str(folders["chat"]), "hf-base")


def test_a_request_by_adapter_name_runs_the_adapter_and_echoes_its_name(lora):
    client, _ = lora
    answers = {}
    for model in (None, MODEL, "sql", "chat"):
        r = completion(client, model, logprobs=0)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == (model or MODEL)
        answers[model] = body["choices"][0]["logprobs"]["token_logprobs"][0]
    assert answers[None] == answers[MODEL]
    # the adapters change the logits: the first token's logprob is not the base model's
    assert answers["sql"] != pytest.approx(answers[MODEL], abs=1e-4)
    assert answers["chat"] != pytest.approx(answers[MODEL], abs=1e-4)
    assert answers["sql"] != pytest.approx(answers["chat"], abs=1e-4)


def test_streams_n_and_chat_echo_the_adapter_name(lora):
    client, _ = lora
    with client.stream("POST", "/v1/completions", json={
            "model": "sql", "prompt": "Hello", "max_tokens": 3, "n": 2, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and {c["model"] for c in chunks} == {"sql"}
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}

    messages = [{"role": "user", "content": "Say hi"}]
    r = client.post("/v1/chat/completions", json={"model": "chat", "messages": messages, "max_tokens": 3, "n": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "chat" and len(r.json()["choices"]) == 2
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "chat", "messages": messages, "max_tokens": 3, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks and {c["model"] for c in chunks} == {"chat"}


def test_render_and_tokenize_accept_adapter_names(lora):
    client, _ = lora
    r = client.post("/v1/completions/render", json={"model": "sql", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()[0]["model"] == "sql" and r.json()[0]["token_ids"] == PROMPT
    r = client.post("/v1/chat/completions/render", json={"model": "chat", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.json()["model"] == "chat"
    r = client.post("/tokenize", json={"model": "sql", "prompt": "Hello"})
    assert r.status_code == 200 and r.json()["count"] >= 1


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("POST", "/v1/completions/render", {"prompt": PROMPT, "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "x"}),
])
def test_an_unknown_adapter_is_vllms_404(lora, method, path, body):
    client, _ = lora
    r = client.request(method, path, json={"model": "nope", **body})
    assert r.status_code == 404
    assert error_of(r) == {
        "message": f"The model `nope` does not exist; this server serves `{MODEL}` and the LoRA adapters "
                   "`GET /v1/models` lists",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


# ---------------------------------------------------------------- load and unload at runtime

def test_load_use_and_unload_an_adapter(lora, folders):
    client, _ = lora
    r = load(client, "late", folders["late"])
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'late' added successfully.")
    assert r.headers["content-type"].startswith("text/plain")
    assert "late" in [c["id"] for c in client.get("/v1/models").json()["data"]]
    r = completion(client, "late")
    assert r.status_code == 200 and r.json()["model"] == "late"

    r = load(client, "late", folders["sql"])  # the name is taken, whatever the folder
    assert r.status_code == 400
    assert (error_of(r)["message"], error_of(r)["param"]) == (
        "The lora adapter 'late' has already been loaded.", "lora_name")

    r = unload(client, "late")
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'late' removed successfully.")
    assert "late" not in [c["id"] for c in client.get("/v1/models").json()["data"]]
    r = completion(client, "late")
    assert r.status_code == 404 and error_of(r)["param"] == "model"

    r = unload(client, "late")
    assert r.status_code == 404
    assert error_of(r) == {"message": "The lora adapter 'late' cannot be found.", "type": "invalid_request_error",
                           "param": "lora_name", "code": "model_not_found"}
    # loaded again: a new adapter (vLLM gives it a new id)
    assert load(client, "late", folders["late"]).status_code == 200
    assert unload(client, "late").status_code == 200


def test_unload_checks_lora_int_id_when_given(lora, folders):
    client, state = lora
    assert load(client, "late", folders["late"]).status_code == 200
    lora_id = state.engine.engine.lora.get("late").lora_int_id
    r = unload(client, "late", lora_int_id=lora_id + 1000)
    assert r.status_code == 404 and error_of(r)["message"] == "The lora adapter 'late' cannot be found."
    assert unload(client, "late", lora_int_id=lora_id).status_code == 200


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, "lora_path", ""),
    ({"lora_name": "", "lora_path": "/x"}, "lora_name", "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "x", "lora_path": ""}, "lora_path", "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": MODEL, "lora_path": "/x"}, "lora_name", "is the served model's name"),
    ({"lora_name": "x", "lora_path": "/x", "load_inplace": True}, "load_inplace", "unknown or unsupported field"),
    ({"lora_name": "x"}, "lora_path", "Field required"),
])
def test_a_bad_load_is_a_400_naming_the_field_and_changes_nothing(lora, body, param, message):
    client, _ = lora
    before = client.get("/v1/models").json()["data"]
    r = client.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param and message in error_of(r)["message"]
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [c["id"] for c in before]
    assert completion(client, "sql").status_code == 200


def test_an_adapter_over_max_lora_rank_is_refused_by_its_config_field(lora, folders):
    client, _ = lora
    r = load(client, "wide", folders["wide"])
    assert r.status_code == 400
    assert "r" in error_of(r)["param"] and "16" in error_of(r)["message"], error_of(r)
    assert "wide" not in [c["id"] for c in client.get("/v1/models").json()["data"]]


def test_loading_reads_the_folder_off_the_event_loop(lora, folders, monkeypatch):
    """While a load waits on its folder, the server keeps answering (same event loop)."""
    client, state = lora
    manager = state.engine.engine.lora
    release = threading.Event()
    real = manager.register

    def slow_register(*args, **kw):
        assert release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(manager, "register", slow_register)
    result = {}
    loader = threading.Thread(target=lambda: result.setdefault("r", load(client, "late", folders["late"])))
    loader.start()
    try:
        time.sleep(0.2)
        assert completion(client, "sql").status_code == 200  # served while the load is blocked
        assert "r" not in result
    finally:
        release.set()
        loader.join(60)
    assert result["r"].status_code == 200
    assert unload(client, "late").status_code == 200


def test_unloading_while_a_request_runs_lets_it_finish(lora, folders):
    client, _ = lora
    assert load(client, "late", folders["late"]).status_code == 200
    with client.stream("POST", "/v1/completions", json={
            "model": "late", "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert unload(client, "late").status_code == 200
        rest = [line for line in lines if line.startswith("data: ")]
    assert json.loads(first[6:])["model"] == "late" and rest[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in rest)
    assert completion(client, "late").status_code == 404


# ---------------------------------------------------------------- switched off

def test_runtime_updating_follows_vllms_environment_variable():
    assert all(runtime_lora_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": v}) for v in ("1", "true", " True "))
    assert not any(runtime_lora_updating({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": v}) for v in ("0", "false", "yes", ""))
    assert not runtime_lora_updating({})


def test_without_runtime_updating_the_routes_do_not_exist(lora, folders):
    _, state = lora
    closed = ServerState(state.engine, state.metrics, MODEL, enable_lora=True, allow_runtime_lora_updating=False)
    with TestClient(build_app(closed)) as client:
        assert load(client, "late", folders["late"]).status_code == 404
        assert unload(client, "sql").status_code == 404
        assert completion(client, "sql").status_code == 200  # --lora-modules adapters still serve
        paths = client.get("/openapi.json").json()["paths"]
        assert "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths
    with TestClient(build_app(state)) as client:
        paths = client.get("/openapi.json").json()["paths"]
        assert "/v1/load_lora_adapter" in paths and "/v1/unload_lora_adapter" in paths


def test_without_enable_lora_other_names_are_todays_404(folders):
    engine, state = _serve(_engine_args(folders["base"]), allow_runtime_lora_updating=True)
    try:
        with TestClient(build_app(state)) as client:
            r = completion(client, "sql")
            assert r.status_code == 404
            assert error_of(r)["message"] == f"The model `sql` does not exist; this server serves `{MODEL}`"
            assert [c["id"] for c in client.get("/v1/models").json()["data"]] == [MODEL]
            r = load(client, "late", folders["late"])
            assert r.status_code == 400 and "--enable-lora" in error_of(r)["message"]
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- kvpilot serve start-up

def test_a_bad_lora_module_stops_serve_naming_it(folders):
    cmd = [sys.executable, "-m", "kvpilot.cli", "serve", "--port", "0", "--model", str(folders["base"]),
           "--device", "cpu", "--kv-cache-memory", "0.05", "--max-model-len", "256", "--enable-lora",
           "--lora-modules", f"sql={folders['sql']}", "wide=" + str(folders["wide"])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvpilot serve: --lora-modules wide={folders['wide']}: "), last


def test_the_adapters_file_is_loaded_before_ready_and_followed(folders, tmp_path):
    """``kvpilot serve --lora-adapters-file`` (what the operator's pods run): the file's
    adapters are listed as soon as the server is ready, and a changed file loads and
    unloads adapters in the running server."""
    import json
    import time

    import httpx

    from tests.serverproc import ServerProcess

    adapters = tmp_path / "adapters.json"
    adapters.write_text(json.dumps([{"name": "sql", "uri": str(folders["sql"])},
                                    {"name": "chat", "uri": f"file://{folders['chat']}"}]))
    server = ServerProcess("--model", str(folders["base"]), "--served-model-name", MODEL, "--device", "cpu",
                           "--kv-cache-memory", "0.05", "--max-model-len", "256", "--enable-lora",
                           "--max-loras", "2", "--lora-adapters-file", str(adapters))

    def models() -> list[str]:
        return [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"]]

    try:
        server.wait_ready()
        assert models() == [MODEL, "sql", "chat"]  # loaded before ready
        adapters.write_text(json.dumps([{"name": "chat", "uri": f"file://{folders['chat']}"},
                                        {"name": "late", "uri": str(folders["late"])}]))
        deadline = time.monotonic() + 60
        while models() != [MODEL, "chat", "late"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert models() == [MODEL, "chat", "late"], server.logs()
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "late", "prompt": PROMPT, "max_tokens": 2,
                                                             "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "late", r.text
    finally:
        server.stop()
