"""The quantized layouts' products and the checkpoint config reader, without a model.

- Each layout's CPU product (the C++ WNA16 GEMM, or torch's int4/int8 weight-only kernels
  after ``prepare`` where the C++ kernels do not load, the int32 product of INT8 W8A8, the
  dequantize-a-tile path) against ``x @ W.T`` of the dequantized matrix computed here
  independently, in float64: within what the compute dtype allows (bf16 activations and
  scales on the int4/int8 kernels: 1e-2 relative; the C++ GEMM and fp32 tiles: 1e-5).
- ``quantization_config`` values outside the supported formats are refused naming the
  key and value; ``--quantization`` that contradicts the checkpoint is refused.
- A quantized module missing a part, or a part whose shape does not fit, is refused
  naming the tensor.

The end-to-end checks (real checkpoints written by compressed-tensors, transformers as
the reference) are in test_quantized_checkpoints.py.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.model.config import UnsupportedModelError
from kvpilot.engine.quantization import weights as weights_mod
from kvpilot.engine.quantization.checkpoint import convert, group_quantized
from kvpilot.engine.quantization.config import LinearScheme, read_quantization
from kvpilot.engine.quantization.weights import (
    FloatWeight,
    FP8Weight,
    Int8Weight,
    QuantizedWeightError,
    StackedWeight,
    WNA16Weight,
    cat_rows,
    quantize_fp8_rows,
    quantize_int8_rows,
)

CPU = torch.device("cpu")


def _wna16(n: int, k: int, bits: int, group: int, seed: int = 0, asym: bool = True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    s = torch.rand(n, k // group, generator=gen) * 0.05 + 0.01
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=gen).float() if asym else \
        torch.full((n, k // group), float(1 << (bits - 1)))
    o = -zero * s
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)) if bits == 4 else q
    dense = (q.double().view(n, -1, group) * s.double()[..., None] + o.double()[..., None]).view(n, k)
    return WNA16Weight(packed.contiguous(), s, o, bits, group, k), dense


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("n,k,bits,group", [(128, 256, 4, 32), (192, 128, 4, 128), (96, 64, 4, 64),
                                            (80, 64, 4, 32), (64, 96, 8, 96), (48, 64, 8, 32), (32, 48, 4, 48)])
def test_wna16_products_match_the_dequantized_matrix(n, k, bits, group):
    """Before and after ``prepare(cpu)``; ``N`` = 80 is not a multiple of 16 (no int4 pack),
    96 not of 64 (the packed rows are recovered through the kernel), 48 a group torch's
    int4 kernel does not take (the tiled path)."""
    w, dense = _wna16(n, k, bits, group)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    want = x.double() @ dense.T
    assert _rel(w.linear(x), want) < 1e-5  # fp32 tiles
    assert torch.allclose(w.dequantize().double(), dense, atol=1e-6)
    p = w.prepare(CPU)
    assert _rel(p.linear(x), want) < 1e-2  # bf16 activations and scales
    rows = torch.tensor([0, n - 1, n // 2, 3])
    assert _rel(p.dequantize(rows), dense[rows]) < 1e-2
    # prepare() never changes the canonical weight it came from
    assert _rel(w.linear(x), want) < 1e-5
    assert p.nbytes <= w.nbytes * 1.15


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, 256), (4, 128)])
def test_wna16_on_cpu_keeps_the_canonical_layout_for_the_cpp_gemm(bits, group, monkeypatch):
    """Where the C++ CPU kernels load, ``prepare`` keeps the canonical tensors and
    ``linear`` runs the exact fp32 GEMM up to ``SMALL_M`` rows (a row's bits do not depend
    on its batch); more rows take the fp32 tiles, bf16 activations give bf16 back, and
    the embedding lookup still dequantizes rows."""
    if not weights_mod._cpu_kernels():
        pytest.skip("the C++ CPU kernels do not build here")
    w, dense = _wna16(80, 256, bits, group)  # 80 rows: no multiple of 16 or 64
    p = w.prepare(CPU)
    assert isinstance(p, WNA16Weight) and p._int4pack is None and p._int8 is None
    assert p.nbytes == w.nbytes
    import kvpilot.kernels.cpu_quant_gemm as gemm_mod

    calls = []
    real = gemm_mod.wna16_gemm
    monkeypatch.setattr(gemm_mod, "wna16_gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(80)
    want = x.double() @ dense.T
    full = p.linear(x)
    assert _rel(full, want) < 1e-5 and calls == [9]
    assert torch.equal(p.linear(x[4:5]), full[4:5])
    assert _rel(p.linear(x, bias), want + bias.double()) < 1e-5
    got = p.linear(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and _rel(got, x.to(torch.bfloat16).double() @ dense.T) < 1e-2
    rows = torch.tensor([0, 79, 40])
    assert torch.allclose(p.dequantize(rows).double(), dense[rows], atol=1e-6)
    monkeypatch.setattr(weights_mod, "SMALL_M", 8)
    calls.clear()
    assert _rel(p.linear(x), want) < 1e-5 and calls == []  # 9 rows > 8: the fp32 tiles


def test_wna16_without_the_cpu_kernels_uses_torchs_kernels(monkeypatch):
    """No compiler and nothing prebuilt: ``prepare`` repacks for torch's int4/int8
    kernels as before (bf16 activations and scales)."""
    monkeypatch.setattr(weights_mod, "_cpu_kernels", lambda: False)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    for bits, group, packed in ((4, 32, "_int4pack"), (8, 256, "_int8")):
        w, dense = _wna16(64, 256, bits, group)
        p = w.prepare(CPU)
        assert getattr(p, packed) is not None and p.qweight.numel() == 0
        assert _rel(p.linear(x), x.double() @ dense.T) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernels", [True, False])
def test_float_weight_is_read_as_stored(dtype, kernels, monkeypatch):
    """An unquantized head kept as the checkpoint stores it: the lookup widens the rows
    exactly, the product is fp32 (the C++ GEMM, or fp32 tiles without it, and beyond
    SMALL_M rows), its bytes are the stored ones, and rows join by ``cat``."""
    if kernels and not weights_mod._cpu_kernels():
        pytest.skip("no C++ toolchain for the CPU kernels here")
    monkeypatch.setattr(weights_mod, "_cpu_kernels", lambda: kernels)
    gen = torch.Generator().manual_seed(3)
    stored = torch.randn(96, 64, generator=gen).to(dtype)
    w = FloatWeight(stored, "lm_head.weight").prepare(CPU)
    assert w.nbytes == stored.numel() * stored.element_size() and w.format in ("fp32", "bf16", "fp16")
    rows = torch.tensor([0, 95, 7])
    assert torch.equal(w.dequantize(rows), stored[rows].float())
    x = torch.randn(5, 64, generator=gen)
    assert _rel(w.linear(x), x.double() @ stored.double().T) < 1e-5
    bias = torch.randn(96, generator=gen)
    assert _rel(w.linear(x, bias), x.double() @ stored.double().T + bias.double()) < 1e-5
    monkeypatch.setattr(weights_mod, "SMALL_M", 2)
    assert _rel(w.linear(x), x.double() @ stored.double().T) < 1e-5
    joined = cat_rows([w, FloatWeight(stored[:8].clone())], "joined")
    assert isinstance(joined, FloatWeight) and joined.out_features == 104


def test_float_weight_refuses_other_dtypes_by_name():
    message = "embed.weight: weight torch.float64 \\(4, 8\\); expected float32"
    with pytest.raises(QuantizedWeightError, match=message):
        FloatWeight(torch.zeros(4, 8, dtype=torch.float64), "embed.weight")


def test_wna16_act_order_permutes_the_input():
    w, dense = _wna16(64, 128, 4, 32)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(3))
    wp = WNA16Weight(w.qweight, w.scales, w.offsets, 4, 32, 128, perm)
    x = torch.randn(5, 128)
    want = x[:, perm].double() @ dense.T
    assert _rel(wp.linear(x), want) < 1e-5
    assert _rel(wp.prepare(CPU).linear(x), want) < 1e-2


def test_wna16_rejects_shapes_that_do_not_fit():
    w, _ = _wna16(32, 64, 4, 32)
    with pytest.raises(QuantizedWeightError, match=r"group size 48 does not divide the input dimension 64"):
        WNA16Weight(w.qweight, w.scales, w.offsets, 4, 48, 64, name="m.weight")
    with pytest.raises(QuantizedWeightError, match=r"m.weight: scales shape \(32, 1\) does not match"):
        WNA16Weight(w.qweight, w.scales[:, :1], w.offsets, 4, 32, 64, name="m.weight")


def test_fused_parts_join_by_rows_and_mixed_formats_stack():
    """Same-format parts become one matrix; a part in another format (a GGUF Q4_K_M
    file's Q6_K attn_v) is multiplied by its own kernel into its columns."""
    a, da = _wna16(32, 64, 4, 32, seed=1)
    b, db = _wna16(16, 64, 4, 32, seed=2)
    joined = cat_rows([a, b], "qkv")
    assert isinstance(joined, WNA16Weight) and joined.out_features == 48
    x = torch.randn(3, 64)
    assert _rel(joined.linear(x), x.double() @ torch.cat([da, db]).T) < 1e-5
    c, dc = _wna16(16, 64, 8, 64, seed=3)
    mixed = cat_rows([a, b, c], "qkv")
    assert isinstance(mixed, StackedWeight) and [p.out_features for p in mixed.parts] == [48, 16]
    dense = torch.cat([da, db, dc])
    bias = torch.randn(64)
    assert _rel(mixed.linear(x, bias), x.double() @ dense.T + bias.double()) < 1e-5
    assert _rel(mixed.prepare(CPU).linear(x), x.double() @ dense.T) < 1e-2
    rows = torch.tensor([63, 0, 40, 50])
    assert torch.allclose(mixed.dequantize(rows).double(), dense[rows], atol=1e-6)
    assert mixed.nbytes == a.nbytes + b.nbytes + c.nbytes
    wide, _ = _wna16(16, 128, 4, 32, seed=4)
    with pytest.raises(QuantizedWeightError, match="qkv: parts with 64 and 128 input columns"):
        cat_rows([a, wide], "qkv")


def test_fp8_weights_per_channel_and_block():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen)
    s = w.abs().amax(-1) / 448
    q = (w / s[:, None]).to(torch.float8_e4m3fn)
    deq = q.double() * s.double()[:, None]
    x = torch.randn(4, 300, generator=gen)
    only = FP8Weight(q, s, act="none")  # W8A16: x exact
    assert _rel(only.linear(x), x.double() @ deq.T) < 1e-5
    dyn = FP8Weight(q, s, act="dynamic")
    xq, xs = quantize_fp8_rows(x)
    assert _rel(dyn.linear(x), (xq.double() * xs.double()) @ deq.T) < 1e-5
    # 128x128 blocks over a shape that is not a multiple of the block
    bs = torch.rand(2, 3, generator=gen) * 0.01 + 1e-3
    blk = FP8Weight(q, bs, act="none", block=(128, 128))
    full = bs.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.allclose(blk.dequantize().double(), q.double() * full.double())
    with pytest.raises(QuantizedWeightError, match=r"weight_scale shape \(2, 2\) does not match the weight"):
        FP8Weight(q, bs[:, :2], act="none", block=(128, 128))


