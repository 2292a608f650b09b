"""Freeing KV blocks behind an all-layer sliding window (Mistral-style models).

A fake model checks what attention would read: every step writes each computed token's
"KV" (its position and the hash of the prefix it ends, salted) through the slot mapping
into a simulated block memory, then reads, for every query ``p`` of the step, the keys
``p - W < j <= p`` through the block table and compares them with what they must be.
So a freed block, a null entry or a wrong prefix hit inside a window fails the test,
not just the accounting.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.engine.core.block_pool import CacheIntegrityError
from kvpilot.engine.core.kv_cache_manager import NULL_BLOCK, KVCacheManager, cdiv
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.scheduler import Scheduler, SchedulerConfig

from .helpers import fake_token, make_request


def make_sched(num_blocks: int, block_size: int, window: int | None, budget: int = 16, max_num_seqs: int = 4,
               max_model_len: int | None = None, prefix_caching: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len or num_blocks * block_size)
    kv = KVCacheManager(num_blocks, block_size, prefix_caching, sliding_window=window)
    return Scheduler(cfg, kv, clock=lambda: 0.0)


def kv_value(req: Request, pos: int) -> tuple:
    """What the KV at ``pos`` of ``req`` must be: it depends on the whole prefix."""
    return (req.cache_salt, pos, hash(tuple(req.token_ids[: pos + 1])))


class FakeKVModel:
    """Simulated paged KV memory ``[num_blocks * block_size]`` read through block tables."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        kv = sched.kv
        self.bs = kv.block_size
        self.window = kv.sliding_window
        self.memory: list[tuple | None] = [None] * (kv.num_blocks * kv.block_size)

    def step(self) -> None:
        s = self.sched
        out = s.schedule()
        assert out.num_batched_tokens <= s.config.max_num_batched_tokens
        for it in out.scheduled:
            req = it.request
            for i, slot in enumerate(it.slot_mapping):
                if slot >= 0:
                    self.memory[slot] = kv_value(req, it.start_position + i)
            w = self.window if self.window is not None else 1 << 30
            for p in range(it.start_position, it.start_position + it.num_tokens):
                for j in range(max(0, p - w + 1), p + 1):
                    block = it.block_ids[j // self.bs]
                    assert j // self.bs >= req.num_skipped_blocks, (req, p, j)
                    got = self.memory[block * self.bs + j % self.bs]
                    assert got == kv_value(req, j), (req, p, j, block)
        tokens = [fake_token(it.request) if it.sample else None for it in out.scheduled]
        s.update(out, tokens)
        s.check_integrity()
        for req in s.running:
            check_request_blocks(s.kv, req)

    def run(self, max_steps: int = 5000) -> None:
        steps = 0
        while self.sched.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < max_steps


def check_request_blocks(kv: KVCacheManager, req: Request) -> None:
    """Null entries lead the table and lie behind the window; freeing is as eager as the
    design allows; a decoding request holds a bounded number of blocks."""
    bs, w = kv.block_size, kv.sliding_window
    skipped = req.num_skipped_blocks
    assert req.block_ids[:skipped] == [NULL_BLOCK] * skipped
    if w is None:
        assert skipped == 0
        return
    s = req.num_computed_tokens
    assert skipped * bs <= max(0, s - w + 1)  # only blocks wholly behind the window
    k = kv.num_skippable_blocks(req)
    if req.num_published_blocks == 0 or skipped > 0:
        assert skipped == k  # everything behind the window is gone
    else:
        assert k < req.num_published_blocks  # held back only while published blocks are in reach
    if not req.is_prefilling:
        extra = req.num_published_blocks if skipped == 0 else 0
        assert kv.num_held_blocks(req) <= cdiv(w, bs) + 1 + extra


# ----------------------------------------------------------------- unit tests
def test_skippable_blocks_match_the_attention_mask():
    for bs in (1, 2, 4, 16):
        for w in (1, 2, 3, 5, 8, 16, 33):
            kv = KVCacheManager(64, bs, sliding_window=w)
            for s in range(0, 80):
                req = make_request("r", list(range(s + 1)))
                req.block_ids = list(range(cdiv(s + 1, bs)))
                req.num_computed_tokens = s
                # block i is read by the query at s (and later ones) iff it holds some j > s - w
                expected = sum(1 for i in range(len(req.block_ids)) if (i + 1) * bs - 1 <= s - w)
                assert kv.num_skippable_blocks(req) == expected, (bs, w, s)


def test_no_window_frees_nothing():
    s = make_sched(40, 4, None, prefix_caching=False)
    req = make_request("a", [5, 6, 7], max_tokens=60, ignore_eos=True)
    s.add_request(req)
    model = FakeKVModel(s)
    for _ in range(30):
        model.step()
    assert req.num_skipped_blocks == 0
    assert s.kv.num_held_blocks(req) == len(req.block_ids) == cdiv(req.num_tokens - 1, 4)


def test_decode_past_the_window_holds_bounded_blocks_and_releases_once():
    w, bs = 8, 4
    s = make_sched(40, bs, w, prefix_caching=False)
    req = make_request("a", [5, 6, 7], max_tokens=4 * w * 4, ignore_eos=True)
    s.add_request(req)
    model = FakeKVModel(s)
    held = []
    while req.status != RequestStatus.FINISHED_LENGTH:
        model.step()
        held.append(s.kv.num_held_blocks(req) if req.block_ids else 0)
        if req.block_ids:
            assert s.kv.pool.num_used == s.kv.num_held_blocks(req)
            assert s.kv.usage == s.kv.pool.num_used / s.kv.num_blocks
    assert max(held[2 * w:-1]) <= cdiv(w, bs) + 1
    assert req.block_ids == [] and s.kv.pool.num_used == 0 and s.kv.pool.num_free == 40
    s.check_integrity()


def test_long_prompt_chunked_prefill_frees_as_chunks_pass():
    w, bs = 6, 2
    s = make_sched(60, bs, w, budget=8, prefix_caching=False)
    req = make_request("a", list(range(3, 43)), max_tokens=10, ignore_eos=True)  # 40 tokens, 5 chunks
    s.add_request(req)
    model = FakeKVModel(s)
    model.step()
    assert req.num_computed_tokens == 8 and req.num_skipped_blocks == (8 - w + 1) // bs
    model.step()
    assert req.num_skipped_blocks == (16 - w + 1) // bs
    model.run()
    assert s.kv.pool.num_used == 0


def test_published_prompt_is_freed_as_a_unit_then_hit_by_the_next_request():
    w, bs = 8, 4
    s = make_sched(40, bs, w)
    prompt = list(range(10, 22))  # 3 full blocks
    a = make_request("a", prompt, max_tokens=30, ignore_eos=True)
    s.add_request(a)
    model = FakeKVModel(s)
    model.step()
    assert a.num_published_blocks == 3 and a.num_skipped_blocks == 0
    while a.num_computed_tokens < 3 * bs + w - 1:  # the window still reaches the prompt
        assert a.num_skipped_blocks == 0
        model.step()
    assert a.num_skipped_blocks == 3  # all three at once
    assert s.kv.num_cached_blocks == 3  # they stay in the tree, evictable
    assert s.kv.num_publishable_blocks(a) == 0
    b = make_request("b", [*prompt, 99], max_tokens=3, ignore_eos=True)
    s.add_request(b)
    model.run()  # the fake model checks that b reads a's cached KV correctly
    assert b.num_cached_tokens == 12
    assert s.kv.pool.num_used == 0 and s.kv.num_cached_blocks == 3


def test_generated_blocks_are_not_published_with_a_window():
    s = make_sched(40, 4, 8)
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=20, ignore_eos=True)
    s.add_request(a)
    model = FakeKVModel(s)
    model.run()
    assert s.kv.radix is not None and s.kv.radix.num_nodes == 1  # only the prompt's one full block


