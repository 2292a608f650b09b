"""GGUF files of Qwen3, Gemma 2, Gemma 3, Phi-3 (with and without LongRoPE) and Llama
with YaRN against HF transformers.

Each case makes a tiny random checkpoint with transformers' own classes (as
tests/engine/test_model_families.py), writes it as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does (its architecture name, the ``gguf`` package's tensor name map,
its metadata keys, and its transforms: Q/K rows permuted for arch ``llama`` only, ``+1`` on
every Gemma norm weight, Phi-3's fused ``attn_qkv`` / ``ffn_up`` kept fused and its LongRoPE
factors as ``rope_factors_long`` / ``rope_factors_short`` tensors), and serves the .gguf:

- every weight lands where the HF folder's does (the same model either way);
- teacher-forced log-probabilities of a 40-token sequence (longer than the 8-token window
  of the sliding models, and than LongRoPE's and YaRN's original context) within
  ``LOGPROB_TOLERANCE`` of transformers' ``log_softmax(logits)``;
- greedy continuations identical to transformers' argmax, step by step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpilot.engine.model.config import UnsupportedModelError
from kvpilot.engine.model.gguf_config import read_gguf_metadata
from kvpilot.engine.model.hf_config import read_hf_config
from tests.engine.test_model_families import COMMON, VOCAB, WINDOW, make_engine, prompts

# F32 tensors and an fp32 engine on both sides: the differences are summation order, as in
# test_model_families.py (measured at most ~1e-5 here).
LOGPROB_TOLERANCE = 1e-3
# Weights through the GGUF path against the HF folder's: equal, except Gemma's norms
# (w + 1 - 1 + 1 in fp32, exact for weights in [0.5, 2], off by an ulp outside).
WEIGHT_TOLERANCE = 1e-6


def _qwen3(t):  # q/k RMSNorm, head_dim other than hidden / heads
    return t.Qwen3Config(**COMMON, head_dim=32, rope_theta=1e6), t.Qwen3ForCausalLM, "qwen3"


def _gemma2(t):  # llama.cpp's fixed pattern: even layers slide; both soft-caps
    return (t.Gemma2Config(**{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True},
                           head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                           attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
            t.Gemma2ForCausalLM, "gemma2")


def _gemma3(t):  # llama.cpp's fixed pattern: five sliding layers, then a full one
    return (t.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6, "tie_word_embeddings": True},
                               head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                               final_logit_softcapping=3.0, rope_theta=1e6, rope_local_base_freq=20000.0),
            t.Gemma3ForCausalLM, "gemma3")


def _phi3(t):  # fused projections, a window on every layer
    return t.Phi3Config(**COMMON, rope_theta=10000.0, sliding_window=WINDOW), t.Phi3ForCausalLM, "phi3"


def _phi3_longrope(t):  # long factors: the engine's context and the prompts exceed 16
    half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
               "long_factor": [1.5 + 0.7 * i for i in range(half)]}
    return (t.Phi3Config(**COMMON, rope_theta=10000.0, sliding_window=None, original_max_position_embeddings=16,
                         rope_scaling=scaling), t.Phi3ForCausalLM, "phi3")


def _llama_yarn(t):  # factor = max_position_embeddings / original, other betas than the defaults
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
               "beta_fast": 16.0, "beta_slow": 2.0}
    return t.LlamaConfig(**COMMON, rope_theta=10000.0, rope_scaling=scaling), t.LlamaForCausalLM, "llama"


CASES: dict[str, Callable] = {"qwen3": _qwen3, "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3,
                              "phi3_longrope": _phi3_longrope, "llama_yarn": _llama_yarn}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows to adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(c) -> dict:
    return dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})


def _write_metadata(w, c, garch: str) -> None:
    """The keys convert_hf_to_gguf.py writes for ``garch`` (TextModel.set_gguf_parameters,
    and Gemma2Model's / Gemma3Model's / Phi3MiniModel's own)."""
    rope = _rope(c)
    full = rope.get("full_attention", rope)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if garch == "gemma2":  # no rope keys at all: llama.cpp's default base 10000
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        return
    if garch == "phi3":
        orig = rope.get("original_max_position_embeddings") or getattr(c, "original_max_position_embeddings", None)
        w.add_rope_scaling_orig_ctx_len(orig or c.max_position_embeddings)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
        w.add_rope_freq_base(full["rope_theta"])
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("long_factor"):
            scale = c.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        return
    import gguf

    if full.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if garch == "gemma3":
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)


