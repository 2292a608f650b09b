"""4-bit KV caches (fp4_e2m1, int4) in the engine: capacity at the same memory counting the
group scales, the cache layout, calibration growth (codes kept, group scales rescaled),
per-layer skips, errors, and generation on real SmolLM2 weights."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.kv_cache import FP8_SCALE_HEADROOM, PagedKVCache, bytes_per_block
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.metrics import EngineMetrics
from kvpilot.flags.serve import parse_layer_list
from kvpilot.kernels import reference as ref
from kvpilot.kernels.kv4 import GROUP_SCALE_MAX, KV4_FORMATS

CPU = torch.device("cpu")
KV4 = ["fp4_e2m1", "int4"]


def capacity_tokens(engine) -> float:
    metrics = EngineMetrics("m")
    metrics.set_config(engine)
    return metrics.registry.get_sample_value("kvpilot:kv_cache_capacity_tokens", {"model_name": "m"})


@pytest.mark.parametrize("kv_dtype", KV4)
def test_capacity_is_at_least_3_5x_bf16_at_the_same_memory(make_engine, kv_dtype):
    """SmolLM2 (head_dim 64): bf16 256 B per token, layer and KV head; 4-bit 2 x (32 codes +
    4 E4M3 scales) = 72 B, so 16 / 4.5 = 3.56x the tokens."""
    bf16 = capacity_tokens(make_engine(kv_cache_dtype="bfloat16", kv_cache_memory=0.05))
    kv4 = capacity_tokens(make_engine(kv_cache_dtype=kv_dtype, kv_cache_memory=0.05))
    assert kv4 / bf16 >= 3.5, (kv4, bf16)
    assert kv4 / bf16 == pytest.approx(16 / 4.5, rel=0.01)


def test_bytes_per_block_count_codes_scales_and_skipped_layers():
    # 30 layers, block 16, 3 KV heads, head_dim 64
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    assert bytes_per_block(30, 16, 3, 64, torch.uint8, "int4") == 2 * 30 * 16 * 3 * (32 + 4)
    assert bytes_per_block(30, 16, 3, 64, torch.uint8, "fp4_e2m1", (0, 29), torch.bfloat16) == (
        2 * 28 * 16 * 3 * (32 + 4) + 2 * 2 * 16 * 3 * 64 * 2
    )


def test_layout_codes_scales_and_skipped_layers():
    c = PagedKVCache(4, 8, 4, 2, 64, torch.uint8, CPU, act_dtype=torch.bfloat16, rotate_keys=True,
                     kv4="int4", skip_layers=(3, 0))
    assert c.skip_layers == (0, 3)
    assert c.storage.shape == (2, 2, 8, 4, 2, 32) and c.storage.dtype == torch.uint8
    assert c.group_scales.shape == (2, 2, 8, 4, 2, 4) and c.group_scales.dtype == torch.float8_e4m3fn
    for i in (0, 3):
        layer = c.layers[i]
        assert layer.key_cache.dtype == torch.bfloat16 and layer.key_cache.shape == (8, 4, 2, 64)
        assert layer.kv4_format is None and layer.key_rotation is None
    for i in (1, 2):
        layer = c.layers[i]
        assert layer.kv4_format == "int4" and layer.key_cache.shape == (8, 4, 2, 32)
        assert layer.key_group_scales.shape == (8, 4, 2, 4) and layer.key_rotation is not None
    assert c.needs_calibration
    x = torch.randn(3, 2, 64)
    for i in range(4):
        c.fit_scales(i, x, x, source="test")
    assert not c.needs_calibration  # skipped layers need no scales


@pytest.mark.parametrize("kv_dtype", KV4)
def test_calibration_growth_keeps_codes_and_rescales_group_scales(kv_dtype):
    """Live calibration (--calculate-kv-scales): a growth keeps the codes."""
    c = PagedKVCache(1, 4, 4, 1, 32, torch.uint8, CPU, kv4=kv_dtype, live=True)
    layer = c.layers[0]
    small = torch.linspace(-0.1, 0.1, 32).view(1, 1, 32)
    c.calibrate(0, small, small)
    qmax = KV4_FORMATS[kv_dtype].qmax
    assert float(layer.k_scale) == pytest.approx(0.1 * FP8_SCALE_HEADROOM / (qmax * GROUP_SCALE_MAX))
    ref.store_kv(small, small, layer.key_cache, layer.value_cache, torch.tensor([0]), layer.k_scale,
                 layer.v_scale, **layer.kv4)
    codes = layer.key_cache.clone()

    def read():
        return ref.read_blocks(layer.key_cache, torch.tensor([0]), torch.float32, layer.k_scale,
                               layer.key_group_scales, kv_dtype)[0, 0]

    before = read()
    c.calibrate(0, small * 100, small)
    assert float(layer.k_scale) > 50 * 0.1 * FP8_SCALE_HEADROOM / (qmax * GROUP_SCALE_MAX)
    assert torch.equal(layer.key_cache, codes)
    assert torch.equal(read(), before)


def test_skip_layers_errors_name_the_value_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"--kv-cache-skip-layers \[7\] out of range: the model has layers 0..3"):
        PagedKVCache(4, 8, 4, 2, 64, torch.uint8, CPU, kv4="int4", skip_layers=(7,))
    with pytest.raises(ValueError, match=r"needs a quantized --kv-cache-dtype .* got bfloat16"):
        PagedKVCache(4, 8, 4, 2, 64, torch.bfloat16, CPU, skip_layers=(1,))
    with pytest.raises(ValueError, match="must be layer indices >= 0"):
        EngineArgs(kv_cache_skip_layers=(-1,))
    assert parse_layer_list("0, 29,") == (0, 29)
    with pytest.raises(Exception, match="got 'x'"):
        parse_layer_list("0,x")


def test_head_dim_a_4bit_format_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"a fp4_e2m1 KV cache needs head_dim to be a multiple of 32 .* got 80"):
        PagedKVCache(1, 8, 4, 2, 80, torch.uint8, CPU, kv4="fp4_e2m1")


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", KV4)
def test_engine_generates_with_a_4bit_cache_and_skip_layers(make_engine, tokenizer, kv_dtype):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for skip in ((), (0,)):
        engine = make_engine(kv_cache_dtype=kv_dtype, kv_cache_memory=0.05, kv_cache_skip_layers=skip)
        assert engine.runner.kv_cache.skip_layers == skip
        engine.add_request("r", tokenizer.encode("The capital of France is"), params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[skip] = tokenizer.decode(o.output_token_ids)
    assert all("Paris" in text for text in outs.values()), outs


def test_checkpoint_fp8_scales_are_ignored_by_a_4bit_cache():
    c = PagedKVCache(2, 4, 4, 1, 32, torch.uint8, CPU, rotate_keys=True, kv4="int4")
    c.load_checkpoint_scales({0: (0.5, 0.25), 1: (0.5, 0.25)})
    assert c.needs_calibration and c.rotates_keys
    assert float(c.layers[0].k_scale) == 1.0


def test_cli_flags_parse_into_engine_args():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(
        parser.parse_args(["--kv-cache-dtype", "fp4_e2m1", "--kv-cache-skip-layers", "0,29"])
    )
    assert (args.kv_cache_dtype, args.kv_cache_skip_layers) == ("fp4_e2m1", (0, 29))
    assert EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "int4"])).kv_cache_skip_layers == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "nf4"])


def test_operator_crd_and_engine_accept_the_same_kv_cache_dtypes():
    from kvpilot.engine.config import KV_CACHE_DTYPES
    from kvpilot.operator.spec.engine import KV_CACHE_DTYPES as OPERATOR_DTYPES

    assert set(OPERATOR_DTYPES) == {"auto", *KV_CACHE_DTYPES}
