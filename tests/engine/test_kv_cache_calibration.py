"""Live FP8 scale calibration (``--calculate-kv-scales``, opt-in) of the paged KV cache,
without a model: the first batch sets the
scale, a later batch above the range grows it by a power of two and rescales what is
already stored (exactly), and the window closes after FP8_CALIBRATION_TOKENS tokens."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.engine.kv_cache import FP8_CALIBRATION_TOKENS, FP8_SCALE_HEADROOM, PagedKVCache
from kvpilot.kernels import reference as ref

CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max


def cache(rotate=False):
    return PagedKVCache(1, 8, 4, 2, 16, E4M3, CPU, rotate_keys=rotate, live=True)


def test_first_batch_sets_the_scales_with_headroom():
    c = cache()
    k = torch.full((3, 2, 16), 0.5)
    k[1, 1, 3] = -2.0
    c.calibrate(0, k, k / 4)
    assert float(c.layers[0].k_scale) == pytest.approx(2.0 * FP8_SCALE_HEADROOM / FMAX)
    assert float(c.layers[0].v_scale) == pytest.approx(0.5 * FP8_SCALE_HEADROOM / FMAX)
    assert not c.needs_calibration and c.calibrating


def test_a_batch_above_the_range_grows_the_scale_and_rescales_the_stored_tokens():
    c = cache()
    layer = c.layers[0]
    small = torch.linspace(-0.1, 0.1, 32).view(1, 2, 16)
    c.calibrate(0, small, small)
    ref.store_kv(small, small, layer.key_cache, layer.value_cache, torch.tensor([0]), layer.k_scale, layer.v_scale)
    before = ref.dequantize(layer.key_cache.view(-1, 2, 16)[0], torch.float32, layer.k_scale)
    k_scale0 = float(layer.k_scale)
    big = torch.randn(20, 2, 16) * 5
    c.calibrate(0, big, small.expand(20, 2, 16))
    factor = float(layer.k_scale) / k_scale0
    assert factor == 2.0 ** math.ceil(math.log2(float(big.abs().max()) * FP8_SCALE_HEADROOM / FMAX / k_scale0))
    assert float(layer.v_scale) == pytest.approx(0.1 * FP8_SCALE_HEADROOM / FMAX)  # V fit: unchanged
    after = ref.dequantize(layer.key_cache.view(-1, 2, 16)[0], torch.float32, layer.k_scale)
    normal = before.abs() >= 2.0**-6 * float(layer.k_scale)  # still an FP8 normal after the shift
    assert torch.equal(after[normal], before[normal])
    stored = ref.quantize(big, E4M3, layer.k_scale).float()
    assert stored.abs().max() < FMAX  # the big batch fits: nothing clamped


def test_the_window_closes_after_enough_tokens_and_then_nothing_changes():
    c = cache()
    x = torch.randn(FP8_CALIBRATION_TOKENS - 1, 2, 16)
    c.calibrate(0, x, x)
    assert c.calibrating
    c.calibrate(0, x[:1], x[:1])
    assert not c.calibrating
    frozen = float(c.layers[0].k_scale)
    c.calibrate(0, x * 100, x * 100)
    assert float(c.layers[0].k_scale) == frozen


def test_rotated_keys_are_what_the_k_scale_describes():
    c = cache(rotate=True)
    k = torch.zeros(1, 2, 16)
    k[0, 0, 0] = 4.0  # one outlier channel: rotation spreads it to 4 / sqrt(16) = 1
    c.calibrate(0, k, k)
    assert float(c.layers[0].k_scale) == pytest.approx(1.0 * FP8_SCALE_HEADROOM / FMAX)
    assert float(c.layers[0].v_scale) == pytest.approx(4.0 * FP8_SCALE_HEADROOM / FMAX)


def test_without_live_calibration_batches_never_move_the_scales():
    c = PagedKVCache(1, 8, 4, 2, 16, E4M3, CPU)
    assert not c.calibrating
    c.fit_scales(0, torch.full((2, 2, 16), 0.5), torch.full((2, 2, 16), 0.5), source="test")
    fixed = float(c.layers[0].k_scale)
    c.calibrate(0, torch.full((2, 2, 16), 50.0), torch.full((2, 2, 16), 50.0))
    c.fit_scales(0, torch.full((2, 2, 16), 50.0), torch.full((2, 2, 16), 50.0), source="test")
    assert float(c.layers[0].k_scale) == fixed == pytest.approx(0.5 * FP8_SCALE_HEADROOM / FMAX)


def test_fixed_scales_end_calibration_and_must_be_positive():
    c = cache()
    c.set_scales(0, 0.01, 0.02)
    assert not c.needs_calibration and not c.calibrating
    with pytest.raises(ValueError, match="must be > 0"):
        c.set_scales(0, 0.0, 1.0)
