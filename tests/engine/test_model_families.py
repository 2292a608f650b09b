"""Every supported architecture against HF transformers, through the engine's real paths.

One tiny random checkpoint per architecture (two to four layers, hidden 64, vocabulary
256), made by transformers' own classes and saved to a temporary folder. For each:

- teacher-forced log-probabilities (:func:`kvpilot.engine.scoring.score_tokens`, chunks
  of 5 tokens through the paged cache) of a 40-token sequence, longer than the 8-token
  sliding window of the models that have one, within ``LOGPROB_TOLERANCE`` of
  transformers' ``log_softmax(logits)`` at every position;
- greedy continuations identical to ``generate()``'s, with the engine's scheduler doing
  chunked prefill (an 8-token budget), preemption (a pool too small for the batch) and,
  for the same prompts sent again, prefix-cache hits.

The architecture-specific tests live beside: GGUF files in test_model_families_gguf.py,
refused config values in test_loader.py and test_gemma.py, MoE in test_moe.py, RoPE
scaling in test_rope_scaling.py, the kernels' windows in
tests/kernels/test_sliding_window_triton.py, freeing blocks behind the window in
tests/engine/core/test_sliding_window_blocks.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

VOCAB = 256
WINDOW = 8
# fp32 on both sides; the differences are summation order (fused q/k/v and gate/up
# projections, paged attention in chunks), measured at most ~2e-5 on these models.
LOGPROB_TOLERANCE = 1e-3

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama(t):
    return t.LlamaConfig(**COMMON, rope_theta=10000.0), t.LlamaForCausalLM


def _llama_bias(t):  # attention_bias (q/k/v and o) and mlp_bias
    return t.LlamaConfig(**COMMON, rope_theta=10000.0, attention_bias=True, mlp_bias=True), t.LlamaForCausalLM


def _llama_yarn(t):  # the 40-token sequences run past the original 16-token context
    return (t.LlamaConfig(**COMMON, rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}), t.LlamaForCausalLM)


def _mistral(t):  # every layer slides
    return t.MistralConfig(**COMMON, rope_theta=10000.0, sliding_window=WINDOW), t.MistralForCausalLM


def _qwen3(t):
    return t.Qwen3Config(**COMMON, head_dim=32, rope_theta=1e6), t.Qwen3ForCausalLM


def _phi3(t):  # fused checkpoint projections, a window on every layer
    return t.Phi3Config(**COMMON, rope_theta=10000.0, sliding_window=WINDOW), t.Phi3ForCausalLM


def _phi3_longrope(t):
    # Every prompt here is longer than the original 16-token context, so transformers
    # uses the long factors on every forward pass, as the engine does (see rotary.py).
    half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
    return (t.Phi3Config(**COMMON, rope_theta=10000.0, original_max_position_embeddings=16, rope_scaling={
        "type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 0.5 * i for i in range(half)]}), t.Phi3ForCausalLM)


def _mixtral(t):
    return (t.MixtralConfig(**{**COMMON, "intermediate_size": 48}, num_local_experts=4,
                            num_experts_per_tok=2, rope_theta=1e6), t.MixtralForCausalLM)


def _qwen2_moe(t):  # a shared expert, and a dense layer between sparse ones
    return (t.Qwen2MoeConfig(**{**COMMON, "num_hidden_layers": 3}, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, decoder_sparse_step=1,
                             mlp_only_layers=[1], norm_topk_prob=False),
            t.Qwen2MoeForCausalLM)


def _qwen3_moe(t):
    return (t.Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True),
            t.Qwen3MoeForCausalLM)


def _gemma2(t):  # alternating sliding/full layers, both soft-caps
    return (t.Gemma2Config(**{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True},
                           head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                           attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
            t.Gemma2ForCausalLM)


def _gemma3(t):  # q/k norms, local and global rope bases, three sliding layers of four
    return (t.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True},
                               head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                               layer_types=["sliding_attention", "sliding_attention",
                                            "full_attention", "sliding_attention"],
                               rope_theta=1e6, rope_local_base_freq=10000.0),
            t.Gemma3ForCausalLM)


ARCHS: dict[str, Callable] = {
    "llama": _llama, "llama_bias": _llama_bias, "llama_yarn": _llama_yarn, "mistral": _mistral,
    "qwen3": _qwen3, "phi3": _phi3, "phi3_longrope": _phi3_longrope,
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe,
    "gemma2": _gemma2, "gemma3": _gemma3,
}


def tiny_checkpoint(arch: str, path: Path):
    """Save a random ``arch`` checkpoint to ``path``; return the transformers model (fp32, eval)."""
    import transformers

    cfg, cls = ARCHS[arch](transformers)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # well-separated choices, so greedy paths do not hinge on ties
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # transformers initializes biases to zero
                p.normal_(0.0, 0.5)
            else:
                p.mul_(3.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def make_engine(path: Path, **kwargs):
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    args = dict(model=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True,
                block_size=4, max_model_len=128, kv_cache_memory=0.05)
    return LLMEngine(EngineArgs(**{**args, **kwargs}))


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=gen).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, tiny_checkpoint(request.param, path)


def test_logprobs_match_transformers_past_the_window(checkpoint):
    from kvpilot.engine.scoring import score_tokens

    arch, path, hf = checkpoint
    engine = make_engine(path, attention_backend="torch")
    (ids,) = prompts(1, 40, seed=1)
    ours = score_tokens(engine, ids, chunk_size=5, return_logprobs=True).logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    diff = (ours - ref).abs().max().item()
    print(f"{arch}: max |logprob difference| {diff:.2e}")
    assert diff < LOGPROB_TOLERANCE, f"{arch}: max |logprob difference| {diff:.2e}"


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_triton_backend_slides_and_soft_caps_like_transformers(tmp_path, arch):
    """The Triton kernels' own window and soft-cap (under the interpreter here), past the
    window, with the blocks behind it freed (Mistral) or kept (Gemma 2)."""
    from kvpilot.engine.scoring import score_tokens

    hf = tiny_checkpoint(arch, tmp_path)
    engine = make_engine(tmp_path, attention_backend="triton")
    (ids,) = prompts(1, 40, seed=1)
    ours = score_tokens(engine, ids, chunk_size=5, return_logprobs=True).logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    assert (ours - ref).abs().max().item() < LOGPROB_TOLERANCE


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_through_chunked_prefill_preemption_and_prefix_hits(checkpoint, backend):
    from kvpilot.engine.sampling_params import SamplingParams

    if backend == "cpu":
        from kvpilot.kernels import cpu_attention

        ok, why = cpu_attention.available()
        if not ok:
            pytest.skip(f"the cpu backend's kernels do not build here: {why}")
    arch, path, hf = checkpoint
    new = 16
    batch = prompts(3, 22, seed=2)
    expect = []
    hf.generation_config.eos_token_id = None  # ignore_eos on both sides, no logit masking
    for ids in batch:
        t = torch.tensor([ids])
        out = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new, do_sample=False)
        expect.append(out[0, len(ids):].tolist())

    # 3 requests of 38 tokens need 30 blocks of 4; 14 make the scheduler preempt.
    engine = make_engine(path, attention_backend=backend, max_num_batched_tokens=8,
                         num_gpu_blocks_override=14, max_model_len=48)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

    def run(order: list[int]) -> tuple[list[list[int]], int]:
        for i in order:
            engine.add_request(f"r{i}", batch[i], params)
        done, preempted = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
            preempted += engine.take_stats().num_preemptions
        return [done[f"r{i}"] for i in range(len(batch))], preempted

    first, preempted = run([0, 1, 2])
    assert first == expect, arch
    hits = engine.scheduler.prefix_stats.hits
    # Last in first: the pool still holds the blocks of the request that finished last.
    second, _ = run([2, 1, 0])
    assert second == expect, arch
    assert engine.scheduler.prefix_stats.hits > hits, f"{arch}: the second round had no prefix hit"
    sliding_everywhere = arch in ("mistral", "phi3")
    # A model whose every layer slides frees the blocks behind the window, so its three
    # requests may fit the pool; every other model must have been preempted.
    assert preempted > 0 or sliding_everywhere, f"{arch}: the small pool did not preempt"


def test_context_is_not_capped_to_the_window_unless_asked(tmp_path):
    """A sliding-window model serves its whole context; vLLM's --disable-sliding-window
    caps the context to the window and runs full attention, which inside the window is
    the same computation (the log-probabilities of a prompt within it match)."""
    from kvpilot.engine.scoring import score_tokens

    hf = tiny_checkpoint("mistral", tmp_path)
    assert make_engine(tmp_path, max_model_len=None).max_model_len == 256  # max_position_embeddings
    with pytest.raises(ValueError, match=r"--max-model-len 128 is larger than the model's context \(8 tokens\)"):
        make_engine(tmp_path, disable_sliding_window=True)
    capped = make_engine(tmp_path, max_model_len=None, disable_sliding_window=True)
    assert capped.max_model_len == WINDOW
    assert capped.runner.model.config.sliding_window is None
    (ids,) = prompts(1, WINDOW, seed=3)
    ours = score_tokens(capped, ids, chunk_size=3, return_logprobs=True).logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    assert (ours - ref).abs().max().item() < LOGPROB_TOLERANCE


def test_longrope_serves_short_factors_within_the_original_context(tmp_path):
    """--max-model-len at or below original_max_position_embeddings picks LongRoPE's short
    factors, as transformers does for such sequences (it used to take the model's context)."""
    from kvpilot.engine.scoring import score_tokens

    hf = tiny_checkpoint("phi3_longrope", tmp_path)
    engine = make_engine(tmp_path, max_model_len=16, attention_backend="torch")
    (ids,) = prompts(1, 12, seed=5)
    ours = score_tokens(engine, ids, chunk_size=5, return_logprobs=True).logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    assert (ours - ref).abs().max().item() < LOGPROB_TOLERANCE
