"""The fused CPU layer ops (C++) against the torch reference ops they replace: RMSNorm
with and without the residual add, rotary embedding in place on strided views of a fused
QKV output, SiLU-and-mul; fp32, bf16 and fp16; odd widths; batch invariance; bad input
refused by the kernel, not read out of bounds."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.model.config import ModelConfig
from kvpilot.engine.model.layer_ops import CpuLayerOps, TorchLayerOps
from kvpilot.engine.model.rotary import RotaryEmbedding
from kvpilot.kernels import cpu_attention

ok, why = cpu_attention.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the CPU kernels here: {why}")

REF, CPU = TorchLayerOps(), (CpuLayerOps() if ok else None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: a few ulp (different summation order, no fused multiply-add in torch);
# bf16/fp16: one unit in the last place of the model dtype where a rounding lands apart.
TOL = {torch.float32: (2e-6, 2e-6), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def config(num_heads: int, num_kv_heads: int) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=100, hidden_size=64 * num_heads, intermediate_size=64,
                       num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096, 37])
def test_rms_norm_and_the_fused_residual_add_match_torch(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(23, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(23, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    close(CPU.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), dtype)

    expect_norm, expect_res = REF.add_rms_norm(x, res, w, 1e-6)
    xc, rc = x.clone(), res.clone()
    got_norm, got_res = CPU.add_rms_norm(xc, rc, w, 1e-6)
    assert got_norm.data_ptr() == xc.data_ptr() and got_res.data_ptr() == rc.data_ptr()  # in place
    assert torch.equal(got_res, expect_res)  # the add is one rounding in both
    close(got_norm, expect_norm, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_fused_qkv_output_matches_torch(dtype):
    cfg = config(num_heads=4, num_kv_heads=2)
    rope = RotaryEmbedding(cfg, 4096, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    q_size, kv_size = 4 * 64, 2 * 64
    qkv = torch.randn(9, q_size + 2 * kv_size, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 4095, 17, 17, 900, 5])
    q, k, v = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
    expect_q, expect_k = REF.rotary(q.reshape(9, 4, 64), k.reshape(9, 2, 64),
                                    REF.rotary_tables(rope, positions, dtype))
    buf = qkv.clone()
    q, k, v = buf.split([q_size, kv_size, kv_size], dim=-1)
    got_q, got_k = CPU.rotary(q.view(9, 4, 64), k.view(9, 2, 64), CPU.rotary_tables(rope, positions, dtype))
    assert got_q.data_ptr() == buf.data_ptr()  # rotated where the projection wrote them
    close(got_q, expect_q, dtype)
    close(got_k, expect_k, dtype)
    assert torch.equal(v, qkv[:, q_size + kv_size:])  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 19])
def test_silu_and_mul_matches_torch_over_the_whole_range(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(11, 2 * inter, generator=g) * 8).to(dtype)
    x[0, :6] = torch.tensor([-200.0, -90.0, -87.5, 0.0, 88.5, 200.0]).to(dtype)  # beyond exp's range
    got = CPU.silu_and_mul(x)
    assert got.shape == (11, inter) and got.dtype == dtype
    close(got, REF.silu_and_mul(x), dtype)
    assert torch.isfinite(got.float()).all()


def test_a_token_gives_the_same_bits_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(7)
    x, res = torch.randn(64, 576, generator=g), torch.randn(64, 576, generator=g)
    w = torch.rand(576, generator=g)
    full = CPU.add_rms_norm(x.clone(), res.clone(), w, 1e-5)[0]
    for rows in (slice(5, 6), slice(0, 3), slice(40, 64)):
        part = CPU.add_rms_norm(x[rows].clone(), res[rows].clone(), w, 1e-5)[0]
        assert torch.equal(part, full[rows])
    gate_up = torch.randn(64, 2 * 1536, generator=g)
    assert torch.equal(CPU.silu_and_mul(gate_up[10:12]), CPU.silu_and_mul(gate_up)[10:12])


def test_bad_input_is_refused_by_the_kernel():
    from kvpilot.kernels import cpu_layer_ops

    cfg = config(num_heads=2, num_kv_heads=2)
    rope = RotaryEmbedding(cfg, 16, torch.device("cpu"))
    q, k = torch.zeros(2, 2, 64), torch.zeros(2, 2, 64)
    with pytest.raises(RuntimeError, match="position 16 outside the table"):
        cpu_layer_ops.rotary_embedding(torch.tensor([0, 16]), q, k, rope.cos, rope.sin)
    with pytest.raises(RuntimeError, match=r"dtype .* is not one of float32, bfloat16, float16"):
        cpu_layer_ops.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        cpu_layer_ops.rms_norm(torch.zeros(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_layer_ops.silu_and_mul(torch.zeros(8, 4).t())
