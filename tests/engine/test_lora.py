"""LoRA adapters against PEFT: adapters made by the ``peft`` package on tiny random
checkpoints, served by the engine, scored against PEFT's merged model in transformers.

For each adapter, every prompt position's log-probability of the next prompt token
(``prompt_logprobs``) and of the top-5 alternatives must be within ``LOGPROB_TOLERANCE``
of ``log_softmax`` of the merged model's logits: alone, and in one batch with the base
model and the other adapters, through chunked prefill (a budget smaller than a prompt).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from kvpilot.engine.errors import (
    InvalidRequestError,
    LoRAAdapterExistsError,
    LoRAAdapterNotFoundError,
)
from kvpilot.engine.sampling_params import SamplingParams

from .test_model_families import make_engine, prompts, tiny_checkpoint

peft = pytest.importorskip("peft", reason="peft is a dev dependency (pyproject's dev extra)")

LOGPROB_TOLERANCE = 1e-3
PROMPT_LEN = 30

# name -> (r, alpha, targets, rslora)
ADAPTERS = {
    "qv-r4": (4, 8, ["q_proj", "v_proj"], False),
    "all-r8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp-r2-rs": (2, 4, ["gate_proj", "down_proj"], True),
    "ko-r16": (16, 8, ["k_proj", "o_proj", "up_proj"], True),
}


def make_adapter(hf, folder: Path, r: int, alpha: int, targets: list[str], rslora: bool, seed: int):
    """Save a PEFT adapter with random, non-zero A and B to ``folder``; return the merged
    transformers model (fp32, eval)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                          init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(hf), cfg)
    with torch.no_grad():  # large enough to move the distribution well past the tolerance
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2_moe"])
def family(request, tmp_path_factory):
    """(arch, checkpoint path, {adapter: (folder, merged model)}, base model)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    hf = tiny_checkpoint(arch, root / "base")
    adapters = {}
    for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        if arch == "qwen2_moe" and any(t in targets for t in ("gate_proj", "up_proj", "down_proj")):
            targets = [t for t in targets if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))] or ["q_proj"]
        folder = root / name
        adapters[name] = (folder, make_adapter(hf, folder, r, alpha, targets, rslora, seed=10 + i))
    return arch, root / "base", adapters, hf


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def run(engine, jobs: list[tuple[list[int], str | None]]) -> list:
    """Add every (prompt, adapter name) at once, step to the end; outputs in job order."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5, logprobs=5)
    for i, (ids, name) in enumerate(jobs):
        lora = engine.lora.get(name) if name is not None else None
        engine.add_request(f"r{i}", ids, params, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(jobs))]


def check(out, ids: list[int], ref: torch.Tensor, what: str) -> float:
    """Largest |difference| over the prompt positions (each next prompt token and the
    top 5) and the sampled position (its top 5)."""
    worst = 0.0
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) - 1
    for p, (chosen, _rank, top) in enumerate(out.prompt_logprobs):  # entry p scores token p + 1
        worst = max(worst, abs(chosen - ref[p, ids[p + 1]].item()))
        for tok, lp in top:
            worst = max(worst, abs(lp - ref[p, tok].item()))
    (last,) = out.new_logprobs or out_logprobs(out)
    for tok, lp in [(last.token_id, last.logprob), *last.top]:
        worst = max(worst, abs(lp - ref[len(ids) - 1, tok].item()))
    assert worst < LOGPROB_TOLERANCE, f"{what}: max |logprob difference| {worst:.2e}"
    return worst


def out_logprobs(out):
    raise AssertionError(f"{out.request_id}: no logprobs in its last output")


def register_all(engine, adapters):
    for name, (folder, _) in adapters.items():
        engine.lora.register(name, folder)


def test_each_adapter_alone_matches_peft(family):
    arch, base, adapters, hf = family
    engine = make_engine(base, enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=4)
    register_all(engine, adapters)
    (ids,) = prompts(1, PROMPT_LEN, seed=3)
    base_ref = reference(hf, ids)
    for name, (_, merged) in adapters.items():
        ref = reference(merged, ids)
        # the adapter moves the distribution much more than the tolerance
        assert (ref - base_ref).abs().max().item() > 50 * LOGPROB_TOLERANCE, name
        (out,) = run(engine, [(ids, name)])
        check(out, ids, ref, f"{arch}/{name}")
    (out,) = run(engine, [(ids, None)])
    check(out, ids, base_ref, f"{arch}/base")


