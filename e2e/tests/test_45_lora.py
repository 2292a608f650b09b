"""Many LoRA adapters on one fleet, on a real node: ``spec.adapters`` through the operator,
the engine pod and the router.

Three rank-1 q/v adapters of SmolLM2 (random, strong enough to change the greedy answer)
live in one ConfigMap (binaryData, about 120 KiB each in bf16: a ConfigMap holds 1 MiB) that the fleet mounts
read-only at ``/adapters`` through ``spec.volumes``; ``spec.adapters`` names them with
``file:///adapters/<name>``. The expected answers come from the engine on the test host
with the same files.

- two adapters in the spec: requests by adapter name through the router's Service get
  each adapter's answer (and the base model its own); ``status.adaptersReady`` is 2/2;
- a third added to the spec is served by the same pod (no restart, no rollout);
- one removed from the spec is a 404 through the router.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from e2e.tests import helpers as h
from e2e.tests.conftest import delete_namespace

NS = "lora"
NAME = "tuned"
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
TOKENS = 6
ADAPTERS = ("alpha", "beta", "gamma")


def make_adapters(root: Path, cfg) -> dict[str, Path]:
    """Rank-1 q_proj/v_proj PEFT folders for the base of ``cfg`` (its ModelConfig), bf16
    safetensors, seeded."""
    import torch
    from safetensors.torch import save_file

    folders = {}
    for i, name in enumerate(ADAPTERS):
        gen = torch.Generator().manual_seed(100 + i)
        tensors = {}
        for layer in range(cfg.num_layers):
            for proj, out in (("q_proj", cfg.q_size), ("v_proj", cfg.kv_size)):
                base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                tensors[f"{base}.lora_A.weight"] = (torch.randn(1, cfg.hidden_size, generator=gen)
                                                    / cfg.hidden_size ** 0.5).to(torch.bfloat16)
                tensors[f"{base}.lora_B.weight"] = (torch.randn(out, 1, generator=gen) * 0.8).to(torch.bfloat16)
        folder = root / name
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["q_proj", "v_proj"],
            "bias": "none", "task_type": "CAUSAL_LM"}))
        folders[name] = folder
    return folders


def adapters_and_answers(root: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """The adapter folders, and the greedy answers to PROMPT of the base and of each
    adapter from the engine on this host (the same weights and files as the pod)."""
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.model.loader import embedded_model_path
    from kvpilot.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=str(embedded_model_path()), device="cpu", dtype="float32",
                                  kv_cache_memory=0.05, max_model_len=256, enable_lora=True,
                                  max_loras=3, max_cpu_loras=3))
    try:
        folders = make_adapters(root, engine.model_config)
        for name, folder in folders.items():
            engine.lora.register(name, folder)
        ids = engine.tokenizer.encode(PROMPT)
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        for name in (None, *folders):
            engine.add_request(name or "base", ids, params,
                               lora_request=engine.lora.get(name) if name else None)
        out: dict[str, str] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.output_text
        return folders, out
    finally:
        engine.close()


def post(address: tuple[str, int], model: str) -> tuple[int, dict]:
    ip, port = address
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{ip}:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"text": text}


def manifest(names: tuple[str, ...]) -> dict:
    doc = h.small_infd(NAME, autoscaling=None, replicas=1)
    spec = doc["spec"]
    spec["adapters"] = [{"name": n, "uri": f"file:///adapters/{n}"} for n in names]
    spec["engine"]["lora"] = {"maxLoras": 2, "maxLoraRank": 8, "maxCpuLoras": 3}
    items = [{"key": f"{n}-{part}", "path": f"{n}/{fname}"} for n in ADAPTERS
             for part, fname in (("config", "adapter_config.json"), ("weights", "adapter_model.safetensors"))]
    spec["volumes"] = [{"name": "test-adapters", "configMap": {"name": "test-adapters", "items": items}}]
    spec["volumeMounts"] = [{"name": "test-adapters", "mountPath": "/adapters", "readOnly": True}]
    return doc


@pytest.fixture(scope="module")
def fleet(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    folders, want = adapters_and_answers(root)
    distinct = set(want.values())
    assert len(distinct) == len(want), f"the adapters must change the answer: {want}"
    cluster.kubectl("create", "namespace", NS)
    args = [f"--from-file={n}-{part}={folders[n] / fname}" for n in ADAPTERS
            for part, fname in (("config", "adapter_config.json"), ("weights", "adapter_model.safetensors"))]
    cluster.kubectl("create", "configmap", "test-adapters", "-n", NS, *args)
    h.apply(cluster, NS, manifest(ADAPTERS[:2]))
    h.wait_ready(cluster, NS, NAME, replicas=1, timeout=420)
    cluster.wait_for(lambda: h.condition_is(cluster, NS, NAME, "RouterReady", "True"), 180, "RouterReady")
    yield want
    delete_namespace(cluster, NS)


def adapters_ready(cluster, value: str):
    obj = h.infd(cluster, NS, NAME)
    return obj if obj.get("status", {}).get("adaptersReady") == value else None


def answer(address, model: str) -> str | None:
    status, body = post(address, model)
    if status != 200:
        return None
    assert body["model"] == model, body
    return body["choices"][0]["text"]


def test_each_adapter_answers_through_the_router(cluster, fleet):
    want = fleet
    cluster.wait_for(lambda: adapters_ready(cluster, "2/2"), 120, "status.adaptersReady 2/2")
    address = h.wait_service(cluster, NS, f"{NAME}-router")
    assert answer(address, MODEL) == want["base"]
    for name in ADAPTERS[:2]:
        assert answer(address, name) == want[name], name
    status, body = post(address, "gamma")  # not in the spec yet
    assert status == 404, (status, body)


def test_adding_and_removing_adapters_needs_no_restart(cluster, fleet):
    want = fleet
    (pod,) = h.ready_pods(cluster, NS, NAME)
    h.apply(cluster, NS, manifest(("beta", "gamma")))
    address = h.wait_service(cluster, NS, f"{NAME}-router")
    cluster.wait_for(lambda: answer(address, "gamma"), 120, "gamma served through the router")
    assert answer(address, "gamma") == want["gamma"]
    assert answer(address, "beta") == want["beta"]
    cluster.wait_for(lambda: post(address, "alpha")[0] == 404, 120, "alpha removed: a 404")
    status, body = post(address, "alpha")
    assert status == 404, (status, body)
    assert "alpha" in json.dumps(body), body
    cluster.wait_for(lambda: adapters_ready(cluster, "2/2"), 120, "status.adaptersReady 2/2 again")
    (after,) = h.ready_pods(cluster, NS, NAME)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"], "the pod was replaced"
    restarts = [s["restartCount"] for s in after["status"]["containerStatuses"]]
    assert restarts == [0] * len(restarts), restarts
    names = [a["name"] for a in h.infd(cluster, NS, NAME)["status"]["adapters"]]
    assert sorted(names) == ["beta", "gamma"], names
