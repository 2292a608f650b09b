"""Architectures without checkpoints: ``--model preset:<name>`` with ``--load-format dummy``
runs a real model shape on random weights with no file, no tokenizer and no
transformers (benchmarks at Llama-3-8B shapes on a machine that has only torch).

Values are those of each model's published HF ``config.json``.
"""

from __future__ import annotations

from kvpilot.engine.model.config import ModelConfig

PRESET_PREFIX = "preset:"

MODEL_PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig(
            architecture="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_ids=(2,),
            name="smollm2-135m",
        ),
        ModelConfig(
            architecture="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_ids=(128001, 128009),
            name="llama-3-8b",
        ),
        # A two-layer toy with SmolLM2's GQA group of 3, for smoke tests.
        ModelConfig(
            architecture="llama",
            vocab_size=512,
            hidden_size=192,
            intermediate_size=384,
            num_layers=2,
            num_heads=6,
            num_kv_heads=2,
            head_dim=32,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_ids=(2,),
            name="tiny-gqa3",
        ),
    )
}


def preset_config(name: str) -> ModelConfig:
    """The preset ``name`` (with or without the ``preset:`` prefix).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    key = name.removeprefix(PRESET_PREFIX).lower()
    if key not in MODEL_PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; known: {', '.join(PRESET_PREFIX + k for k in MODEL_PRESETS)}"
        )
    return MODEL_PRESETS[key]
