"""GGUF tensors kept quantized (engine/quantization/gguf.py and the GGUF loader): for each
of Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K, a tensor written into a GGUF file by the
``gguf`` package (quantized by gguf-py where it can; K-quant super-blocks packed here
from random valid fields, as gguf 0.19 only dequantizes those) and read back with
``GGUFReader`` converts to a weight whose values equal gguf-py's numpy dequantize, whose
product is ``x @ W.T``, whose rows reorder like the numpy un-permutation and whose bytes
stay within 1.15x of the file's; damaged tensors and other types are refused by name; and
the embedded SmolLM2 stays under 150 MiB."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvpilot.engine.model.loader import GGUFModelFile, unpermute_rope_rows  # noqa: E402
from kvpilot.engine.quantization import weights as weights_mod  # noqa: E402
from kvpilot.engine.quantization.gguf import (  # noqa: E402
    BLOCKS,
    KEPT_TYPES,
    GGUFBlockWeight,
    dequantize_blocks,
    file_bytes,
    gguf_tensor_weight,
    gguf_weight,
    scale_dtype,
)
from kvpilot.engine.quantization.weights import QuantizedWeightError, WNA16Weight, cat_rows  # noqa: E402

Q = gguf.GGMLQuantizationType
EXACT = ("Q8_0", "Q4_0", "Q4_1", "Q5_K", "Q6_K")  # float32-exact conversions (Q4_K rounds its scales)
RATIO = 1.15


def _fp16_bytes(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    sign = rng.choice([-1.0, 1.0], size=(n, 1)) if lo < 0 else 1.0
    v = np.exp(rng.uniform(np.log(abs(hi) / 50), np.log(abs(hi)), size=(n, 1))) * sign
    return v.astype(np.float16).view(np.uint8)


def k_quant_blocks(qtype: str, n_blocks: int, seed: int = 0, d_max: float = 2e-3) -> np.ndarray:
    """Random valid K-quant super-blocks, uint8 ``[n_blocks, block_bytes]``, laid out as
    ggml's ``block_q4_K`` / ``block_q5_K`` / ``block_q6_K`` (``ggml-common.h``): any bytes
    are valid codes and 6-bit scales; ``d`` (and ``dmin``) are finite fp16."""
    rng = np.random.default_rng(seed)
    rand = lambda k: rng.integers(0, 256, size=(n_blocks, k), dtype=np.uint8)  # noqa: E731
    if qtype == "Q4_K":  # d, dmin, scales[12], qs[128]
        parts = [_fp16_bytes(rng, n_blocks, 0, d_max), _fp16_bytes(rng, n_blocks, 0, d_max), rand(12), rand(128)]
    elif qtype == "Q5_K":  # d, dmin, scales[12], qh[32], qs[128]
        parts = [_fp16_bytes(rng, n_blocks, 0, d_max), _fp16_bytes(rng, n_blocks, 0, d_max), rand(12), rand(32),
                 rand(128)]
    else:  # Q6_K: ql[128], qh[64], scales[16] int8, d
        parts = [rand(128), rand(64), rand(16), _fp16_bytes(rng, n_blocks, -1, d_max)]
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == BLOCKS[qtype][1]
    return out


def quantized_bytes(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """An ``[n, k]`` weight as ``qtype`` blocks, uint8 ``[n, k // values * bytes]``:
    gguf-py's quantizer for Q8_0/Q4_0/Q4_1, random super-blocks for the K-quants."""
    bs, ts = BLOCKS[qtype]
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
        w[0, :32] += 0.3  # a block with a larger range
        return gguf.quants.quantize(w, Q[qtype])
    return k_quant_blocks(qtype, n * k // bs, seed).reshape(n, k // bs * ts)


def write_file(path: Path, tensors: dict[str, tuple[str, np.ndarray]], arch: str = "llama",
               meta: dict[str, int] | None = None) -> GGUFModelFile:
    """A GGUF file with ``name -> (type, data)`` (quantized data: uint8 byte rows; dense:
    the float array) and llama metadata ``meta``; opened with the engine's reader."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        getattr(w, f"add_{key}")(value)
    for name, (t, data) in tensors.items():
        if t in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=Q[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFModelFile(path)


N, K = 64, 512


@pytest.fixture(scope="module")
def gguf_tensors(tmp_path_factory):
    """One ``[64, 512]`` tensor per kept type, read back from a GGUF file."""
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    gf = write_file(path, {f"w_{t}": (t, quantized_bytes(t, N, K, seed=i)) for i, t in enumerate(KEPT_TYPES)})
    return {t: gf.tensors[f"w_{t}"] for t in KEPT_TYPES}


def reference(tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))


def q4k_rounding_bound(tensor) -> torch.Tensor:
    """Per value: how far Q4_K's 16-bit scale ``d * sc`` and offset ``dmin * m`` may move
    it (float16 rounding, 2**-11 relative), from gguf-py's own scale unpacking."""
    b = np.asarray(tensor.data).reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
    s, o = np.abs(d * sc.astype(np.float32)), np.abs(dmin * m.astype(np.float32))  # [blocks, 8]
    bound = 2.0 ** -11 * (15 * s + o) + 1e-12
    return torch.from_numpy(np.repeat(bound, 32, axis=1).reshape(N, K))


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_dequantize_equals_gguf(gguf_tensors, qtype):
    tensor = gguf_tensors[qtype]
    ref = reference(tensor)
    w = gguf_tensor_weight(tensor)
    assert (w.out_features, w.in_features) == (N, K)
    assert isinstance(w, GGUFBlockWeight if qtype in ("Q5_K", "Q6_K") else WNA16Weight)
    raw = gguf_tensor_weight(tensor, raw=True)  # the block form of every type: gguf-py's math in torch
    assert torch.equal(raw.dequantize(), ref)
    got = w.dequantize()
    if qtype in EXACT:
        assert torch.equal(got, ref)
    else:
        assert w.scales.dtype == torch.float16
        assert bool(((got - ref).abs() <= q4k_rounding_bound(tensor)).all())
    rows = torch.tensor([5, 0, 63, 5])
    assert torch.equal(w.dequantize(rows), got[rows])
    assert w.dequantize(rows, torch.bfloat16).dtype == torch.bfloat16


def test_torch_block_math_equals_gguf_on_random_blocks():
    """Every kept type's torch dequantize on random bytes (K-quants) and on gguf-py's
    quantizer output, block by block, bit for bit."""
    for qtype in KEPT_TYPES:
        blocks = quantized_bytes(qtype, 8, 256, seed=7).reshape(-1, BLOCKS[qtype][1])
        ref = gguf.quants.dequantize(blocks, Q[qtype])
        got = dequantize_blocks(torch.from_numpy(blocks.copy()), qtype)
        assert torch.equal(got.reshape(ref.shape), torch.from_numpy(ref)), qtype


def _close(y: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    err = float((y.float() - ref).norm() / ref.norm())
    assert err <= rtol, err


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_linear_equals_matmul_of_dequantized(gguf_tensors, qtype):
    w = gguf_tensor_weight(gguf_tensors[qtype])
    deq = w.dequantize()
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(N)
    ref = x @ deq.T + bias
    _close(w.linear(x, bias), ref, 1e-4)  # float32 dequantize-and-multiply
    _close(w.linear(x.bfloat16(), bias.bfloat16()), ref, 1e-2)
    # With the C++ CPU kernels the canonical layout serves (fp32); without them 4 bits take
    # torch's int4 kernel (bf16 activations and scales).
    p = w.prepare(torch.device("cpu"))
    packed = getattr(p, "_int4pack", None) is not None
    assert packed == (qtype in ("Q4_0", "Q4_1", "Q4_K") and not weights_mod._cpu_kernels())
    _close(p.linear(x, bias), ref, 1e-2 if packed else 1e-4)
    _close(p.dequantize(), deq, 1e-2)
    assert p.nbytes <= RATIO * file_bytes(qtype, (N, K))


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_select_rows_matches_numpy_unpermutation(gguf_tensors, qtype):
    heads = 4
    w = gguf_tensor_weight(gguf_tensors[qtype])
    perm = torch.from_numpy(unpermute_rope_rows(np.arange(N), heads).astype(np.int64))
    got = w.select_rows(perm).dequantize()
    want = torch.from_numpy(unpermute_rope_rows(w.dequantize().numpy(), heads))
    assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_resident_bytes_within_budget_of_the_file(gguf_tensors, qtype):
    tensor = gguf_tensors[qtype]
    w = gguf_tensor_weight(tensor)
    assert file_bytes(qtype, (N, K)) == tensor.n_bytes
    ratio = w.nbytes / tensor.n_bytes
    expected = {"Q8_0": 36 / 34, "Q4_0": 20 / 18, "Q4_1": 1.0, "Q4_K": 160 / 144, "Q5_K": 1.0, "Q6_K": 1.0}
    assert ratio == pytest.approx(expected[qtype]) and ratio <= RATIO


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_fused_projections_concatenate_rows(gguf_tensors, qtype):
    a = gguf_tensor_weight(gguf_tensors[qtype])
    b = a.select_rows(torch.arange(N - 1, -1, -1))
    fused = cat_rows([a, b], "qkv")
    assert fused.out_features == 2 * N
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_q4_k_scales_fall_back_to_bfloat16_when_float16_overflows():
    blocks = k_quant_blocks("Q4_K", 4 * 512 // 256, seed=3, d_max=3000.0)
    w = gguf_weight(blocks, "Q4_K", (4, 512), "big")
    assert isinstance(w, WNA16Weight) and w.scales.dtype == torch.bfloat16
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q4_K).reshape(4, 512))
    assert torch.isfinite(w.dequantize()).all()
    _close(w.dequantize(), ref, 2.0 ** -8)
    small = torch.tensor([1e-3, 0.5, -2.0])
    assert scale_dtype(small) == torch.float16
    assert scale_dtype(small, torch.tensor([7e4])) == torch.bfloat16


# ------------------------------------------------------------------ refusals
def test_bad_tensors_are_refused_by_name():
    q40 = quantized_bytes("Q4_0", 4, 64)
    with pytest.raises(QuantizedWeightError, match=r"^blk\.0\.attn_q\.weight: row length 48 is not a multiple "
                                                   r"of the Q4_0 block of 32"):
        gguf_weight(q40, "Q4_0", (4, 48), "blk.0.attn_q.weight")
    with pytest.raises(QuantizedWeightError, match=r"^t: 143 bytes do not match the shape \[1, 256\] as Q4_K: "
                                                   r"expected 144"):
        gguf_weight(k_quant_blocks("Q4_K", 1)[:, :143], "Q4_K", (1, 256), "t")
    with pytest.raises(QuantizedWeightError, match=r"^t: 144 bytes do not match the shape \[2, 256\]"):
        gguf_weight(k_quant_blocks("Q4_K", 1), "Q4_K", (2, 256), "t")
    with pytest.raises(QuantizedWeightError, match=r"^t: GGUF tensor type Q5_0 is not supported; quantized weights "
                                                   r"are served as Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"):
        gguf_weight(gguf.quants.quantize(np.zeros((2, 32), np.float32), Q.Q5_0), Q.Q5_0, (2, 32), "t")
    with pytest.raises(QuantizedWeightError, match=r"^t: shape \[2, 2, 32\]; a quantized GGUF weight must be 2-D"):
        gguf_weight(np.zeros((4, 18), np.uint8), "Q4_0", (2, 2, 32), "t")
    bad = k_quant_blocks("Q6_K", 4)
    bad[2, 208:210] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(QuantizedWeightError, match=r"^t: Q6_K block 0 of row 1 has a non-finite fp16 factor"):
        gguf_weight(bad.reshape(2, 420), "Q6_K", (2, 512), "t")
    with pytest.raises(QuantizedWeightError, match="row length 100 is not a multiple of the Q6_K block of 256"):
        GGUFBlockWeight(torch.zeros(2, 210, dtype=torch.uint8), "Q6_K", 100, "t")


# ------------------------------------------------------------------ the loader
HEADS, KV_HEADS, HIDDEN, FFN, VOCAB = 4, 2, 256, 512, 64
META = {"context_length": 128, "embedding_length": HIDDEN, "block_count": 1, "feed_forward_length": FFN,
        "head_count": HEADS, "head_count_kv": KV_HEADS, "layer_norm_rms_eps": 1e-5}
LAYOUT = {  # GGUF name -> (type, [N, K])
    "token_embd.weight": ("Q8_0", (VOCAB, HIDDEN)),
    "blk.0.attn_q.weight": ("Q4_K", (HIDDEN, HIDDEN)),
    "blk.0.attn_k.weight": ("Q4_0", (HIDDEN // 2, HIDDEN)),
    "blk.0.attn_v.weight": ("Q6_K", (HIDDEN // 2, HIDDEN)),
    "blk.0.attn_output.weight": ("Q5_K", (HIDDEN, HIDDEN)),
    "blk.0.ffn_gate.weight": ("Q4_1", (FFN, HIDDEN)),
    "blk.0.ffn_up.weight": ("Q4_1", (FFN, HIDDEN)),
    "blk.0.ffn_down.weight": ("Q4_K", (HIDDEN, FFN)),
    "output.weight": ("F16", (VOCAB, HIDDEN)),
}


def tiny_llama(path: Path, extra: dict[str, tuple[str, np.ndarray]] | None = None) -> GGUFModelFile:
    rng = np.random.default_rng(0)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for i, (name, (t, (n, k))) in enumerate(LAYOUT.items()):
        if t == "F16":
            tensors[name] = (t, rng.standard_normal((n, k)).astype(np.float16))
        else:
            tensors[name] = (t, quantized_bytes(t, n, k, seed=i))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        tensors[name] = ("F32", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    tensors.update(extra or {})
    gf = write_file(path, tensors, meta=META)
    gf.metadata["tokenizer.ggml.tokens.count"] = VOCAB  # no token list written: the vocabulary size
    return gf


def test_loader_yields_kept_types_quantized_and_the_rest_dense(tmp_path):
    gf = tiny_llama(tmp_path / "m.gguf")
    cfg = gf.model_config()
    quant = gf.quantization(cfg)
    assert quant.method == "gguf"
    assert quant.is_quantized("model.layers.0.self_attn.q_proj") and quant.is_quantized("model.embed_tokens")
    assert not quant.is_quantized("lm_head") and not quant.is_quantized("model.layers.0.input_layernorm")
    assert quant.weight_type("model.layers.0.self_attn.v_proj.weight") == "Q6_K"
    assert quant.type_counts() == {"F32": 3, "Q4_K": 2, "Q4_1": 2, "Q8_0": 1, "Q4_0": 1, "Q6_K": 1, "Q5_K": 1,
                                   "F16": 1}
    assert quant.summary() == ("gguf: 8 weights kept quantized (Q4_K x2, Q4_1 x2, Q8_0 x1, Q4_0 x1, Q6_K x1, "
                               "Q5_K x1); 4 dense (F32 x3, F16 x1)")
    kept = dict(gf.iter_weights(cfg))
    dense = dict(gf.iter_weights(cfg, keep_quantized=False))
    assert list(kept) == list(dense)
    file_total = resident = 0
    for hf, w in kept.items():
        ref = dense[hf]
        if isinstance(w, torch.Tensor):
            assert not quant.is_quantized(hf) and torch.equal(w, ref)
            continue
        assert quant.is_quantized(hf) and hf.endswith(".weight")
        t = quant.weight_type(hf)
        # q/k rows un-permuted like the dense path; Q4_K within its 16-bit scale rounding
        if t == "Q4_K":
            _close(w.dequantize(), ref, 2.0 ** -10)
        else:
            assert torch.equal(w.dequantize(), ref), hf
        file_total += file_bytes(t, (w.out_features, w.in_features))
        resident += w.nbytes
    assert resident <= RATIO * file_total


def test_loader_refuses_other_quantized_types_by_name(tmp_path):
    q50 = gguf.quants.quantize(np.zeros((HIDDEN, HIDDEN), np.float32), Q.Q5_0)
    gf = tiny_llama(tmp_path / "m.gguf", {"blk.0.attn_output.weight": ("Q5_0", q50)})
    cfg = gf.model_config()
    with pytest.raises(QuantizedWeightError, match=r"m\.gguf: tensor blk\.0\.attn_output\.weight: GGUF tensor "
                                                   r"type Q5_0 is not supported; .*Q8_0, Q4_0, Q4_1, Q4_K, "
                                                   r"Q5_K, Q6_K"):
        next(gf.iter_weights(cfg))
    dense = dict(gf.iter_weights(cfg, keep_quantized=False))  # the dequantizing path still reads it
    assert dense["model.layers.0.self_attn.o_proj.weight"].shape == (HIDDEN, HIDDEN)


def test_moe_routers_stay_dense(tmp_path):
    router = quantized_bytes("Q8_0", 4, HIDDEN)
    gf = tiny_llama(tmp_path / "m.gguf", {"blk.0.ffn_gate_inp.weight": ("Q8_0", router)})
    cfg = gf.model_config()
    quant = gf.quantization(cfg)
    assert not quant.is_quantized("model.layers.0.mlp.gate")
    assert quant.summary().endswith("; 1 quantized tensors dequantized to float32 (MoE experts, routers)")
    weights = dict(gf.iter_weights(cfg))
    assert torch.equal(weights["model.layers.0.mlp.gate.weight"],
                       torch.from_numpy(gguf.quants.dequantize(router, Q.Q8_0)))


def test_big_endian_files_are_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_tensor("token_embd.weight", quantized_bytes("Q8_0", 4, 64), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = GGUFModelFile(tmp_path / "be.gguf")
    with pytest.raises(QuantizedWeightError, match=r"^be\.gguf: a big-endian GGUF file"):
        gf.quantization()  # before the config is read


# --------------------------------------------------------- the embedded model
@pytest.mark.slow  # reads the embedded model file (98 MB)
def test_embedded_model_stays_quantized_under_150_mib():
    from kvpilot.engine.model.loader import embedded_model_path

    gf = GGUFModelFile(embedded_model_path())
    cfg = gf.model_config()
    quant = gf.quantization(cfg)
    assert quant.type_counts() == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert quant.weight_type("model.embed_tokens") == "Q8_0"  # the token embedding stays quantized too
    resident = 0
    for hf, w in gf.iter_weights(cfg):
        assert isinstance(w, torch.Tensor) != quant.is_quantized(hf), hf
        resident += w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
    file_total = sum(t.n_bytes for t in gf.reader.tensors)
    assert resident < 150 * 2**20
    assert resident <= RATIO * file_total
    for name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.29.attn_v.weight"):
        tensor = gf.tensors[name]
        w = gguf_tensor_weight(tensor)
        rows = torch.tensor([0, 17, w.out_features - 1])
        assert torch.equal(w.dequantize(rows), reference(tensor)[rows]), name