def test_preempting_a_request_with_freed_blocks_releases_each_block_once():
    w, bs = 4, 2
    s = make_sched(30, bs, w, max_model_len=40)
    a = make_request("a", [3, 4, 5, 6, 7], max_tokens=30, ignore_eos=True)
    s.add_request(a)
    model = FakeKVModel(s)
    for _ in range(15):
        model.step()
    assert a.num_skipped_blocks > 0
    s._preempt(a)
    s.check_integrity()
    assert s.kv.pool.num_used == 0 and a.block_ids == [] and a.num_skipped_blocks == 0
    model.run()  # recomputed from the prompt (a prefix hit) and finished
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.num_used == 0
    assert s.kv.pool.num_free + s.kv.num_cached_blocks == 30


def test_eviction_reclaims_blocks_freed_behind_the_window():
    w, bs = 4, 2
    s = make_sched(12, bs, w, max_model_len=24, max_num_seqs=1)
    model = FakeKVModel(s)
    for i in range(6):  # distinct prompts: each leaves cached blocks that must be evicted later
        s.add_request(make_request(f"r{i}", [10 * i + j for j in range(1, 7)], max_tokens=12, ignore_eos=True))
    model.run()
    assert s.kv.pool.num_used == 0
    assert s.kv.pool.num_free + s.kv.num_cached_blocks == 12


def test_check_integrity_rejects_a_null_entry_that_is_not_leading():
    s = make_sched(10, 2, 4, prefix_caching=False)
    a = make_request("a", [3, 4, 5, 6, 7], max_tokens=3)
    s.add_request(a)
    FakeKVModel(s).step()
    a.num_skipped_blocks = 1  # block 0 of the table is not the null block
    a.block_ids[0] = 7 if a.block_ids[0] != 7 else 8
    with pytest.raises(CacheIntegrityError, match="skipped blocks"):
        s.check_integrity()


