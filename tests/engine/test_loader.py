"""Model discovery and loading: GGUF (the embedded SmolLM2), HF folders (tiny random
Llama and Qwen2 checkpoints written by transformers), and the errors for everything else."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from kvpilot.engine.model.config import UnsupportedModelError
from kvpilot.engine.model.gguf_config import read_gguf_metadata
from kvpilot.engine.model.hf_config import read_hf_config
from kvpilot.engine.model.loader import (
    EMBEDDED_MODEL_URI,
    ModelNotFoundError,
    gguf_hf_name,
    resolve_model,
    unpermute_rope_rows,
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script layout for Q/K rows (pairs adjacent dims per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_layout(heads):
    w = np.arange(heads * 8 * 5, dtype=np.float32).reshape(heads * 8, 5)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)


def test_gguf_names_map_to_hf_names():
    assert gguf_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_hf_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"  # qwen3
    assert gguf_hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gguf_hf_name("something.else") is None


@pytest.mark.slow  # reads the embedded model file
def test_embedded_model_config_is_read_from_gguf():
    from kvpilot.engine.model.loader import load_model_config

    source = resolve_model(None)
    assert resolve_model(EMBEDDED_MODEL_URI) == source
    cfg, _ = load_model_config(source)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (cfg.head_dim, cfg.vocab_size, cfg.rope_theta, cfg.max_position_embeddings) == (64, 49152, 100000.0, 8192)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)


def test_missing_and_unsupported_models_say_what_was_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file or folder"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"weights.bin is a file but not a \.gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match=r"holds \['weights.bin'\]; supported: a .gguf file"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="unknown embedded model"):
        resolve_model("embedded://gpt-5")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    from kvpilot.engine.model.loader import load_model_config

    with pytest.raises(ModelNotFoundError, match="not a readable GGUF file"):
        load_model_config(resolve_model(f"file://{bad}"))
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match=r"declares architectures \['BertModel'\]; supported: \[.*'LlamaForCausalLM'"):
        read_hf_config(resolve_model(str(folder)).path)
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors"):
        (folder / "model.safetensors").unlink()
        resolve_model(str(folder))


def _tiny_hf_model(path, arch, tokenizer):
    """Write a tiny random checkpoint with transformers (and the SmolLM2 tokenizer)."""
    import transformers

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    if arch == "llama-bias":  # attention_bias: q/k/v and o_proj biases
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, attention_bias=True)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen3":  # q/k RMSNorm, and a head_dim other than hidden / heads
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint
        cfg = transformers.Phi3Config(**common, rope_theta=10000.0, sliding_window=None,
                                      pad_token_id=0)
        cls = transformers.Phi3ForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=10000.0)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.LlamaConfig(
            **common,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # make the random model's choices well separated
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("arch", ["llama", "llama-bias", "qwen2", "qwen3", "phi3", "mistral"])
def test_hf_folder_greedy_matches_transformers(tmp_path, tokenizer, arch):
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.sampling_params import SamplingParams

    hf = _tiny_hf_model(tmp_path, arch, tokenizer)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=0.05)
    cfg = llm.engine.model_config
    assert cfg.architecture == arch.removesuffix("-bias")
    assert cfg.attention_bias == (arch in ("qwen2", "llama-bias"))
    assert cfg.o_proj_bias == (arch == "llama-bias")
    assert cfg.qk_norm == (arch == "qwen3")
    prompts = ["The capital of France is", "def f(x):", "One two three four five six seven eight nine ten eleven"]
    results = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, res in zip(prompts, results):
        ids = torch.tensor([tokenizer.encode(prompt)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert res.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
                "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize(("extra", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported; supported: silu, swish"),
    ({"hidden_activation": "gelu_pytorch_tanh"}, "hidden_activation = 'gelu_pytorch_tanh'"),
    ({"architectures": ["MistralForCausalLM"], "mlp_bias": True}, "mlp_bias = True is not supported"),
    ({"rope_scaling": {"rope_type": "su", "factor": 4.0}},
     "rope_scaling.rope_type = 'su' is not supported; supported: default, linear, llama3, yarn"),
    ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [1, 1]}}, "rope_scaling.rope_type = 'mrope'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "4.0"}},
     "rope_scaling.factor = '4.0' is not supported; a finite number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "rope_scaling.factor = -2.0 is not supported; a number above 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": True}}, "rope_scaling.factor = True"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor = None is not supported; rope_type 'linear' needs a factor"),
    ({"rope_scaling": {"type": "dynamic", "factor": float("inf")}}, "rope_scaling.factor = inf"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}},
     "rope_scaling.high_freq_factor = 4.0 is not supported; a number above low_freq_factor (4.0)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings = 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}}, "rope_scaling.beta_fast = '32'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, -1.0], "long_factor": [2.0, 2.0]}},
     "rope_scaling.short_factor = [1.0, -1.0]"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0}},
     "rope_parameters.factor = 0 is not supported; a number above 0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     "rope_parameters.partial_rotary_factor = 0.75"),  # Phi-4-mini's spelling in transformers 5
])
def test_config_fields_that_change_the_math_are_refused_by_name(tmp_path, extra, message):
    """Loading such a checkpoint would run other math than it was trained with and answer
    wrongly without a word (a Llama config with hidden_act gelu used to run SiLU)."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **extra}))
    with pytest.raises(UnsupportedModelError, match=re.escape(message)) as info:
        read_hf_config(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


@pytest.mark.parametrize("extra", [{"hidden_act": "silu"}, {"mlp_bias": False}, {"mlp_bias": True},
                                   {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                   {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 2048}},
                                   {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
                                   {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192}},
                                   {"rope_scaling": {"rope_type": "linear", "factor": 2}},
                                   {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0],
                                                     "long_factor": [2.0, 2.0, 2.0, 2.0],
                                                     "original_max_position_embeddings": 1024}},
                                   {"partial_rotary_factor": 1.0}, {"quantization_config": None}])