def write_gguf(hf, folder: Path, garch: str, path: Path) -> None:
    """Write the checkpoint in ``folder`` as llama.cpp's converter would (F32 tensors)."""
    import gguf

    from kvpilot.engine.model.loader import iter_safetensors

    c = hf.config
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == garch)
    names = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), garch)
    _write_metadata(w, c, garch)
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])  # the converters write a vocabulary, not vocab_size
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    for name, t in iter_safetensors(folder):
        if garch.startswith("gemma") and name == "lm_head.weight":
            continue  # tied; llama.cpp skips it
        g = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert g is not None, name
        a = t.float().numpy()
        if garch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        if garch == "llama" and re.search(r"\.attn_[qk]\.weight$", g):
            a = llama_cpp_permute(a, c.num_attention_heads if ".attn_q." in g else c.num_key_value_heads)
        w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    rope = _rope(c)
    if garch == "phi3" and rope.get("long_factor"):
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp(request.param)
    cfg, cls, garch = CASES[request.param](transformers)
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # well-separated choices, so greedy paths do not hinge on ties
        for p in hf.parameters():
            p.mul_(3.0)
    hf.save_pretrained(str(folder / "hf"), safe_serialization=True)
    write_gguf(hf, folder / "hf", garch, folder / "m.gguf")
    return request.param, folder, hf


def test_gguf_config_and_weights_match_the_hf_folder(case):
    from kvpilot.engine.model.loader import GGUFModelFile, iter_safetensors
    from kvpilot.engine.model_runner import model_class

    name, folder, _ = case

    gfile = GGUFModelFile(folder / "m.gguf")
    ours = gfile.model_config()
    ref = read_hf_config(folder / "hf")
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
                  "attention_bias", "qk_norm", "sliding_window", "layer_types", "hidden_act",
                  "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
        assert getattr(ours, field) == getattr(ref, field), f"{name}: {field}"
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    if ref.rope_scaling is not None:
        for k, v in ref.rope_scaling.items():
            if k in ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                     "long_factor", "short_factor"):
                assert ours.rope_scaling[k] == pytest.approx(v), f"{name}: rope_scaling.{k}"
    cls = model_class(ours)
    model, hf_model = cls(ours, max_positions=64), cls(ref, max_positions=64)
    model.load_weights(gfile.iter_weights(ours))
    hf_model.load_weights(iter_safetensors(folder / "hf"))
    theirs = dict(hf_model.named_parameters())
    for pname, p in model.named_parameters():
        diff = (p - theirs[pname]).abs().max().item()
        assert diff <= WEIGHT_TOLERANCE, f"{name}: {pname} differs by {diff:.2e}"


def test_gguf_logprobs_match_transformers_past_the_window(case):
    from kvpilot.engine.scoring import score_tokens

    name, folder, hf = case
    engine = make_engine(folder / "m.gguf", attention_backend="torch")
    (ids,) = prompts(1, 40, seed=1)
    ours = score_tokens(engine, ids, chunk_size=5, return_logprobs=True).logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    diff = (ours - ref).abs().max().item()
    print(f"{name}: max |logprob difference| {diff:.2e}")
    assert diff < LOGPROB_TOLERANCE, f"{name}: max |logprob difference| {diff:.2e}"