def test_int8_w8a8_accumulates_exactly():
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (64, 96), generator=gen, dtype=torch.int8)
    s = torch.rand(64, generator=gen) * 0.01
    x = torch.randn(5, 96, generator=gen)
    xq, xs = quantize_int8_rows(x)
    want = (xq.double() @ w.double().T) * xs.double() * s.double()[None]
    assert _rel(Int8Weight(w, s).linear(x), want) < 1e-6
    static = Int8Weight(w, s, act="static", input_scale=0.02)
    xq2 = torch.round(x / 0.02).clamp(-128, 127)
    assert _rel(static.linear(x), (xq2.double() @ w.double().T) * 0.02 * s.double()[None]) < 1e-6


# ------------------------------------------------------------------------- config
def _ct(weights: dict, acts: dict | None = None, fmt: str = "pack-quantized", **top):
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                  "input_activations": acts}}, **top}}


W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
FP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
FP8_A = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def test_compressed_tensors_schemes_per_module():
    q = read_quantization(_ct(W4), "c.json")
    assert q is not None and q.method == "compressed-tensors"
    assert q.scheme_for("model.layers.0.self_attn.q_proj") == LinearScheme("wna16", 4, 128, True)
    assert q.scheme_for("lm_head") is None
    fp8 = read_quantization(_ct(FP8_W, FP8_A, "float-quantized"), "c.json")
    assert fp8 is not None
    assert fp8.scheme_for("model.layers.1.mlp.down_proj") == LinearScheme("fp8", 8, act="dynamic")


