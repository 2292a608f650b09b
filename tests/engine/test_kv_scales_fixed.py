"""Quantized KV caches answer the same request the same way every time: their scales are
fixed before serving (checkpoint, else a start-up pass over a built-in text, else 1.0), so
an answer depends neither on the traffic that came first nor on a prefix-cache hit."""

from __future__ import annotations

import logging

import pytest

from kvpilot.engine.kv_scales import CALIBRATION_MESSAGES, calibration_token_ids
from kvpilot.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUANTIZED = ["fp8", "fp8_e5m2", "int4", "fp4_e2m1"]
QUESTION = [{"role": "user", "content": "List three things a lighthouse keeper does every night, in one short sentence each."}]
OTHERS = [
    "Write a haiku about Kubernetes pods restarting.",
    "What is 17 times 23? Show the steps.",
    "Translate 'the cache is warm' into French and German.",
]
MAX_TOKENS = 24


def run(engine, batch):
    """Add ``batch`` ({request id: token ids}) at once, step to the end; id -> output."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for rid, ids in batch.items():
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def prompts(tokenizer):
    def chat(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    return chat(QUESTION), [chat([{"role": "user", "content": t}]) for t in OTHERS]


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_same_greedy_request_same_bytes_cold_warm_and_after_other_traffic(dtype, make_engine, prompts):
    """Five runs of one greedy request: cold, warm (prefix hit), after other users'
    traffic went through the engine, warm again, and cold on a new engine that served
    other traffic first. Byte-identical text and token ids; the scales never move."""
    question, others = prompts
    engine = make_engine(kv_cache_dtype=dtype, kv_cache_memory=0.05)
    cache = engine.runner.kv_cache
    assert not cache.needs_calibration and not cache.calibrating
    scales = [(float(x.k_scale), float(x.v_scale)) for x in cache.layers]
    texts, hits = [], []

    def ask(rid):
        before = engine.scheduler.prefix_stats.hits
        out = run(engine, {rid: question})[rid]
        texts.append((out.output_text, tuple(out.output_token_ids)))
        hits.append(engine.scheduler.prefix_stats.hits - before)

    ask("cold")                                                   # 1: nothing cached
    ask("warm")                                                   # 2: the prompt's blocks hit
    run(engine, {f"x{i}": ids for i, ids in enumerate(others)})   # other users, batched
    ask("after-traffic")                                          # 3
    ask("warm-again")                                             # 4
    fresh = make_engine(kv_cache_dtype=dtype, kv_cache_memory=0.05)
    engine = fresh
    run(engine, {f"y{i}": ids for i, ids in enumerate(reversed(others))})
    ask("fresh-after-traffic")                                    # 5: a new engine; only the
    # chat template's opening, which other users' prompts share, is cached there
    assert hits[0] == 0 and all(h > 0 for h in hits[1:4]) and hits[4] < hits[1], hits
    assert len(texts[0][1]) > 4
    assert all(t == texts[0] for t in texts), [t[0] for t in texts]
    # The scales did not move with the traffic and are the same in a new engine.
    assert [(float(x.k_scale), float(x.v_scale)) for x in fresh.runner.kv_cache.layers] == scales
    assert [(float(x.k_scale), float(x.v_scale)) for x in cache.layers] == scales


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_request_gives_the_same_bytes_alone_and_mixed_with_other_traffic(dtype, make_engine, prompts):
    """Batch invariance: the request alone on a fresh engine, batched with other users'
    requests on an engine that served other traffic first (its prompts then hit prefixes
    that another batch computed), and the same batch on a fresh engine: byte-identical
    answers. It holds because every per-token op of the CPU path is row-local and the
    matrix products, probed at load (``probe_batch_invariance``), give a row the same bits
    whatever the row count of the step. Where the probe finds they do not (MKL's sgemm,
    which the engine uses when oneDNN cannot pack the weights), the engine logs it and
    this test has nothing to check (docs/engine.md, Determinism)."""
    question, others = prompts
    alone_engine = make_engine(kv_cache_dtype=dtype, kv_cache_memory=0.05)
    if not alone_engine.runner.model.batch_invariant:
        pytest.skip("the matrix products are not batch invariant on this machine (see the load log)")
    alone = run(alone_engine, {"q": question})["q"]
    batch = {"q": question} | {f"o{i}": ids for i, ids in enumerate(others)}
    used = make_engine(kv_cache_dtype=dtype, kv_cache_memory=0.05)
    run(used, {f"w{i}": ids + ids for i, ids in enumerate(others)})  # earlier traffic
    before = used.scheduler.prefix_stats.hits
    first = {k: (o.output_text, tuple(o.output_token_ids)) for k, o in run(used, batch).items()}
    assert used.scheduler.prefix_stats.hits > before  # the batch did hit the earlier prefixes
    fresh = make_engine(kv_cache_dtype=dtype, kv_cache_memory=0.05)
    second = {k: (o.output_text, tuple(o.output_token_ids)) for k, o in run(fresh, batch).items()}
    assert first == second
    assert first["q"] == (alone.output_text, tuple(alone.output_token_ids))


def test_a_mixed_batch_gives_the_same_bytes_on_engines_in_the_same_state(make_engine, prompts):
    """What holds even where the products are not batch invariant: the same mixed batch
    on two engines whose caches hold the same prefixes (computed by the same earlier
    batch) gives the same bytes; the scales and kernels add no other source of variation."""
    question, others = prompts
    batch = {"q": question} | {f"o{i}": ids for i, ids in enumerate(others)}
    earlier = {f"w{i}": ids + ids for i, ids in enumerate(others)}
    texts = []
    for _ in range(2):
        engine = make_engine(kv_cache_dtype="fp8", kv_cache_memory=0.05)
        run(engine, earlier)
        before = engine.scheduler.prefix_stats.hits
        texts.append({k: o.output_text for k, o in run(engine, batch).items()})
        assert engine.scheduler.prefix_stats.hits > before  # the batch did hit the prefixes
    assert texts[0] == texts[1]


def test_startup_pass_fixes_every_layer_from_the_builtin_text(make_engine, tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="kvpilot.engine"):
        engine = make_engine(kv_cache_dtype="fp8", kv_cache_memory=0.05)
    cache = engine.runner.kv_cache
    n = len(calibration_token_ids(tokenizer, 10_000))
    assert n > 300, "the built-in text should give a few hundred tokens"
    assert any(f"start-up pass over {n} calibration tokens" in r.getMessage() for r in caplog.records)
    assert all(0 < float(x.k_scale) < 1 and 0 < float(x.v_scale) < 1 for x in cache.layers)
    assert float(cache.storage.float().abs().sum()) == 0.0  # the pass left nothing in the cache
    assert "system" in {m["role"] for m in CALIBRATION_MESSAGES}


def test_no_rescale_ever_happens_while_serving(make_engine, prompts, caplog):
    """A long, varied batch after start-up: no 'grew' log line, scales unchanged."""
    question, others = prompts
    engine = make_engine(kv_cache_dtype="fp4_e2m1", kv_cache_memory=0.05)
    before = [float(x.k_scale) for x in engine.runner.kv_cache.layers]
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.kv_cache"):
        run(engine, {"q": question * 3} | {f"o{i}": ids for i, ids in enumerate(others)})
    assert not [r for r in caplog.records if "grew" in r.getMessage()]
    assert [float(x.k_scale) for x in engine.runner.kv_cache.layers] == before


def test_calculate_kv_scales_learns_from_the_first_batch_instead(make_engine, tokenizer):
    """The opt-in live mode: nothing is fixed at start-up; the first request sets them."""
    engine = make_engine(kv_cache_dtype="fp8", kv_cache_memory=0.05, calculate_kv_scales=True)
    cache = engine.runner.kv_cache
    assert cache.needs_calibration and cache.calibrating
    out = run(engine, {"p": tokenizer.encode("The capital of France is")})["p"]
    assert out.output_text.startswith(" Paris")
    assert not cache.needs_calibration


def test_without_a_tokenizer_the_scales_are_one_with_a_warning(tmp_path, caplog):
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    from .test_fp8_kv_cache import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path, {})
    with caplog.at_level(logging.WARNING, logger="kvpilot.engine.kv_cache"):
        engine = LLMEngine(EngineArgs(model=str(tmp_path), kv_cache_dtype="fp8_e5m2", device="cpu",
                                      skip_tokenizer_init=True, kv_cache_memory=0.01, max_num_seqs=4))
    cache = engine.runner.kv_cache
    assert [float(x.k_scale) for x in cache.layers] == [1.0, 1.0]
    assert not cache.needs_calibration and not cache.calibrating
    assert any("k_scale = v_scale = 1.0" in r.getMessage() for r in caplog.records)
    out = run(engine, {"t": [5, 6, 7]})["t"]
    assert len(out.output_token_ids) > 0
