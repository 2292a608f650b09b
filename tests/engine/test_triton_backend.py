"""The ``triton`` attention backend (kernels under the Triton interpreter on CPU) against
the ``torch`` reference backend: one layer's mixed batch (cache bytes and outputs), and
the engine's greedy tokens on real SmolLM2 weights."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.attention import backend as backend_mod
from kvpilot.engine.attention.backend import AttentionMetadata, LayerKVCache, resolve_backend_name
from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.kernels.rotation import key_rotation_matrix
from tests.kernels.cases import assert_attention_close, make_paged_batch

CPU = torch.device("cpu")


def test_auto_picks_triton_on_cuda():
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    assert resolve_backend_name("auto", CPU) in ("cpu", "torch")  # tests/engine/test_cpu_backend.py
    assert "triton" in backend_mod.ATTENTION_BACKENDS


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    from kvpilot.engine.attention import triton_backend

    monkeypatch.setattr(triton_backend, "INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        triton_backend.TritonAttentionBackend(CPU)


def layer_and_meta(b, cache_dtype, rotate):
    """Decodes first (as the scheduler orders them), then prefill chunks."""
    num_decodes = next(i for i, (_, n) in enumerate(b.specs) if n > 1)
    one = torch.ones(())
    def clone(t):
        return t.clone() if t is not None else None

    kv = LayerKVCache(
        b.key_cache.clone(), b.value_cache.clone(),
        b.k_scale if b.k_scale is not None else one, b.v_scale if b.v_scale is not None else one,
        key_rotation_matrix(b.q.shape[-1], b.q.dtype) if rotate else None,
        key_group_scales=clone(b.key_group_scales), value_group_scales=clone(b.value_group_scales),
        kv4_format=b.kv4_format,
    )
    qsl = b.query_start_loc.tolist()
    lens = b.seq_lens.tolist()
    meta = AttentionMetadata(
        num_decodes=num_decodes, slot_mapping=b.slot_mapping, query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens, block_tables=b.block_tables, query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
    )
    return kv, meta


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "rotate"),
    [
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.float8_e4m3fn, True),
        (torch.float32, "int4", False),
        (torch.bfloat16, "fp4_e2m1", True),
    ],
    ids=["fp32", "bf16-e4m3-rotated", "fp32-int4", "bf16-fp4-rotated"],
)
def test_mixed_batch_matches_torch_backend(dtype, cache_dtype, rotate):
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

    specs = [(9, 1), (40, 1), (0, 1), (0, 12), (7, 9), (32, 1)]  # last: a 1-token chunk
    b = make_paged_batch(specs, num_kv_heads=2, group=3, head_dim=64, page=16, dtype=dtype,
                         cache_dtype=cache_dtype, seed=3)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(CPU), TritonAttentionBackend(CPU)):
        kv, meta = layer_and_meta(b, cache_dtype, rotate)
        outs.append(backend.forward(b.q, b.key, b.value, kv, meta, b.scale))
        caches.append(tuple(t for t in (kv.key_cache, kv.value_cache, kv.key_group_scales, kv.value_group_scales)
                            if t is not None))
    for a, t in zip(caches[0], caches[1]):
        assert bool((a.view(torch.uint8) == t.view(torch.uint8)).all())
    assert_attention_close(outs[1], outs[0].float(), dtype, "triton vs torch backend")


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


# How far apart the torch backend's log-probabilities of two tokens may be for the backends
# to choose differently: fp32 rounding (1e-7) for an fp32 cache; for FP8 and 4-bit caches
# the backends' fp32 differences move a calibrated scale or flip a code, and the
# log-probabilities with it (FP8: up to 0.04 seen on an Intel Xeon, where the second
# prompt's first two tokens are 0.012 apart under the torch backend and 0.002 under Triton).
TIE_TOL = {"auto": 1e-4, "fp8_e4m3": 0.1, "int4": 0.2}


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int4"])
def test_engine_greedy_tokens_match_torch_backend(make_engine, tokenizer, kv_cache_dtype):
    """A prefill step (both prompts), then decode steps, through all 30 layers: the Triton
    backend's greedy tokens are the torch backend's until a step where torch's own
    log-probabilities of the two choices are within :data:`TIE_TOL` (a near tie, which the
    rounding decides; the rest of that prompt is not compared), and at least the first
    prompt's four tokens are compared.

    4-bit: int4 here. With fp4_e2m1 the backends' fp32 rounding differences (1e-7) move a
    calibrated scale or flip a code in a late layer, and on E2M1's coarse grid one flip
    moves the second prompt's first-token logprobs by ~0.2 (its top two are 0.05 apart);
    fp4_e2m1 is checked bit for bit per layer above."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    tokens, logprobs = {}, {}
    for name in ("torch", "triton"):
        engine = make_engine(attention_backend=name, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=0.05)
        assert engine.config.attention_backend == name
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", tokenizer.encode(p), params)
        done, tops = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tops.setdefault(out.request_id, []).extend(dict(t.top) for t in out.new_logprobs or [])
                if out.finished:
                    done[out.request_id] = out.output_token_ids
        tokens[name] = [done[f"r{i}"] for i in range(len(PROMPTS))]
        logprobs[name] = [tops[f"r{i}"] for i in range(len(PROMPTS))]
    compared = 0
    for i, (got, want, lps) in enumerate(zip(tokens["triton"], tokens["torch"], logprobs["torch"])):
        assert len(got) == len(want) == 4
        for step, (g, w) in enumerate(zip(got, want)):
            if g != w:
                margin = lps[step][w] - lps[step].get(g, float("-inf"))
                assert margin <= TIE_TOL[kv_cache_dtype], (
                    f"prompt {i} step {step}: triton {g}, torch {w}, which torch prefers by {margin:.3g}")
                break
            compared += 1
    assert compared >= 4, tokens