@pytest.mark.parametrize("cfg,message", [
    ({"quantization_config": {"quant_method": "bitsandbytes"}},
     "quantization_config.quant_method = 'bitsandbytes' is not supported"),
    (_ct(W4, fmt="nvfp4-pack-quantized"), "quantization_config.format = 'nvfp4-pack-quantized'"),
    (_ct({**W4, "num_bits": 2}), "config_groups.group_0.weights.num_bits = 2"),
    (_ct({**W4, "strategy": "tensor_group"}), "config_groups.group_0.weights.strategy = 'tensor_group'"),
    (_ct({**W4, "group_size": 0}), "config_groups.group_0.weights.group_size = 0"),
    (_ct(FP8_W, {**FP8_A, "symmetric": False}, "float-quantized"),
     "config_groups.group_0.input_activations.symmetric = False"),
    (_ct(W4, sparsity_config={"format": "sparse-24-bitmask"}), "quantization_config.sparsity_config"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 3, "group_size": 128}},
     "quantization_config.bits = 3"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}},
     "quantization_config.version = 'gemv'"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                              "weight_block_size": [128, 128]}}, "quantization_config.activation_scheme = 'static'"),
])
def test_unsupported_quantization_configs_are_refused_by_name(cfg, message):
    with pytest.raises(UnsupportedModelError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        read_quantization(cfg, "/m/config.json")
    assert "/m/config.json" in str(info.value)


def test_quantization_flag_checks_the_checkpoint():
    with pytest.raises(UnsupportedModelError, match="--quantization awq does not match"):
        read_quantization(_ct(W4), "c.json", "awq")
    with pytest.raises(UnsupportedModelError, match="only fp8 quantizes an unquantized checkpoint"):
        read_quantization({}, "c.json", "gptq")
    with pytest.raises(UnsupportedModelError, match="--quantization 'int3' is not supported"):
        read_quantization({}, "c.json", "int3")
    online = read_quantization({}, "c.json", "fp8")
    assert online is not None and online.online and online.scheme_for("lm_head") is None
    assert read_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
                             "c.json", "gptq_marlin") is not None
    assert read_quantization({}, "c.json") is None


