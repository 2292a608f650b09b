"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE):
tiny random HF checkpoints written by transformers, loaded by our engine, greedy tokens
and logits compared with transformers (fp32); the routing options we do not implement are
refused by name; missing experts are named."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from kvpilot.engine.model.config import UnsupportedModelError
from kvpilot.engine.model.gguf_config import read_gguf_metadata
from kvpilot.engine.model.hf_config import read_hf_config
from kvpilot.engine.model.moe import moe_experts_reference, route_topk

VOCAB = 256


def _tiny_moe_model(path, arch, top_k=2):
    """Write a tiny random MoE checkpoint (4 experts, hidden 64, 2 layers) with transformers."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                  num_experts_per_tok=top_k, eos_token_id=2, bos_token_id=1)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=96, num_local_experts=4, rope_theta=10000.0)
        cls = transformers.MixtralForCausalLM
    elif arch == "qwen2_moe":  # shared expert; layer 1 dense via mlp_only_layers; norm_topk_prob off
        cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                          shared_expert_intermediate_size=80, num_experts=4,
                                          decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)
        cls = transformers.Qwen2MoeForCausalLM
    elif arch == "qwen2_moe-step2":  # decoder_sparse_step 2: layer 0 dense, layer 1 sparse
        cfg = transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                          shared_expert_intermediate_size=80, num_experts=4,
                                          decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=True)
        cls = transformers.Qwen2MoeForCausalLM
    else:  # qwen3_moe: q/k norm, head_dim other than hidden / heads, norm_topk_prob
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48,
                                          num_experts=4, head_dim=32, norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # make the random model's choices well separated
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _engine(path):
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True,
                                block_size=4, max_model_len=128, kv_cache_memory=0.05,
                                attention_backend="torch"))


@pytest.mark.parametrize(("arch", "top_k"), [("mixtral", 2), ("qwen2_moe", 2), ("qwen2_moe-step2", 1),
                                             ("qwen3_moe", 2), ("qwen3_moe", 1)])
def test_moe_greedy_and_logprobs_match_transformers(tmp_path, arch, top_k):
    from kvpilot.engine.model.llama import LlamaForCausalLM
    from kvpilot.engine.model.loader import iter_safetensors
    from kvpilot.engine.model.moe import SparseMoeBlock
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.scoring import score_tokens

    hf = _tiny_moe_model(tmp_path, arch, top_k)
    cfg = read_hf_config(tmp_path)
    assert cfg.architecture == arch.removesuffix("-step2")
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, top_k)
    model = LlamaForCausalLM(cfg, max_positions=256)
    model.load_weights(iter_safetensors(tmp_path))
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
    assert sparse == {"mixtral": [True, True], "qwen2_moe": [True, False], "qwen2_moe-step2": [False, True],
                      "qwen3_moe": [True, True]}[arch]
    shared = [getattr(layer.mlp, "shared_expert", None) is not None for layer in model.layers]
    assert any(shared) == arch.startswith("qwen2_moe")

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (24,), generator=gen).tolist()
    engine = _engine(tmp_path)
    # Teacher-forced log-probabilities of every position (chunks of 5 through the paged
    # cache) equal transformers' log_softmax(logits) in fp32.
    ours = score_tokens(engine, ids, chunk_size=5, return_logprobs=True).logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-3, f"{arch}: max |logprob difference| {diff:.2e}"
    # Greedy continuation equals generate()'s.
    # (No EOS on the HF side: min_new_tokens would mask it, ignore_eos does not.)
    hf.generation_config.eos_token_id = None
    t = torch.tensor([ids[:9]])
    expect = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=10, do_sample=False)[0, 9:].tolist()
    engine.add_request("r0", ids[:9], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got = out.output_token_ids
    assert got == expect


def test_moe_block_matches_a_dense_loop_over_all_experts():
    """The routed loop equals computing every expert for every token and weighting the chosen
    ones (experts that get no token included: 8 experts, 3 tokens, top-1 and top-2)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen)
    w13, w2 = torch.randn(8, 24, 16, generator=gen), torch.randn(8, 16, 12, generator=gen)
    for top_k in (1, 2):
        weights, ids = route_topk(torch.randn(3, 8, generator=gen), top_k, renormalize=True)
        assert torch.allclose(weights.sum(-1), torch.ones(3))
        dense = torch.zeros_like(x)
        for t in range(3):
            for slot in range(top_k):
                e = int(ids[t, slot])
                h = w13[e] @ x[t]
                dense[t] += weights[t, slot] * (w2[e] @ (torch.nn.functional.silu(h[:12]) * h[12:]))
        assert torch.allclose(moe_experts_reference(x, w13, w2, weights, ids), dense, atol=1e-4)


