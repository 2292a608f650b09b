"""Gemma 2/3 specifics beyond the cross-check in test_model_families.py: what is refused
by name, and vLLM's --disable-sliding-window on an interleaved model."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.engine.model.config import UnsupportedModelError
from kvpilot.engine.model.hf_config import read_hf_config
from tests.engine.test_model_families import (
    LOGPROB_TOLERANCE,
    WINDOW,
    make_engine,
    prompts,
    tiny_checkpoint,
)

GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 32, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"}


@pytest.mark.parametrize(("extra", "message"), [
    ({"architectures": ["Gemma3ForConditionalGeneration"]},
     "the vision-language Gemma 3 (4B/12B/27B) is not supported"),
    ({"hidden_activation": "gelu"},
     "hidden_activation = 'gelu' is not supported; supported for Gemma: gelu_pytorch_tanh"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention = True is not supported"),
])
def test_what_gemma_does_not_implement_is_refused_by_name(tmp_path, extra, message):
    (tmp_path / "config.json").write_text(json.dumps({**GEMMA2, **extra}))
    with pytest.raises(UnsupportedModelError) as info:
        read_hf_config(tmp_path)
    assert message in str(info.value)


def test_gemma2_defaults_the_fields_its_config_omits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2))
    cfg = read_hf_config(tmp_path)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert [cfg.sliding_window_for(i) for i in range(2)] == [4096, None]
    assert not cfg.all_layers_slide


def test_disable_sliding_window_keeps_gemma3_local_rope(tmp_path):
    """With the window off, Gemma 3's sliding layers keep their own RoPE base: inside
    the window the log-probabilities still equal transformers'."""
    from kvpilot.engine.scoring import score_tokens

    hf = tiny_checkpoint("gemma3", tmp_path)
    engine = make_engine(tmp_path, max_model_len=None, disable_sliding_window=True, attention_backend="torch")
    assert engine.max_model_len == WINDOW
    layers = engine.runner.model.layers
    assert [layer.sliding for layer in layers] == [True, True, False, True]
    (ids,) = prompts(1, WINDOW, seed=4)
    ours = score_tokens(engine, ids, chunk_size=3, return_logprobs=True).logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    assert (ours - ref).abs().max().item() < LOGPROB_TOLERANCE