def test_a_missing_part_or_a_wrong_shape_is_refused_naming_the_tensor():
    q = read_quantization(_ct(W4), "c.json")
    assert q is not None
    mod = "model.layers.0.self_attn.q_proj"
    packed = torch.zeros(8, 128 * 4 // 32, dtype=torch.int32)
    parts = [(f"{mod}.weight_packed", packed), (f"{mod}.weight_shape", torch.tensor([8, 128]))]
    with pytest.raises(QuantizedWeightError, match=rf"{mod}.weight_scale: missing from the checkpoint"):
        list(group_quantized(iter(parts), q, {mod}))
    scheme = q.scheme_for(mod)
    assert scheme is not None
    bad = {"weight_packed": packed, "weight_shape": torch.tensor([8, 128]), "weight_scale": torch.ones(8, 2)}
    with pytest.raises(QuantizedWeightError, match=rf"{mod}.weight_scale: shape \(8, 2\) does not match"):
        convert(mod, bad, scheme)
    # a norm's weight of the same module prefix family passes through untouched
    norm = ("model.layers.0.input_layernorm.weight", torch.ones(128))
    assert list(group_quantized(iter([norm]), q, {mod})) == [norm]


def test_gptq_and_awq_packing_read_as_the_formats_define():
    """Pack codes by the formats' own rules here (GPTQ: along K, low bits first, zeros
    stored minus one; AWQ: along N in the order 0 2 4 6 1 3 5 7) and read them back."""
    gen = torch.Generator().manual_seed(0)
    k, n, g = 64, 16, 32
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)  # [K, N] as GPTQ/AWQ index it
    z = torch.randint(1, 15, (k // g, n), generator=gen, dtype=torch.int32)
    s = (torch.rand(k // g, n, generator=gen) * 0.1).half()
    dense = ((q - z.repeat_interleave(g, 0)).double() * s.double().repeat_interleave(g, 0)).T  # [N, K]

    def pack_rows(v: torch.Tensor) -> torch.Tensor:  # along dim 0, 8 per int32
        v = v.view(-1, 8, v.shape[1])
        return sum(v[:, i].to(torch.int64) << (4 * i) for i in range(8)).to(torch.int32)

    def pack_cols(v: torch.Tensor, order=range(8)) -> torch.Tensor:
        v = v.view(v.shape[0], -1, 8)
        return sum(v[..., o].to(torch.int64) << (4 * i) for i, o in enumerate(order)).to(torch.int32)

    gptq = LinearScheme("wna16", 4, g, False, layout="gptq")
    w = convert("m", {"qweight": pack_rows(q), "qzeros": pack_cols(z - 1), "scales": s}, gptq)
    assert torch.allclose(w.dequantize().double(), dense, atol=1e-3)
    awq = LinearScheme("wna16", 4, g, False, layout="awq")
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    w = convert("m", {"qweight": pack_cols(q, order), "qzeros": pack_cols(z, order), "scales": s}, awq)
    assert torch.allclose(w.dequantize().double(), dense, atol=1e-3)
    with pytest.raises(QuantizedWeightError, match=r"m.scales: shape \(3, 16\) does not match qweight"):
        convert("m", {"qweight": pack_rows(q), "qzeros": pack_cols(z - 1), "scales": s[:1].repeat(3, 1)}, gptq)