def test_mixed_batch_with_chunked_prefill_matches_peft(family):
    """Base and four adapters (two requests each, interleaved) in one batch; an 8-token
    budget splits every prompt into chunks across steps."""
    arch, base, adapters, hf = family
    engine = make_engine(base, enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4,
                         max_num_batched_tokens=8, max_num_seqs=8)
    register_all(engine, adapters)
    names: list[str | None] = [None, *adapters]
    batch = prompts(2 * len(names), PROMPT_LEN, seed=4)
    jobs = [(ids, names[i % len(names)]) for i, ids in enumerate(batch)]
    outs = run(engine, jobs)
    for (ids, name), out in zip(jobs, outs):
        model = hf if name is None else adapters[name][1]
        check(out, ids, reference(model, ids), f"{arch}/{name or 'base'} in a mixed batch")


def test_the_adapter_is_refused_or_registered_by_name(family, tmp_path):
    _arch, base, adapters, _ = family
    engine = make_engine(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    folder = adapters["qv-r4"][0]
    engine.lora.register("a", folder)
    with pytest.raises(LoRAAdapterExistsError, match="'a' has already been loaded"):
        engine.lora.register("a", folder)
    with pytest.raises(InvalidRequestError, match="r is 16, above --max-lora-rank 8") as e:
        engine.lora.register("big", adapters["ko-r16"][0])
    assert e.value.param == "adapter_config.json: r"
    with pytest.raises(InvalidRequestError, match="is not a folder") as e:
        engine.lora.register("missing", tmp_path / "nope")
    assert e.value.param == "lora_path"
    assert [r.lora_name for r in engine.lora.list()] == ["a"]
    engine.lora.unregister("a")
    with pytest.raises(LoRAAdapterNotFoundError, match="'a' cannot be found"):
        engine.lora.unregister("a")


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("field,value,message", [
    ("use_dora", True, "use_dora is true"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("target_modules", ["embed_tokens"], "embedding or LM-head"),
    ("target_modules", ["fc9"], "'fc9' is not a projection"),
    ("r", 0, "r must be an integer >= 1"),
    ("lora_alpha", "x", "lora_alpha must be a number"),
    ("bias", "all", "bias is \"all\""),
])
def test_unsupported_config_values_are_refused_by_field(tmp_path, field, value, message):
    arch, base_dir = "llama", tmp_path / "base"
    hf = tiny_checkpoint(arch, base_dir)
    make_adapter(hf, tmp_path / "ok", 4, 8, ["q_proj"], False, seed=1)
    engine = make_engine(base_dir, enable_lora=True)
    bad = _edit_config(tmp_path / "ok", tmp_path / "bad", **{field: value})
    with pytest.raises(InvalidRequestError, match=message) as e:
        engine.lora.register("bad", bad)
    assert e.value.param.endswith(field) or e.value.param == "adapter_config.json: target_modules"
    assert engine.lora.list() == []


def test_an_adapter_for_another_base_is_refused_by_shape(tmp_path):
    hf = tiny_checkpoint("llama", tmp_path / "base")
    make_adapter(hf, tmp_path / "ok", 4, 8, ["q_proj"], False, seed=1)
    other = tiny_checkpoint("qwen3", tmp_path / "other")  # head_dim 32: q_proj is 128 wide
    make_adapter(other, tmp_path / "foreign", 4, 8, ["q_proj"], False, seed=1)
    engine = make_engine(tmp_path / "base", enable_lora=True)
    with pytest.raises(InvalidRequestError, match=r"lora_B has shape \(128, 4\), expected \(64, 4\)"):
        engine.lora.register("foreign", tmp_path / "foreign")
    engine.lora.register("ok", tmp_path / "ok")  # the failure left the engine serving adapters


def test_greedy_decode_batches_of_interleaved_adapters_match_peft(family):
    """Ten requests, the base and four adapters interleaved, decoding 8 tokens together:
    every decode step holds each adapter's rows apart from each other (the gather path of
    the CPU products); greedy continuations equal the merged models' ``generate``."""
    arch, base, adapters, hf = family
    engine = make_engine(base, enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4)
    register_all(engine, adapters)
    names: list[str | None] = [None, *adapters]
    batch = prompts(2 * len(names), 12, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(batch):
        name = names[i % len(names)]
        engine.add_request(f"g{i}", ids, params, lora_request=engine.lora.get(name) if name else None)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.output_token_ids
    for i, ids in enumerate(batch):
        name = names[i % len(names)]
        model = hf if name is None else adapters[name][1]
        model.generation_config.eos_token_id = None
        t = torch.tensor([ids])
        want = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=8, do_sample=False)
        assert got[f"g{i}"] == want[0, len(ids):].tolist(), f"{arch}/{name or 'base'} request {i}"


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("family", ["llama"], indirect=True)  # one family: the kernels are per projection
def test_the_cuda_path_kernels_serve_adapters_like_peft(family, monkeypatch):
    """The projections through the Triton SGMV kernels (the CUDA path, under the
    interpreter): a mixed batch still matches PEFT."""
    from kvpilot.engine.lora import layers, ops

    monkeypatch.setattr(layers, "add_lora", lambda y, x, a, b, m, widths, widths_t: ops.add_lora_triton(
        y, x, a, b, m, widths_t))
    _arch, base, adapters, hf = family
    engine = make_engine(base, enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4)
    register_all(engine, adapters)
    names: list[str | None] = [None, *adapters]
    batch = prompts(len(names), 12, seed=6)
    jobs = [(ids, names[i]) for i, ids in enumerate(batch)]
    for (ids, name), out in zip(jobs, run(engine, jobs)):
        check(out, ids, reference(hf if name is None else adapters[name][1], ids), f"triton/{name or 'base'}")


def test_more_adapters_than_slots_swap_and_stay_exact(family):
    """Four adapters and the base through two slots: the scheduler holds at most two
    adapters in a step, the slots are refilled as requests finish, and every request
    still matches PEFT."""
    arch, base, adapters, hf = family
    engine = make_engine(base, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=4)
    register_all(engine, adapters)
    names: list[str | None] = [None, *adapters]
    batch = prompts(3 * len(names), 16, seed=7)
    jobs = [(ids, names[i % len(names)]) for i, ids in enumerate(batch)]
    outs = run(engine, jobs)
    assert engine.lora.slot_loads > 2  # slots were refilled
    for (ids, name), out in zip(jobs, outs):
        check(out, ids, reference(hf if name is None else adapters[name][1], ids), f"{arch}/{name} swapped")


def test_preemption_and_prefix_hits_keep_adapters_apart(family):
    """A pool too small for the batch (preemption) and the same prompts sent again
    (prefix hits): each adapter's prompt hits only its own blocks, and every answer
    still matches PEFT."""
    arch, base, adapters, hf = family
    engine = make_engine(base, enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4,
                         num_gpu_blocks_override=40, max_model_len=64, max_num_seqs=8)
    register_all(engine, adapters)
    names: list[str | None] = [None, *adapters]
    (shared,) = prompts(1, 24, seed=8)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    preempted = 0
    for round_ in range(2):
        for i, name in enumerate(names):
            engine.add_request(f"p{round_}-{i}", shared, params,
                               lora_request=engine.lora.get(name) if name else None)
        got = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out
            preempted = engine.scheduler.num_preemptions_total
        for i, name in enumerate(names):
            out = got[f"p{round_}-{i}"]
            model = hf if name is None else adapters[name][1]
            model.generation_config.eos_token_id = None
            t = torch.tensor([shared])
            want = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=12, do_sample=False)
            assert out.output_token_ids == want[0, len(shared):].tolist(), f"{arch}/{name} round {round_}"
            if round_ == 0:
                # the first of all five to run computes its prompt; the others share it only
                # within their own adapter, so none of them hits in round 0
                assert out.num_cached_tokens == 0, f"{name} hit another adapter's blocks"
            else:
                assert out.num_cached_tokens > 0, f"{name} missed its own cached prompt"
    assert preempted > 0, "the pool was meant to be too small for the batch"


def greedy(engine, ids: list[int], name: str | None, n: int = 8):
    """One greedy request (no prompt logprobs, so the prefix cache may serve it)."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine.add_request(f"g-{name}-{len(engine.lora.list())}-{id(params)}", ids, params,
                       lora_request=engine.lora.get(name) if name else None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("the request did not finish")


def hf_greedy(model, ids: list[int], n: int = 8) -> list[int]:
    model.generation_config.eos_token_id = None
    t = torch.tensor([ids])
    return model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()


def test_reloading_a_name_with_other_weights_never_reads_the_old_kv(tmp_path):
    hf = tiny_checkpoint("llama", tmp_path / "base")
    first = make_adapter(hf, tmp_path / "v1", 4, 8, ["q_proj", "v_proj"], False, seed=1)
    second = make_adapter(hf, tmp_path / "v2", 4, 8, ["q_proj", "v_proj"], False, seed=2)
    assert hf_greedy(first, prompts(1, PROMPT_LEN, seed=9)[0]) != hf_greedy(second, prompts(1, PROMPT_LEN, seed=9)[0])
    engine = make_engine(tmp_path / "base", enable_lora=True)
    (ids,) = prompts(1, PROMPT_LEN, seed=9)
    engine.lora.register("team", tmp_path / "v1")
    out = greedy(engine, ids, "team")
    assert out.output_token_ids == hf_greedy(first, ids) and out.num_cached_tokens == 0
    assert greedy(engine, ids, "team").num_cached_tokens > 0  # its own blocks: a hit
    engine.lora.unregister("team")
    engine.lora.register("team", tmp_path / "v2")
    out = greedy(engine, ids, "team")
    assert out.num_cached_tokens == 0, "the new weights read the old weights' KV"
    assert out.output_token_ids == hf_greedy(second, ids)
    engine.lora.unregister("team")
    engine.lora.register("team", tmp_path / "v1")  # the same files again: the same key, a hit
    out = greedy(engine, ids, "team")
    assert out.num_cached_tokens > 0 and out.output_token_ids == hf_greedy(first, ids)


def test_targets_select_the_tensors_applied_as_peft_does(tmp_path):
    """target_modules decides which tensors apply: a list by module name, a string as a
    regular expression over the whole module name (PEFT's rule); weights of a module the
    config does not select are refused by name, never applied."""
    hf = tiny_checkpoint("llama", tmp_path / "base")
    make_adapter(hf, tmp_path / "qv", 4, 8, ["q_proj", "v_proj"], False, seed=1)
    engine = make_engine(tmp_path / "base", enable_lora=True)
    for targets, ok in (("q_proj", False), (".*q_proj", False), (r".*\.(q|v)_proj", True), (["q_proj"], False)):
        folder = _edit_config(tmp_path / "qv", tmp_path / f"t{len(engine.lora.list())}-{ok}-{hash(str(targets))}",
                              target_modules=targets)
        if ok:
            engine.lora.register(f"ok-{folder.name}", folder)
        else:
            with pytest.raises(InvalidRequestError, match=r"target_modules .* does not select it"):
                engine.lora.register("bad", folder)


def test_a_folder_gone_after_loading_is_a_server_error_naming_the_adapter(tmp_path):
    import shutil

    from kvpilot.engine.errors import RequestFailedError

    hf = tiny_checkpoint("llama", tmp_path / "base")
    make_adapter(hf, tmp_path / "a", 4, 8, ["q_proj"], False, seed=1)
    make_adapter(hf, tmp_path / "b", 4, 8, ["q_proj"], False, seed=2)
    engine = make_engine(tmp_path / "base", enable_lora=True, max_cpu_loras=1)
    a = engine.lora.register("a", tmp_path / "a")
    engine.lora.register("b", tmp_path / "b")  # the one host copy is b's now
    shutil.rmtree(tmp_path / "a")
    with pytest.raises(RequestFailedError, match="adapter 'a' can no longer be read"):
        engine.lora.acquire(a)


@pytest.mark.parametrize("name", ["x" * 257, "a\\nb", " padded ", "nul\\x00"])
def test_adapter_names_are_bounded_and_printable(tmp_path, name):
    hf = tiny_checkpoint("llama", tmp_path / "base")
    make_adapter(hf, tmp_path / "a", 4, 8, ["q_proj"], False, seed=1)
    engine = make_engine(tmp_path / "base", enable_lora=True)
    name = name.encode().decode("unicode_escape")
    with pytest.raises(InvalidRequestError, match="printable characters") as e:
        engine.lora.register(name, tmp_path / "a")
    assert e.value.param == "lora_name"
    engine.lora.register("org/adapter-ü", tmp_path / "a")  # slashes and unicode are fine


def test_slot_stacks_larger_than_the_machine_are_refused_before_allocating(tmp_path):
    tiny_checkpoint("llama", tmp_path / "base")
    from kvpilot.engine.lora import manager

    with pytest.raises(ValueError, match="lower --max-loras or --max-lora-rank"):
        manager.check_slot_memory(10**15, manager.LoRAConfig(64, 512, 64), torch.device("cpu"))
    engine = make_engine(tmp_path / "base", enable_lora=True, max_loras=2)
    assert engine.lora.nbytes == manager.slot_bytes(engine.runner.model, engine.model_config,
                                                    engine.lora.config, torch.float32)
