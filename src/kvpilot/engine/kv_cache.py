"""The paged KV cache tensors (one pool for all layers) and the quantization state
(FP8 or 4-bit): per-layer scales, 4-bit group scales, the optional key rotation and the
layers kept in full precision (``--kv-cache-skip-layers``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from kvpilot.engine.attention.backend import LayerKVCache
from kvpilot.kernels.kv4 import GROUP_SCALE_DTYPE, GROUP_SCALE_MAX, kv4_format, kv4_shapes
from kvpilot.kernels.reference import is_quantized
from kvpilot.kernels.rotation import key_rotation_matrix, rotate_heads
from kvpilot.sizing.capacity import kv_dtype, kv_token_bytes

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


def check_skip_layers(skip_layers: tuple[int, ...], num_layers: int, quantized: bool, dtype_name: str) -> tuple[int, ...]:
    """The sorted, de-duplicated ``--kv-cache-skip-layers``.

    Raises:
        ValueError: an index outside the model's layers, or skip layers on a cache that
            is not quantized (nothing to skip).
    """
    bad = [i for i in skip_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--kv-cache-skip-layers {bad} out of range: the model has layers 0..{num_layers - 1}")
    if skip_layers and not quantized:
        raise ValueError(
            "--kv-cache-skip-layers keeps layers in full precision, so it needs a quantized "
            f"--kv-cache-dtype (fp8, fp8_e4m3, fp8_e5m2, fp4_e2m1, int4); got {dtype_name}"
        )
    return tuple(sorted(set(skip_layers)))


def bytes_per_token_layer(num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv4: str | None = None) -> int:
    """K and V bytes of one token in one layer, group scales included: ``2 x heads x
    head_dim x bytes`` for a plain dtype; ``2 x heads x (head_dim / 2 + head_dim / 16)``
    for a 4-bit format (``kv4``, with its E4M3 scale per 16 values). The per-layer fp32
    scales are not counted (8 bytes per layer)."""
    if kv4 is not None:
        kv4_shapes(head_dim, kv4)  # refuses a head_dim the 4-bit layout cannot hold
    per_element = kv_dtype(kv4).bytes_per_element if kv4 else element_bytes(dtype)
    return int(kv_token_bytes(1, num_kv_heads, head_dim, per_element))


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv4: str | None = None,
    skip_layers: tuple[int, ...] = (),
    skip_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """K and V bytes of one block over all layers (4-bit group scales included); the
    ``skip_layers`` are stored in ``skip_dtype``."""
    kept = num_layers - len(skip_layers)
    per_token = kept * bytes_per_token_layer(num_kv_heads, head_dim, dtype, kv4)
    per_token += len(skip_layers) * bytes_per_token_layer(num_kv_heads, head_dim, skip_dtype)
    return block_size * per_token


class PagedKVCache:
    """K/V blocks for every layer in one allocation (plus one for skipped layers).

    Layout: ``storage[j, 0 = K | 1 = V]`` is ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` for the j-th quantized layer (uint8 ``[..., head_dim // 2]`` for a 4-bit
    format, with ``group_scales[j, 0 | 1]`` E4M3 ``[..., head_dim // 16]``); layers in
    ``skip_layers`` live in ``skip_storage`` in ``act_dtype``. ``layers[i]`` exposes
    layer ``i`` with its scales, whatever its storage.

    Quantized dtypes (FP8, fp4_e2m1, int4): each layer has fp32 ``k_scale``/``v_scale``
    (FP8 holds ``x / scale``; 4-bit holds codes times a group scale times it), fixed
    before the first request is served, so an answer never depends on what other users
    sent before it (the order vLLM documents):

    1. the checkpoint's ``k_scale``/``v_scale`` (:meth:`load_checkpoint_scales`);
    2. else a calibration pass at start-up over a built-in text, the same every time
       (:meth:`fit_scales`, driven by :mod:`kvpilot.engine.kv_scales`): each layer's
       scale is ``headroom x amax / range`` of that text's K/V (``range`` = FP8's max, or
       ``QMAX x 448`` for 4-bit: the largest group scale then sits at E4M3's max /
       headroom);
    3. else 1.0 (no tokenizer to encode the text), with a warning.

    Values outside the range are clamped by the store kernels; the cache is never
    rescaled. ``live=True`` (``--calculate-kv-scales``) instead learns the scales from
    the first real batches (:meth:`calibrate`): the first batch written to a layer sets
    them and, during the first ``FP8_CALIBRATION_TOKENS`` tokens, a batch that would not
    fit grows a scale by a power of two and divides the layer's cache (FP8) or its
    group scales (4-bit) by the same power. That mode is opt-in and not deterministic:
    an answer then depends on the traffic that came first.
    Every setting and growth is logged. With ``rotate_keys`` (the default for quantized
    caches) K and Q heads are rotated by an orthogonal matrix first
    (:mod:`kvpilot.kernels.rotation`), which lowers the error of attention logits;
    checkpoint scales were measured on unrotated keys, so they switch the rotation off.

    Args:
        dtype: storage dtype (uint8 for a 4-bit format).
        act_dtype: the model's activation dtype (the rotation matrix and skipped layers
            are kept in it).
        rotate_keys: rotate keys of a quantized cache (ignored for other dtypes).
        kv4: ``fp4_e2m1`` or ``int4`` for a 4-bit cache, else None.
        skip_layers: layers stored in ``act_dtype`` instead (quantized caches only).
        live: learn the scales from traffic (``--calculate-kv-scales``, see above).
        reduce_max: with tensor parallelism, the group's elementwise MAX all-reduce
            (:meth:`kvpilot.engine.distributed.TPGroup.all_reduce_max`): a rank holds only
            its KV heads, so each scale is fitted to the largest magnitude over every
            rank's heads, the scale one device holding them all would fix. Every rank
            then calls :meth:`fit_scales` / :meth:`calibrate` for the same layers in the
            same order (they run inside the model's forward, which is in lockstep).
    Raises:
        ValueError: a skip layer out of range, skip layers on an unquantized cache, a
            head_dim a 4-bit format cannot hold.
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
        kv4: str | None = None,
        skip_layers: tuple[int, ...] = (),
        live: bool = False,
        reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.live = live
        self.reduce_max = reduce_max
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kv4 = kv4_format(kv4) if kv4 is not None else None
        self.dtype_name = kv4 if kv4 is not None else str(dtype).removeprefix("torch.")
        self.quantized = is_quantized(dtype) or kv4 is not None
        self.skip_layers = check_skip_layers(skip_layers, num_layers, self.quantized, self.dtype_name)
        kept = [i for i in range(num_layers) if i not in self.skip_layers]
        shape = (num_blocks, block_size, num_kv_heads)
        if kv4 is not None:
            packed, groups = kv4_shapes(head_dim, kv4)
            self.storage = torch.zeros((len(kept), 2, *shape, packed), dtype=torch.uint8, device=device)
            self.group_scales: torch.Tensor | None = torch.zeros(
                (len(kept), 2, *shape, groups), dtype=GROUP_SCALE_DTYPE, device=device
            )
        else:
            self.storage = torch.zeros((len(kept), 2, *shape, head_dim), dtype=dtype, device=device)
            self.group_scales = None
        self.skip_storage = torch.zeros((len(self.skip_layers), 2, *shape, head_dim), dtype=act_dtype, device=device)
        rotation = key_rotation_matrix(head_dim, act_dtype, device) if self.quantized and rotate_keys else None
        one = torch.ones((), dtype=torch.float32, device=device)
        self.layers: list[LayerKVCache] = []
        for i in range(num_layers):
            if i in self.skip_layers:
                j = self.skip_layers.index(i)
                kvs = self.skip_storage[j]
                self.layers.append(LayerKVCache(kvs[0], kvs[1], one.clone(), one.clone()))
                continue
            j = kept.index(i)
            gs = self.group_scales
            self.layers.append(LayerKVCache(
                self.storage[j, 0], self.storage[j, 1], one.clone(), one.clone(), rotation,
                key_group_scales=gs[j, 0] if gs is not None else None,
                value_group_scales=gs[j, 1] if gs is not None else None,
                kv4_format=kv4,
            ))
        if self.skip_layers:
            logger.info("kv cache %s: layers %s kept in %s", self.dtype_name, list(self.skip_layers), act_dtype)
        self._quantized_layers = set(kept) if self.quantized else set()
        self._uncalibrated = set(self._quantized_layers)
        # layer -> tokens seen while its scales may still grow (live calibration only)
        self._window: dict[int, int] = {i: 0 for i in self._quantized_layers} if live else {}

    @property
    def needs_calibration(self) -> bool:
        """Some layer has no scale yet (nothing has been written to it)."""
        return bool(self._uncalibrated)

    @property
    def calibrating(self) -> bool:
        """Live calibration only (``live=True``): some layer's scales may still change, so
        each step's K/V go to :meth:`calibrate`. Always False with fixed scales."""
        return bool(self._window)

    def _range(self) -> float:
        """The largest magnitude a scale of 1.0 can store: FP8's max, or ``QMAX x 448``."""
        return self.kv4.qmax * GROUP_SCALE_MAX if self.kv4 is not None else torch.finfo(self.dtype).max

    def _needed(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
        """Scales that fit ``k``/``v`` ``[num_tokens, heads, dim]`` (unrotated) with
        ``FP8_SCALE_HEADROOM``; keys are measured after the layer's rotation."""
        cache = self.layers[layer]
        if cache.key_rotation is not None:
            k = rotate_heads(k, cache.key_rotation)
        amax = torch.stack([k.abs().max(), v.abs().max()]).float()
        if self.reduce_max is not None:  # tensor parallelism: the max over every rank's heads
            amax = self.reduce_max(amax)
        k_max, v_max = amax.tolist()
        fmax = self._range()
        need_k = max(k_max * FP8_SCALE_HEADROOM / fmax, 1e-8)
        need_v = max(v_max * FP8_SCALE_HEADROOM / fmax, 1e-8)
        return need_k, need_v

    def fit_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor, source: str) -> None:
        """Fix ``layer``'s scales to fit the K/V ``[num_tokens, heads, dim]`` of a
        calibration batch (unrotated), if it has none yet; the scales never change after.
        No-op for layers that are not quantized, already have scales, or an empty batch."""
        if layer not in self._uncalibrated or k.numel() == 0:
            return
        need_k, need_v = self._needed(layer, k, v)
        self.set_scales(layer, need_k, need_v, source=f"{source} ({k.shape[0]} tokens)")

    def reset_contents(self) -> None:
        """Zero every block (and 4-bit group scale): what a calibration pass wrote is
        gone, the scales stay. Mutates the storage tensors in place."""
        self.storage.zero_()
        self.skip_storage.zero_()
        if self.group_scales is not None:
            self.group_scales.zero_()

    def default_scales(self) -> None:
        """Scales of 1.0 for every layer that has none (the last resort), with a warning."""
        missing = sorted(self._uncalibrated)
        if not missing:
            return
        logger.warning("kv cache %s: no checkpoint scales and no tokenizer to calibrate with; "
                       "using k_scale = v_scale = 1.0 for layers %s (values beyond the format's "
                       "range are clamped)", self.dtype_name, missing)
        for i in missing:
            self.layers[i].k_scale.fill_(1.0)
            self.layers[i].v_scale.fill_(1.0)
            self._uncalibrated.discard(i)
            self._window.pop(i, None)

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
        if layer in self._quantized_layers:
            logger.info("kv cache %s layer %d: %s k_scale=%.4g v_scale=%.4g", self.dtype_name, layer, source, k_scale, v_scale)

    def load_checkpoint_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """Scales read from a checkpoint (layer -> (k_scale, v_scale)). They describe
        unrotated keys, so the key rotation is switched off for every layer. They are FP8
        scales: a 4-bit cache ignores them (logged) and calibrates its own."""
        if not self.quantized or not scales:
            return
        if self.kv4 is not None:
            logger.info("kv cache %s: the checkpoint's KV scales are FP8 scales; calibrating the 4-bit "
                        "tensor scales from real batches instead", self.dtype_name)
            return
        if self.rotates_keys:
            logger.info("kv cache: using checkpoint KV scales; key rotation off (the scales describe unrotated keys)")
            for layer in self.layers:
                layer.key_rotation = None
        for i, (ks, vs) in sorted(scales.items()):
            if i in self._quantized_layers:
                self.set_scales(i, ks, vs, source="checkpoint")
        missing = sorted(self._uncalibrated)
        if missing:
            how = "from the first batches (--calculate-kv-scales)" if self.live else "at start-up"
            logger.warning("kv cache: the checkpoint has no KV scales for layers %s; calibrating them %s", missing, how)

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Live calibration (``live=True``): fit ``layer``'s scales to a batch of real K/V
        ``[num_tokens, heads, dim]`` (unrotated) before it is written, growing them (and
        rescaling the layer's cache) while the window is open. No-op outside the window."""
        if layer not in self._window or k.numel() == 0:
            return
        cache = self.layers[layer]
        need_k, need_v = self._needed(layer, k, v)
        seen = self._window[layer] + k.shape[0]
        if layer in self._uncalibrated:
            self._uncalibrated.discard(layer)
            cache.k_scale.fill_(need_k)
            cache.v_scale.fill_(need_v)
            logger.info("kv cache %s layer %d: calibrated from %d tokens: k_scale=%.4g v_scale=%.4g",
                        self.dtype_name, layer, k.shape[0], need_k, need_v)
        elif self.kv4 is not None:  # codes stay; the group scales carry the factor
            assert cache.key_group_scales is not None and cache.value_group_scales is not None
            self._grow(layer, "k", cache.k_scale, cache.key_group_scales, need_k)
            self._grow(layer, "v", cache.v_scale, cache.value_group_scales, need_v)
        else:
            self._grow(layer, "k", cache.k_scale, cache.key_cache, need_k)
            self._grow(layer, "v", cache.v_scale, cache.value_cache, need_v)
        if seen >= FP8_CALIBRATION_TOKENS:
            del self._window[layer]
            logger.info("kv cache %s layer %d: scales fixed after %d tokens: k_scale=%.4g v_scale=%.4g",
                        self.dtype_name, layer, seen, float(cache.k_scale), float(cache.v_scale))
        else:
            self._window[layer] = seen

    def _grow(self, layer: int, which: str, scale: torch.Tensor, cache: torch.Tensor, need: float) -> None:
        """Multiply ``scale`` by the smallest power of two that makes it ``>= need`` and
        divide what ``cache`` holds (FP8 values, or 4-bit group scales) by the same power
        (exact for FP8 normals)."""
        current = float(scale)
        if need <= current * (1 + 1e-6):  # the scale is stored in fp32
            return
        factor = 2.0 ** math.ceil(math.log2(need / current))
        for start in range(0, cache.shape[0], _RESCALE_CHUNK):
            part = cache[start : start + _RESCALE_CHUNK]
            part.copy_((part.float() / factor).to(cache.dtype))
        scale.mul_(factor)
        logger.info("kv cache %s layer %d: %s_scale grew x%g to %.4g for a batch above its range; cache rescaled",
                    self.dtype_name, layer, which, factor, current * factor)
