"""Rotary position embeddings (RoPE), HF "rotate half" convention, with Llama 3 and
linear frequency scaling."""

from __future__ import annotations

import math

import torch

from kvpilot.engine.model.config import ModelConfig, UnsupportedModelError


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 after any scaling.

    ``inv_freq[i] = theta ** (-2i / head_dim)`` (Su et al., RoFormer). Scaling:
    - ``linear``: divide every frequency by ``factor`` (position interpolation);
    - ``llama3``: Meta's Llama 3.1 rule: wavelengths longer than
      ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
      shorter than ``.../high_freq_factor`` kept, and the band between interpolated
      smoothly;
    - a GGUF ``rope_freqs`` tensor: per-frequency divisors (llama.cpp's form of llama3).

    Raises:
        UnsupportedModelError: another scaling type (yarn, dynamic, ...).
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[max_positions, head_dim]`` (fp32)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``positions`` ``[num_tokens]``, shaped ``[num_tokens, 1, head_dim]``."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