def test_gguf_greedy_matches_transformers(case):
    from kvpilot.engine.sampling_params import SamplingParams

    name, folder, hf = case
    new = 16
    batch = prompts(2, 22, seed=2)  # past the window and LongRoPE's original context
    engine = make_engine(folder / "m.gguf", attention_backend="torch", max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(batch):
        engine.add_request(f"r{i}", ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    for i, ids in enumerate(batch):
        # transformers' argmax over the whole sequence at each step (generate(min_new_tokens)
        # would mask the EOS token, which the engine with ignore_eos may pick)
        seq = list(ids)
        with torch.no_grad():
            for _ in range(new):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert done[f"r{i}"] == seq[len(ids):], f"{name}: request {i}"


# --------------------------------------------------------------- refused keys
BASE = {"general.architecture": "llama", "llama.attention.head_count": 2, "llama.embedding_length": 16,
        "llama.feed_forward_length": 32, "llama.block_count": 2, "llama.vocab_size": 32,
        "llama.context_length": 256}


@pytest.mark.parametrize(("extra", "tensors", "message"), [
    ({"llama.rope.scaling.type": "su"}, set(), "llama.rope.scaling.type = 'su' is not supported; supported: none, "
     "linear, yarn, longrope"),
    ({"llama.rope.scaling.type": "yarn"}, set(), "llama.rope.scaling.factor = None is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0, "llama.rope.scaling.yarn_ext_factor": 0.5},
     set(), "llama.rope.scaling.yarn_ext_factor = 0.5 is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.yarn_log_multiplier": 0.1}, set(), "llama.rope.scaling.yarn_log_multiplier = 0.1"),
    ({"llama.rope.scaling.type": "longrope"}, {"rope_factors_long.weight"},
     "LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight"),
    ({"llama.rope.scaling.attn_factor": 1.2}, set(), "llama.rope.scaling.attn_factor = 1.2 is not supported"),
    ({"llama.rope.dimension_count": 4}, set(), "llama.rope.dimension_count = 4 is not supported; rotary over "
     "the whole head (head_dim 8)"),
    ({"llama.attention.value_length": 16}, set(), "llama.attention.value_length = 16 is not supported"),
    ({"general.architecture": "gemma"}, set(), "GGUF architecture 'gemma' is not supported"),
])
def test_gguf_keys_we_do_not_implement_are_refused_by_name(extra, tensors, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        read_gguf_metadata({**BASE, **extra}, tensors, "m.gguf")


def test_gguf_yarn_keys_and_gemma_layer_patterns():
    yarn = read_gguf_metadata(
        {**BASE, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
         "llama.rope.scaling.yarn_attn_factor": 1.1}, set(), "m.gguf")
    # llama.cpp's default original context is the training context
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                 "attention_factor": pytest.approx(1.1)}
    gemma = {k.replace("llama.", "gemma3."): v for k, v in BASE.items()} | {
        "general.architecture": "gemma3", "gemma3.block_count": 4, "gemma3.attention.sliding_window": 8}
    assert read_gguf_metadata(gemma, set(), "m.gguf").layer_types == ("sliding_attention",) * 4
    per_layer = {**gemma, "gemma3.attention.sliding_window_pattern": [True, False, True, True]}
    assert read_gguf_metadata(per_layer, set(), "m.gguf").layer_types == (
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention")
    none = read_gguf_metadata({**gemma, "gemma3.attention.sliding_window_pattern": 1}, set(), "m.gguf")
    assert (none.sliding_window, none.layer_types) == (None, None)
    g2 = {k.replace("gemma3.", "gemma2."): v for k, v in gemma.items()} | {"general.architecture": "gemma2"}
    cfg = read_gguf_metadata(g2, set(), "m.gguf")
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.rope_local_theta) == (50.0, 30.0, None)
    with pytest.raises(UnsupportedModelError, match=re.escape("gemma3.attention.sliding_window_pattern has 3")):
        read_gguf_metadata({**gemma, "gemma3.attention.sliding_window_pattern": [True] * 3}, set(), "m")
