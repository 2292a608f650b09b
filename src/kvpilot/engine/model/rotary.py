"""Rotary position embeddings (RoPE), HF "rotate half" convention, with linear, Llama 3,
YaRN, LongRoPE and (within the model's context) dynamic NTK frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from kvpilot.engine.model.config import ModelConfig, UnsupportedModelError

_FROM_CONFIG: dict[str, Any] = {}  # sentinel: "the config's own rope_scaling"


def rope_inv_freq(config: ModelConfig, max_positions: int | None = None, *, theta: float | None = None,
                  scaling: dict[str, Any] | None = _FROM_CONFIG) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 after any scaling (:func:`rope_parameters`)."""
    return rope_parameters(config, max_positions, theta=theta, scaling=scaling)[0]


def rope_parameters(config: ModelConfig, max_positions: int | None = None, *, theta: float | None = None,
                    scaling: dict[str, Any] | None = _FROM_CONFIG) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] fp32, attention_factor)``: the frequencies after any
    scaling and the factor that multiplies cos and sin (1.0 except YaRN and LongRoPE), as
    transformers' ``ROPE_INIT_FUNCTIONS`` compute them (``modeling_rope_utils``).

    ``inv_freq[i] = theta ** (-2i / head_dim)`` (Su et al., RoFormer). Scaling
    (``scaling["rope_type"]``, normalized by :func:`~kvpilot.engine.model.hf_config.normalize_rope_scaling`):
    - ``linear``: divide every frequency by ``factor`` (position interpolation);
    - ``llama3``: Meta's Llama 3.1 rule: wavelengths longer than
      ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``,
      shorter than ``.../high_freq_factor`` kept, and the band between interpolated
      smoothly;
    - ``yarn`` (Peng et al. 2023, "YaRN"): frequencies interpolated by ``factor`` below the
      ``beta_slow`` rotation count and kept above ``beta_fast`` within
      ``original_max_position_embeddings``, a linear ramp between; attention factor
      ``attention_factor``, else ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
      with both set, else ``0.1 ln(factor) + 1``;
    - ``longrope`` (Phi-3's LongRoPE / su): ``inv_freq / ext`` with ``ext`` the
      ``long_factor`` list when the context exceeds ``original_max_position_embeddings``,
      else ``short_factor``; attention factor
      ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` with ``factor``
      defaulting to ``max_position_embeddings / original_max_position_embeddings``.
      transformers picks the list per forward pass from the longest position in it;
      here the context the engine allows (``max_positions``) picks it once, so every
      sequence uses one set: equal to transformers whenever ``max_positions`` is at most
      the original context (short factors) or the prompt is longer than it (long ones);
    - ``dynamic`` (dynamic NTK): transformers grows the base once a sequence exceeds
      ``max_position_embeddings`` and uses the plain base below it. The engine never
      runs past ``max_position_embeddings`` (the model's context caps ``max_model_len``),
      so within the allowed context this is the unscaled RoPE, exactly;
    - a GGUF ``rope_freqs`` tensor: per-frequency divisors (llama.cpp's form of llama3).

    Args:
        config: the model; ``theta`` and ``scaling`` override its ``rope_theta`` and
            ``rope_scaling`` (Gemma 3's sliding layers: their own base, no scaling).
        max_positions: the longest context the tables serve (LongRoPE's choice; dynamic's
            check); default ``config.max_position_embeddings``.
    Raises:
        UnsupportedModelError: another scaling type, a LongRoPE factor list of the wrong
            length, or a dynamic context beyond ``max_position_embeddings``.
    """
    dim = config.head_dim
    base = config.rope_theta if theta is None else theta
    max_positions = config.max_position_embeddings if max_positions is None else max_positions
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if config.rope_freq_factors is not None and theta is None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling if scaling is _FROM_CONFIG else scaling
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "dynamic":
        if max_positions > config.max_position_embeddings:
            raise UnsupportedModelError(
                f"rope_scaling.rope_type = 'dynamic' beyond max_position_embeddings "
                f"({max_positions} > {config.max_position_embeddings}) is not supported: the base would depend "
                "on the sequence length")
        return inv_freq, 1.0
    old_len = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    if kind == "longrope":
        return _longrope(config, scaling, base, exponents, old_len, max_positions)
    factor = scaling.get("factor")
    if kind == "yarn":
        return _yarn(scaling, base, dim, old_len,
                     float(factor) if factor is not None else config.max_position_embeddings / old_len)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled), 1.0
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported; supported: default, linear, "
                                "llama3, yarn, dynamic, longrope")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, Eq. 21 of the paper: ``0.1 mscale ln(scale) + 1``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(scaling: dict[str, Any], base: float, dim: int, old_len: float, factor: float) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and attention factor (transformers' ``_compute_yarn_parameters``)."""
    attention = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        """The dimension whose wavelength fits ``rotations`` times in the original context."""
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(config: ModelConfig, scaling: dict[str, Any], base: float, exponents: torch.Tensor, old_len: float,
              max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE frequencies and attention factor (transformers' ``_compute_longrope_parameters``)."""
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else config.max_position_embeddings / old_len
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    key = "long_factor" if max_positions > old_len else "short_factor"
    ext = scaling.get(key)
    if not isinstance(ext, list) or len(ext) != exponents.numel():
        raise UnsupportedModelError(f"rope_scaling.{key} = {ext!r} is not supported; a list of head_dim / 2 = "
                                    f"{exponents.numel()} factors")
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponents), float(attention)


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[max_positions, head_dim]`` (fp32), already multiplied
    by the scaling's attention factor (YaRN, LongRoPE) as transformers multiplies its
    cos/sin; ``theta``/``scaling`` as :func:`rope_parameters`."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, *,
                 theta: float | None = None, scaling: dict[str, Any] | None = _FROM_CONFIG) -> None:
        inv_freq, attention_factor = rope_parameters(config, max_positions, theta=theta, scaling=scaling)
        self.attention_factor = attention_factor
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device)
        self.sin = (emb.sin() * attention_factor).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``positions`` ``[num_tokens]``, shaped ``[num_tokens, 1, head_dim]``."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
