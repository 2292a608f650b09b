"""The paged KV cache tensors (one pool for all layers) and the FP8 quantization state:
per-layer scales and the optional key rotation."""

from __future__ import annotations

import logging
import math

import torch

from kvpilot.engine.attention.backend import LayerKVCache
from kvpilot.kernels.reference import is_quantized
from kvpilot.kernels.rotation import key_rotation_matrix, rotate_heads

logger = logging.getLogger(__name__)

# Calibrated scales leave this much headroom over the absolute maximum seen: later tokens
# may be larger, and FP8 keeps its relative precision at any magnitude, so a wider range
# costs only values near the subnormal floor.
FP8_SCALE_HEADROOM = 2.0
# Tokens per layer during which a scale may still grow. The first batch can be a single
# token whose K/V are 2-10x smaller than typical ones (measured on SmolLM2); frozen after
# it, the scale would clamp most later values.
FP8_CALIBRATION_TOKENS = 256
# Blocks rescaled at a time when a scale grows (bounds the fp32 temporary).
_RESCALE_CHUNK = 1024


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes of one block over all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes(dtype)


class PagedKVCache:
    """K/V blocks for every layer in one allocation.

    Layout: ``storage[layer, 0 = K | 1 = V]`` is ``[num_blocks, block_size, num_kv_heads,
    head_dim]``; ``layers[i]`` exposes layer ``i`` with its scales.

    FP8 dtypes: each layer has fp32 ``k_scale``/``v_scale`` (the cache holds ``x /
    scale``). They come from the checkpoint (:meth:`load_checkpoint_scales`) or are
    calibrated from real batches (:meth:`calibrate`, never a dummy warm-up): the first
    batch written to a layer sets ``headroom x amax / finfo.max``; during the first
    ``FP8_CALIBRATION_TOKENS`` tokens a batch that would not fit grows the scale by a
    power of two before it is written, and the layer's cache is rescaled by the same
    power of two (exact in FP8), so no value is ever clamped while the range is learned.
    Every setting and growth is logged. With ``rotate_keys`` (the default for FP8) K and Q
    heads are rotated by an orthogonal matrix first (:mod:`kvpilot.kernels.rotation`),
    which lowers the FP8 error of attention logits; checkpoint scales were measured on
    unrotated keys, so they switch the rotation off.

    Args:
        act_dtype: the model's activation dtype (the rotation matrix is kept in it).
        rotate_keys: rotate keys of a quantized cache (ignored for other dtypes).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        act_dtype: torch.dtype = torch.float32,
        rotate_keys: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.storage = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.quantized = is_quantized(dtype)
        rotation = key_rotation_matrix(head_dim, act_dtype, device) if self.quantized and rotate_keys else None
        one = torch.ones((), dtype=torch.float32, device=device)
        self.layers = [
            LayerKVCache(self.storage[i, 0], self.storage[i, 1], one.clone(), one.clone(), rotation)
            for i in range(num_layers)
        ]
        self._uncalibrated = set(range(num_layers)) if self.quantized else set()
        # layer -> tokens seen while its scales may still grow
        self._window: dict[int, int] = {i: 0 for i in range(num_layers)} if self.quantized else {}

    @property
    def needs_calibration(self) -> bool:
        """Some layer has no scale yet (nothing has been written to it)."""
        return bool(self._uncalibrated)

    @property
    def calibrating(self) -> bool:
        """Some layer's scales may still change: pass each step's K/V to :meth:`calibrate`."""
        return bool(self._window)

    @property
    def rotates_keys(self) -> bool:
        return any(layer.key_rotation is not None for layer in self.layers)

    def set_scales(self, layer: int, k_scale: float, v_scale: float, source: str = "given") -> None:
        """Use fixed scales for ``layer`` (``source`` is logged, e.g. ``checkpoint``)."""
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"layer {layer}: KV scales must be > 0; got k_scale={k_scale}, v_scale={v_scale}")
        self.layers[layer].k_scale.fill_(k_scale)
        self.layers[layer].v_scale.fill_(v_scale)
        self._uncalibrated.discard(layer)
        self._window.pop(layer, None)
        if self.quantized:
            logger.info("kv cache %s layer %d: %s k_scale=%.4g v_scale=%.4g", self.dtype, layer, source, k_scale, v_scale)

    def load_checkpoint_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """Scales read from a checkpoint (layer -> (k_scale, v_scale)). They describe
        unrotated keys, so the key rotation is switched off for every layer."""
        if not self.quantized or not scales:
            return
        if self.rotates_keys:
            logger.info("kv cache: using checkpoint KV scales; key rotation off (the scales describe unrotated keys)")
            for layer in self.layers:
                layer.key_rotation = None
        for i, (ks, vs) in sorted(scales.items()):
            self.set_scales(i, ks, vs, source="checkpoint")
        missing = sorted(self._uncalibrated)
        if missing:
            logger.warning("kv cache: the checkpoint has no KV scales for layers %s; calibrating them from the first batch", missing)

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fit ``layer``'s scales to a batch of real K/V ``[num_tokens, heads, dim]``
        (unrotated) before it is written. No-op outside the calibration window."""
        if layer not in self._window or k.numel() == 0:
            return
        cache = self.layers[layer]
        if cache.key_rotation is not None:
            k = rotate_heads(k, cache.key_rotation)
        fmax = torch.finfo(self.dtype).max
        need_k = max(float(k.abs().max()) * FP8_SCALE_HEADROOM / fmax, 1e-8)
        need_v = max(float(v.abs().max()) * FP8_SCALE_HEADROOM / fmax, 1e-8)
        seen = self._window[layer] + k.shape[0]
        if layer in self._uncalibrated:
            self._uncalibrated.discard(layer)
            cache.k_scale.fill_(need_k)
            cache.v_scale.fill_(need_v)
            logger.info("kv cache %s layer %d: calibrated from %d tokens: k_scale=%.4g v_scale=%.4g",
                        self.dtype, layer, k.shape[0], need_k, need_v)
        else:
            self._grow(layer, "k", cache.k_scale, cache.key_cache, need_k)
            self._grow(layer, "v", cache.v_scale, cache.value_cache, need_v)
        if seen >= FP8_CALIBRATION_TOKENS:
            del self._window[layer]
            logger.info("kv cache %s layer %d: scales fixed after %d tokens: k_scale=%.4g v_scale=%.4g",
                        self.dtype, layer, seen, float(cache.k_scale), float(cache.v_scale))
        else:
            self._window[layer] = seen

    def _grow(self, layer: int, which: str, scale: torch.Tensor, cache: torch.Tensor, need: float) -> None:
        """Multiply ``scale`` by the smallest power of two that makes it ``>= need`` and
        divide what ``cache`` holds by the same power (exact for FP8 normals)."""
        current = float(scale)
        if need <= current * (1 + 1e-6):  # the scale is stored in fp32
            return
        factor = 2.0 ** math.ceil(math.log2(need / current))
        for start in range(0, cache.shape[0], _RESCALE_CHUNK):
            part = cache[start : start + _RESCALE_CHUNK]
            part.copy_((part.float() / factor).to(cache.dtype))
        scale.mul_(factor)
        logger.info("kv cache %s layer %d: %s_scale grew x%g to %.4g for a batch above its range; cache rescaled",
                    self.dtype, layer, which, factor, current * factor)
