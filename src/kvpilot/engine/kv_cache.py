"""The paged KV cache tensors (one pool for all layers) and FP8 scale calibration."""

from __future__ import annotations

import logging

import torch

from kvpilot.engine.attention.backend import LayerKVCache
from kvpilot.kernels.reference import is_quantized

logger = logging.getLogger(__name__)

# Calibrated scales leave this much headroom over the first batch's absolute maximum:
# later tokens may be larger, and FP8 keeps its relative precision at any magnitude, so
# a wider range costs only values near the subnormal floor.
FP8_SCALE_HEADROOM = 2.0


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V bytes of one block over all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes(dtype)


class PagedKVCache:
    """K/V blocks for every layer in one allocation.

    Layout: ``storage[layer, 0 = K | 1 = V]`` is ``[num_blocks, block_size, num_kv_heads,
    head_dim]``; ``layers[i]`` exposes layer ``i`` with its scales. For FP8 dtypes the
    per-layer ``k_scale``/``v_scale`` are calibrated from the first real batch written
    (never from a dummy warm-up) unless set explicitly, and logged.
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
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.storage = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        one = torch.ones((), dtype=torch.float32, device=device)
        self.layers = [
            LayerKVCache(self.storage[i, 0], self.storage[i, 1], one.clone(), one.clone())
            for i in range(num_layers)
        ]
        self.quantized = is_quantized(dtype)
        self._uncalibrated = set(range(num_layers)) if self.quantized else set()

    @property
    def needs_calibration(self) -> bool:
        return bool(self._uncalibrated)

    def set_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Use fixed scales (e.g. from a checkpoint) for ``layer``."""
        self.layers[layer].k_scale.fill_(k_scale)
        self.layers[layer].v_scale.fill_(v_scale)
        self._uncalibrated.discard(layer)

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set ``layer``'s scales from real K/V ``[num_tokens, heads, dim]`` if not yet set:
        ``scale = headroom * amax / finfo.max``."""
        if layer not in self._uncalibrated or k.numel() == 0:
            return
        fmax = torch.finfo(self.dtype).max
        ks = max(float(k.abs().max()) * FP8_SCALE_HEADROOM / fmax, 1e-8)
        vs = max(float(v.abs().max()) * FP8_SCALE_HEADROOM / fmax, 1e-8)
        self.set_scales(layer, ks, vs)
        logger.info("kv cache %s layer %d: calibrated k_scale=%.3g v_scale=%.3g from %d tokens",
                    self.dtype, layer, ks, vs, k.shape[0])
