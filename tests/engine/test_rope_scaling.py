"""RoPE scaling against transformers' own ``ROPE_INIT_FUNCTIONS``: the inverse frequencies
and the attention factor of every scaling type the engine implements, bit for bit up to
float rounding, and a clear refusal of what it does not. (The whole models with YaRN and
LongRoPE are checked against transformers in test_model_families.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.engine.model.config import UnsupportedModelError
from kvpilot.engine.model.hf_config import read_hf_config
from kvpilot.engine.model.rotary import rope_parameters

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 256,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 8192, "rope_theta": 500000.0}
HALF = BASE["hidden_size"] // BASE["num_attention_heads"] // 2

CASES = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn_betas_no_truncate": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
                               "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-style
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                              "attention_factor": 0.9},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 2048,
                 "short_factor": [1.0 + 0.01 * i for i in range(HALF)],
                 "long_factor": [1.0 + 0.3 * i for i in range(HALF)]},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def _configs(tmp_path, scaling):
    from transformers import LlamaConfig

    cfg = {**BASE, "rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_hf_config(tmp_path), LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_and_attention_factor_match_transformers(tmp_path, case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours_cfg, hf_cfg = _configs(tmp_path, CASES[case])
    kind = CASES[case]["rope_type"]
    # LongRoPE and dynamic pick by the sequence length; the engine serves the whole context.
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, torch.device("cpu"),
                                                    seq_len=BASE["max_position_embeddings"])
    freq, factor = rope_parameters(ours_cfg, BASE["max_position_embeddings"])
    torch.testing.assert_close(freq, ref_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(float(ref_factor), rel=1e-6)
    if kind != "dynamic":  # dynamic is the plain RoPE within the model's context
        plain, _ = rope_parameters(ours_cfg, scaling=None)
        assert not torch.equal(freq, plain) or factor != 1.0, f"{case} changed nothing"


def test_longrope_short_factors_when_the_context_stays_within_the_original(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours_cfg, hf_cfg = _configs(tmp_path, CASES["longrope"])
    ref_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, torch.device("cpu"), seq_len=1000)
    freq, _ = rope_parameters(ours_cfg, 2048)  # --max-model-len within the original context
    torch.testing.assert_close(freq, ref_freq.float(), rtol=1e-6, atol=0)


def test_dynamic_beyond_the_context_and_wrong_longrope_lists_are_refused(tmp_path):
    ours_cfg, _ = _configs(tmp_path, CASES["dynamic"])
    with pytest.raises(UnsupportedModelError, match=r"'dynamic' beyond max_position_embeddings \(9000 > 8192\)"):
        rope_parameters(ours_cfg, 9000)
    bad = {**CASES["longrope"], "long_factor": [1.0, 2.0]}
    ours_cfg, _ = _configs(tmp_path, bad)
    with pytest.raises(UnsupportedModelError, match=r"rope_scaling.long_factor = \[1.0, 2.0\] is not supported"):
        rope_parameters(ours_cfg, 8192)