@pytest.mark.parametrize(("extra", "message"), [
    ({"scoring_func": "sparsemixer"}, "scoring_func = 'sparsemixer' is not supported; MoE routing is top-k"),
    ({"topk_method": "noaux_tc"}, "topk_method = 'noaux_tc' is not supported"),
    ({"n_group": 8}, "n_group = 8 is not supported"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok = 9 is not supported; 1..num_experts (8)"),
])
def test_moe_routing_we_do_not_implement_is_refused_by_name(tmp_path, extra, message):
    cfg = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_local_experts": 8, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        read_hf_config(tmp_path)


def test_missing_expert_is_named(tmp_path):
    from kvpilot.engine.model.llama import LlamaForCausalLM
    from kvpilot.engine.model.loader import iter_safetensors

    _tiny_moe_model(tmp_path, "mixtral")
    cfg = read_hf_config(tmp_path)
    model = LlamaForCausalLM(cfg, max_positions=64)
    weights = [(n, t) for n, t in iter_safetensors(tmp_path) if "layers.1.block_sparse_moe.experts.3.w3" not in n]
    with pytest.raises(ValueError, match=re.escape("layers.1.mlp.experts.3.up")):
        model.load_weights(weights)


def _write_gguf(hf, folder, arch, path):
    """Write ``hf``'s weights as llama.cpp's converter lays them out: fused
    ``blk.N.ffn_{gate,up,down}_exps`` ``[E, out, in]``, the router ``ffn_gate_inp``,
    Qwen2-MoE's ``ffn_*_shexp`` and a 1-D ``ffn_gate_inp_shexp``; arch ``llama`` (Mixtral)
    with Q/K rows permuted."""
    import gguf

    from tests.engine.test_loader import llama_cpp_permute

    c = hf.config
    garch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[arch]
    w = gguf.GGUFWriter(str(path), garch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch != "mixtral":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_key_length(c.head_dim if arch == "qwen3_moe" else c.hidden_size // c.num_attention_heads)
    if arch == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    from kvpilot.engine.model.loader import iter_safetensors

    # The saved checkpoint's names (per-expert tensors), not the in-memory module's.
    sd = {k: v.float().numpy() for k, v in iter_safetensors(folder)}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        for hf_name, g in names.items():
            for kind in ("weight", "bias"):
                t = sd.get(f"{pre}{hf_name}.{kind}")
                if t is None:
                    continue
                if garch == "llama" and g in ("attn_q", "attn_k"):
                    t = llama_cpp_permute(t, c.num_attention_heads if g == "attn_q" else c.num_key_value_heads)
                if g == "ffn_gate_inp_shexp":
                    t = t.reshape(-1)
                w.add_tensor(f"blk.{i}.{g}.{kind}", np.ascontiguousarray(t))
        for g, projs in (("ffn_gate_exps", ("w1", "gate_proj")), ("ffn_up_exps", ("w3", "up_proj")),
                         ("ffn_down_exps", ("w2", "down_proj"))):
            per = [sd.get(f"{pre}block_sparse_moe.experts.{e}.{projs[0]}.weight",
                          sd.get(f"{pre}mlp.experts.{e}.{projs[1]}.weight")) for e in range(experts)]
            if per[0] is not None:
                w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(np.stack(per)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_logits_match_transformers(tmp_path, arch):
    from kvpilot.engine.model.llama import LlamaForCausalLM
    from kvpilot.engine.model.loader import GGUFModelFile

    hf = _tiny_moe_model(tmp_path / "hf", arch)
    _write_gguf(hf, tmp_path / "hf", arch, tmp_path / "m.gguf")
    gfile = GGUFModelFile(tmp_path / "m.gguf")
    cfg = gfile.model_config()
    hf_cfg = read_hf_config(tmp_path / "hf")
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size", "mlp_only_layers", "qk_norm", "attention_bias"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    model = LlamaForCausalLM(cfg, max_positions=64)
    model.load_weights(gfile.iter_weights(cfg))
    ref = LlamaForCausalLM(hf_cfg, max_positions=64)
    from kvpilot.engine.model.loader import iter_safetensors

    ref.load_weights(iter_safetensors(tmp_path / "hf"))
    ours, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():  # every tensor, experts included, lands where the HF one does
        assert torch.equal(p, theirs[name]), name
    # And the engine serving the .gguf gives transformers' log-probabilities.
    from kvpilot.engine.scoring import score_tokens

    ids = torch.randint(3, VOCAB, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    ours_lp = score_tokens(_engine(tmp_path / "m.gguf"), ids, chunk_size=5, return_logprobs=True).logprobs
    with torch.no_grad():
        ref_lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    assert (ours_lp - ref_lp).abs().max().item() < 1e-3


def test_gguf_moe_needs_its_counts_and_softmax_gating():
    meta = {"general.architecture": "qwen3moe", "qwen3moe.attention.head_count": 2,
            "qwen3moe.embedding_length": 16, "qwen3moe.feed_forward_length": 32, "qwen3moe.block_count": 1,
            "qwen3moe.vocab_size": 32, "qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
            "qwen3moe.expert_feed_forward_length": 8}
    cfg = read_gguf_metadata(meta, {"blk.0.ffn_gate_inp.weight"}, "m.gguf")
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == ("qwen3_moe", 4, 2, True)
    assert read_gguf_metadata({**meta, "qwen3moe.expert_gating_func": 2}, set(),
                                          "m.gguf").moe_scoring_func == "sigmoid"
    with pytest.raises(UnsupportedModelError, match=re.escape(
            "qwen3moe.expert_gating_func = 3 is not supported; softmax (1) or sigmoid (2)")):
        read_gguf_metadata({**meta, "qwen3moe.expert_gating_func": 3}, set(), "m.gguf")
    with pytest.raises(UnsupportedModelError, match=re.escape("qwen3moe.expert_used_count = 5")):
        read_gguf_metadata({**meta, "qwen3moe.expert_used_count": 5}, set(), "m.gguf")


def test_sigmoid_routing_scores_each_expert_on_its_own(tmp_path):
    """scoring_func sigmoid (config.json) / expert_gating_func 2 (GGUF): the weights are
    sigmoid(logit) of the chosen experts, renormalised only when norm_topk_prob."""
    from kvpilot.engine.model.moe import SparseMoeBlock

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.0, 0.1, -0.2, -3.0]])
    weights, ids = route_topk(logits, 2, renormalize=False, scoring="sigmoid")
    assert ids.tolist() == [[3, 0], [1, 0]]
    assert torch.allclose(weights, torch.sigmoid(torch.tensor([[3.0, 2.0], [0.1, 0.0]])))
    renormed, _ = route_topk(logits, 2, renormalize=True, scoring="sigmoid")
    assert torch.allclose(renormed.sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="scoring = 'tanh' is not supported"):
        route_topk(logits, 2, renormalize=False, scoring="tanh")

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": False,
           "scoring_func": "sigmoid"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = read_hf_config(tmp_path)
    assert config.moe_scoring_func == "sigmoid"
    torch.manual_seed(0)
    block = SparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(5, 16)
    with torch.no_grad():
        got = block(x)
        w, e = torch.topk(torch.sigmoid(x @ block.gate.weight.T), 2, dim=-1)
        expect = torch.zeros_like(x)
        for t in range(5):
            for slot in range(2):
                h = block.w13[e[t, slot]] @ x[t]
                expect[t] += w[t, slot] * (block.w2[e[t, slot]] @ (torch.nn.functional.silu(h[:8]) * h[8:]))
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