def test_config_fields_with_implemented_values_load(tmp_path, extra):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **extra}))
    assert read_hf_config(tmp_path).architecture == "llama"


def test_gguf_experts_and_other_rope_scaling_are_refused():
    meta = {"general.architecture": "llama", "llama.attention.head_count": 2,
            "llama.embedding_length": 16, "llama.feed_forward_length": 32, "llama.block_count": 1,
            "llama.vocab_size": 32}
    with pytest.raises(UnsupportedModelError, match=r"llama.expert_count = 8, llama.expert_used_count = None"):
        read_gguf_metadata({**meta, "llama.expert_count": 8}, set(), "mixtral.gguf")
    with pytest.raises(UnsupportedModelError, match=r"rope.scaling.type = 'su'"):
        read_gguf_metadata({**meta, "llama.rope.scaling.type": "su"}, set(), "m.gguf")
    assert read_gguf_metadata(meta, {"blk.0.attn_output.bias"}, "m.gguf").o_proj_bias


def test_which_layers_slide_per_architecture(tmp_path):
    for arch, extra, window in (("Phi3ForCausalLM", {"sliding_window": 2047}, 2047),
                                ("MistralForCausalLM", {"sliding_window": 4096}, 4096),
                                ("Qwen3ForCausalLM", {"sliding_window": 4096}, None),
                                # transformers: Qwen layer i slides iff i >= max_window_layers (28)
                                ("Qwen3ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True}, None),
                                ("Qwen3ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True,
                                                      "max_window_layers": 0}, 4096)):
        (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "architectures": [arch], **extra}))
        assert read_hf_config(tmp_path).sliding_window == window, (arch, extra)


@pytest.mark.parametrize(("extra", "message"), [
    ({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 0}, "sliding_window = 0 is not supported"),
    ({"architectures": ["Gemma3ForCausalLM"], "sliding_window": -1}, "sliding_window = -1 is not supported"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 8.5}, "sliding_window = 8.5 is not supported"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention"]},
     "sliding_window = 8 is not supported for LlamaForCausalLM"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 8, "layer_types": ["sliding_attention"] * 2},
     "layer_types has 2 entries is not supported; one per layer (num_hidden_layers 1)"),
])
def test_a_window_the_model_cannot_honour_is_refused(tmp_path, extra, message):
    """A window of 0 or below used to run Gemma with every key masked (all-zero tokens), and
    a Llama config's window was dropped without a word."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "head_dim": 8, **extra}))
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        read_hf_config(tmp_path)


def test_gguf_windows_and_expert_scales_are_checked():
    meta = {"general.architecture": "gemma2", "gemma2.attention.head_count": 2, "gemma2.embedding_length": 16,
            "gemma2.feed_forward_length": 32, "gemma2.block_count": 2, "gemma2.vocab_size": 32,
            "gemma2.attention.key_length": 8, "gemma2.attention.value_length": 8}
    for bad in (-5, 8.5):
        with pytest.raises(UnsupportedModelError, match=re.escape(f"gemma2.attention.sliding_window = {bad!r}")):
            read_gguf_metadata({**meta, "gemma2.attention.sliding_window": bad}, set(), "g.gguf")
    with pytest.raises(UnsupportedModelError, match=re.escape("sliding_window_pattern = -2 is not supported")):
        read_gguf_metadata({**meta, "gemma2.attention.sliding_window": 8,
                                        "gemma2.attention.sliding_window_pattern": -2}, set(), "g.gguf")
    moe = {"general.architecture": "qwen3moe", "qwen3moe.attention.head_count": 2,
           "qwen3moe.embedding_length": 16, "qwen3moe.feed_forward_length": 32, "qwen3moe.block_count": 1,
           "qwen3moe.vocab_size": 32, "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
           "qwen3moe.expert_weights_scale": 2.5}
    with pytest.raises(UnsupportedModelError, match=re.escape("qwen3moe.expert_weights_scale = 2.5")):
        read_gguf_metadata(moe, {"blk.0.ffn_gate_inp.weight"}, "m.gguf")


def test_gguf_keys_that_change_the_math_are_honoured_or_refused():
    meta = {"general.architecture": "llama", "llama.attention.head_count": 2, "llama.embedding_length": 16,
            "llama.feed_forward_length": 32, "llama.block_count": 1, "llama.vocab_size": 32}
    # llama.cpp's default scaling type is linear: a bare factor (or rope.scale_linear) scales.
    for k in ("llama.rope.scaling.factor", "llama.rope.scale_linear"):
        assert read_gguf_metadata({**meta, k: 4.0}, set(), "m.gguf").rope_scaling == \
            {"rope_type": "linear", "factor": 4.0}
    assert read_gguf_metadata({**meta, "llama.rope.scaling.factor": 1.0}, set(), "m.gguf").rope_scaling \
        is None
    with pytest.raises(UnsupportedModelError, match=re.escape("llama.attention.sliding_window = 8 is not supported")):
        read_gguf_metadata({**meta, "llama.attention.sliding_window": 8}, set(), "m.gguf")
    with pytest.raises(UnsupportedModelError, match=re.escape("llama.attention.scale = 0.25 is not supported")):
        read_gguf_metadata({**meta, "llama.attention.scale": 0.25}, set(), "m.gguf")
    assert read_gguf_metadata({**meta, "llama.attention.scale": 8 ** -0.5}, set(), "m.gguf")