# ------------------------------------------------------------- property test
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(3, 5), min_size=1, max_size=14),  # tiny vocab: shared prefixes
            st.integers(1, 30),
            st.sampled_from([None, "s1"]),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("preempt")),
    ),
    max_size=70,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    window=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(10, 40),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 4),
    prefix_caching=st.booleans(),
)
def test_random_workloads_with_a_window_read_correct_kv_and_keep_the_pool_consistent(
        ops, window, block_size, num_blocks, budget, max_num_seqs, prefix_caching):
    max_model_len = min(num_blocks * block_size, 44)
    s = make_sched(num_blocks, block_size, window, budget, max_num_seqs, max_model_len, prefix_caching)
    model = FakeKVModel(s)
    added: list[Request] = []
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, salt = op
            if len(prompt) + max_tokens > max_model_len:
                continue
            req = make_request(f"r{len(added)}", prompt, max_tokens=max_tokens, salt=salt, ignore_eos=True)
            s.add_request(req)
            added.append(req)
        elif op[0] == "step":
            model.step()
        elif op[0] == "preempt":
            if s.running:
                s._preempt(s.running[-1])
                s.check_integrity()
        elif added:
            victim = added[op[1] % len(added)]
            s.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
            s.check_integrity()
    model.run()
    kv = s.kv
    assert kv.pool.num_used == 0
    assert kv.pool.num_free + kv.num_cached_blocks == kv.num_blocks
    for req in added:
        assert req.is_finished and req.block_ids == [] and req.num_skipped_blocks == 0
        if req.status == RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == req.sampling_params.max_tokens


# -------------------------------------------------------- through the engine
def _tiny_checkpoint(arch: str, path, window: int):
    """A random 2- or 4-layer checkpoint saved by transformers; returns the HF model."""
    import torch
    import transformers as t

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "mistral":  # every layer slides
        cfg, cls = t.MistralConfig(**common, rope_theta=10000.0, sliding_window=window), t.MistralForCausalLM
    else:  # gemma2: sliding and full layers alternate
        cfg, cls = (t.Gemma2Config(**{**common, "num_hidden_layers": 4, "tie_word_embeddings": True},
                                   head_dim=16, sliding_window=window, query_pre_attn_scalar=16),
                    t.Gemma2ForCausalLM)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # well-separated logits: greedy choices do not hinge on ties
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _engine(path, **kwargs):
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    args = dict(model=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4,
                max_model_len=128, num_gpu_blocks_override=40, max_num_batched_tokens=8,
                attention_backend="torch")
    return LLMEngine(EngineArgs(**{**args, **kwargs}))


def test_engine_frees_blocks_only_when_every_layer_slides(tmp_path):
    _tiny_checkpoint("gemma2", tmp_path / "gemma2", 8)
    _tiny_checkpoint("mistral", tmp_path / "mistral", 8)
    for path, kwargs, window in [(tmp_path / "mistral", {}, 8), (tmp_path / "gemma2", {}, None),
                                 (tmp_path / "mistral", {"disable_sliding_window": True, "max_model_len": 8}, None)]:
        engine = _engine(path, **kwargs)
        try:
            assert engine.scheduler.kv.sliding_window == window, (path, kwargs)
        finally:
            engine.close()


def test_engine_long_generation_holds_the_window_and_matches_transformers(tmp_path):
    import torch

    from kvpilot.engine.sampling_params import SamplingParams

    w, bs = 8, 4
    hf = _tiny_checkpoint("mistral", tmp_path, w)
    prompt = [int(x) for x in torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(3))]
    runs = {}
    for free in (True, False):
        engine = _engine(tmp_path)
        try:
            kv = engine.scheduler.kv
            if not free:
                kv.sliding_window = None
            engine.add_request("r", prompt, SamplingParams(max_tokens=4 * w * 3, temperature=0.0, ignore_eos=True))
            req = engine.scheduler.requests["r"]
            held = []
            while engine.has_unfinished_requests():
                engine.step()
                engine.scheduler.check_integrity()
                if req.block_ids and not req.is_prefilling:
                    held.append((req.num_computed_tokens, kv.num_held_blocks(req)))
            runs[free] = (list(req.output_token_ids), held)
            assert kv.pool.num_used == 0
        finally:
            engine.close()
    (out, held), (out_full, held_full) = runs[True], runs[False]
    assert out == out_full
    assert max(h for s, h in held if s >= (len(prompt) // bs) * bs + w) <= cdiv(w, bs) + 1
    assert held_full[-1][1] == cdiv(len(prompt) + len(out) - 1, bs)
    seq = torch.tensor([prompt + out])
    with torch.no_grad():
        greedy = hf(seq).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert greedy == out  # transformers, full sequence with its sliding mask, picks the same tokens
