"""The torch paged-attention reference against dense attention on contiguous K/V.

Random varlen batches mixing decodes and prefill chunks that start and end mid-block,
random (non-contiguous) block tables, GQA groups 1/3/4, block sizes 1/4/16, fp32 and bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.kernels import reference as ref


def dense_attention(q, k, v, scale):
    """q [n, H, D] at the last n positions of k/v [L, Hkv, D]; causal."""
    n, h, _ = q.shape
    L, hkv, _ = k.shape
    g = h // hkv
    k = k.repeat_interleave(g, dim=1).float()
    v = v.repeat_interleave(g, dim=1).float()
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    qpos = torch.arange(L - n, L)[:, None]
    scores = scores.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def build_batch(seed, seq_specs, num_kv_heads, group, head_dim, block_size, dtype):
    """seq_specs: [(context_len_before, new_tokens)]. Returns everything paged_attention needs
    plus the per-sequence contiguous K/V for the oracle."""
    g = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    total_blocks = sum(math.ceil((c + n) / block_size) for c, n in seq_specs) + 3
    perm = torch.randperm(total_blocks, generator=g).tolist()
    kc = torch.zeros(total_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    tables, seq_lens, qsl, qs, seqs_kv = [], [], [0], [], []
    new_k, new_v, slots = [], [], []
    for ctx, n in seq_specs:
        L = ctx + n
        nb = math.ceil(L / block_size)
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks)
        k = torch.randn(L, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(L, num_kv_heads, head_dim, generator=g).to(dtype)
        seqs_kv.append((k, v))
        for p in range(L):
            slot = blocks[p // block_size] * block_size + p % block_size
            if p < ctx:  # already cached
                kc.view(-1, num_kv_heads, head_dim)[slot] = k[p]
                vc.view(-1, num_kv_heads, head_dim)[slot] = v[p]
            else:  # written by store_kv this step
                new_k.append(k[p])
                new_v.append(v[p])
                slots.append(slot)
        qs.append(torch.randn(n, num_heads, head_dim, generator=g).to(dtype))
        seq_lens.append(L)
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return {
        "q": torch.cat(qs),
        "new_k": torch.stack(new_k),
        "new_v": torch.stack(new_v),
        "slots": torch.tensor(slots, dtype=torch.int64),
        "kc": kc,
        "vc": vc,
        "bt": bt,
        "qsl": torch.tensor(qsl, dtype=torch.int32),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "seqs_kv": seqs_kv,
        "qs": qs,
    }


SPECS = [
    [(0, 1)],  # sequence length 1
    [(5, 1), (17, 1), (0, 9), (6, 11)],  # decodes + a fresh prefill + a mid-block chunk
    [(31, 1), (3, 5), (16, 16), (0, 1)],
]


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("spec_idx", range(len(SPECS)))
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_paged_attention_matches_dense(group, block_size, spec_idx, dtype, tol):
    head_dim = 32
    b = build_batch(spec_idx * 100 + group, SPECS[spec_idx], 2, group, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    ref.store_kv(b["new_k"], b["new_v"], b["kc"], b["vc"], b["slots"])
    out = ref.paged_attention(b["q"], b["kc"], b["vc"], b["bt"], b["qsl"], b["seq_lens"], scale)
    assert out.shape == b["q"].shape and out.dtype == dtype
    start = 0
    for (k, v), q in zip(b["seqs_kv"], b["qs"]):
        expect = dense_attention(q, k, v, scale)
        got = out[start : start + q.shape[0]].float()
        torch.testing.assert_close(got, expect, atol=tol, rtol=tol)
        start += q.shape[0]


def test_store_kv_skips_negative_slots():
    kc = torch.zeros(2, 4, 1, 2)
    vc = torch.zeros_like(kc)
    k = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    ref.store_kv(k, -k, kc, vc, torch.tensor([5, -1, 0]))
    flat = kc.view(-1, 1, 2)
    assert flat[5].tolist() == [[1.0, 2.0]] and flat[0].tolist() == [[5.0, 6.0]]
    assert int((flat != 0).any(-1).sum()) == 2
    assert vc.view(-1, 1, 2)[5].tolist() == [[-1.0, -2.0]]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_quantize_clamps_instead_of_overflowing_to_nan(fp8):
    fmax = torch.finfo(fp8).max
    x = torch.tensor([0.0, 1.0, -3.5, fmax * 10, -fmax * 10])
    q = ref.quantize(x, fp8, torch.tensor(1.0))
    back = ref.dequantize(q, torch.float32, torch.tensor(1.0))
    assert torch.isfinite(back).all()
    assert back[3] == fmax and back[4] == -fmax
    scaled = ref.dequantize(ref.quantize(x[:3], fp8, torch.tensor(0.5)), torch.float32, torch.tensor(0.5))
    torch.testing.assert_close(scaled, x[:3], atol=0.0, rtol=0.13)


def test_fp8_paged_attention_close_to_full_precision():
    head_dim = 64
    b = build_batch(7, [(40, 1), (10, 7)], 3, 3, head_dim, 16, torch.float32)
    scale = head_dim**-0.5
    ref.store_kv(b["new_k"], b["new_v"], b["kc"], b["vc"], b["slots"])
    full = ref.paged_attention(b["q"], b["kc"], b["vc"], b["bt"], b["qsl"], b["seq_lens"], scale)
    k_scale = b["kc"].abs().max() * 2 / 448
    v_scale = b["vc"].abs().max() * 2 / 448
    kq = ref.quantize(b["kc"], torch.float8_e4m3fn, k_scale)
    vq = ref.quantize(b["vc"], torch.float8_e4m3fn, v_scale)
    out = ref.paged_attention(b["q"], kq, vq, b["bt"], b["qsl"], b["seq_lens"], scale, k_scale, v_scale)
    assert torch.isfinite(out).all()
    rel = (out - full).norm() / full.norm()
    assert rel < 0.06
