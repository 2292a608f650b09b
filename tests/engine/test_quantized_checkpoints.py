"""Quantized checkpoints (compressed-tensors, GPTQ, AWQ) through the engine, against
references computed from what the quantization libraries wrote.

Fixtures: tests/engine/quant_fixtures.py (its docstring lists every scheme, the tensors
each writes and what transformers does with them). Cases (:data:`CASES`): every
compressed-tensors scheme on Llama; FP8 dynamic, INT8 W8A8, W4A16 asymmetric and W8A16 on
Qwen3; FP8 W8A8 (dynamic and static), FP8 W8A16 and W4A16 Mixtral with every expert
quantized (as llm-compressor writes Mixtral) and FP8 W8A8 of its attention alone (experts
ignored);
GPTQ v1 4 and 8 bits with ``desc_act`` false and true; AWQ GEMM 4 bits. Models: two
layers, hidden 128, intermediate 256, vocabulary 256, fp32.

For each case:

- the dequantized weights the engine holds equal the reference model's (exactly, or to
  bf16's rounding of the scales where the engine serves them from torch's bf16 kernels);
- teacher-forced log-probabilities (:func:`kvpilot.engine.scoring.score_tokens`, chunks of
  5 through the paged cache) of a 40-token sequence within the case's tolerance of the
  reference's ``log_softmax`` at every position (max) and on average (mean);
- greedy continuations (3 prompts, 16 tokens) equal to transformers' ``generate()`` through
  chunked prefill (8-token budget), preemption (14 blocks) and prefix-cache hits;
- resident weight bytes within the bound of :func:`test_resident_weight_bytes`.

Reference: transformers' ``from_pretrained`` of the folder (compressed-tensors), or
transformers' forward of the dense model holding the dequantized weights (GPTQ, AWQ, the
act-order fixture). Two deliberate deviations, both measured:

- INT8 W8A8: compressed-tensors' simulation quantizes each token with ``s = amax / 127.5``
  (its symmetric range 255 / 2), which puts the token's largest element on a rounding tie
  (``+-127.5``): transformers' own fp32 and fp64 runs then differ by up to 0.39 (mean
  0.039) in log-probability. vLLM's ``scaled_int8_quant`` (and the engine) use
  ``s = amax / 127``, with no tie; the two rules differ by 0.75 (mean 0.089), as much as
  the whole quantization (0.81 against the dense model). The reference uses vLLM's rule on
  transformers' decompressed weights (fp64 against fp32: 0.055, mean 4.5e-4);
  :func:`test_int8_reference_rule` keeps those numbers honest.
- Mixtral's FP8 W8A8 experts: transformers dequantizes them at load and simulates no
  activation quantization there; the reference adds compressed-tensors' fake quantization
  of each expert's inputs (see the fixtures' docstring).

Tolerance, per case, measured at test time from the reference against itself in another
dtype (the numbers below are this suite's, torch 2.15 on CPU):

- products the engine computes in fp32 (FP8, INT8, 8-bit weights with several groups per
  row): ``max(1e-3, 2 x max|ref_fp64 - ref_fp32|)`` (mean: ``max(1e-4, 2 x mean)``).
  Measured spreads: FP8 dynamic, FP8 W8A16 and W8A16 below 5e-4 (the floor applies), FP8
  static 9.5e-4 (one activation rounding flip), INT8 on Llama 0.055 (vLLM's rule; flips);
  the engine's differences: 3e-6..2e-4, INT8 on Llama 0.055 (the same flip).
- products the engine computes over bf16 activations (without the C++ CPU kernels: 4-bit
  weights, and 8-bit weights with one group per row; weights.py: torch's
  ``_weight_int4pack_mm_for_cpu`` and ``_weight_int8pack_mm``; with them every
  integer-weight product is fp32, as above): ``2 x max|ref_bf16 - ref_fp32|``, transformers' own model
  run in bf16. Measured spreads 0.30..0.49 on Llama, 0.65..1.44 on Qwen3, 1.6 on Mixtral
  (bf16 flips a routing choice; means 0.04..0.09); the engine's differences 0.18..0.59,
  2.15 on Mixtral (means 0.026..0.065).

Against these, the quantized references differ from their dense models by 0.4..8 (max;
:func:`test_reference_differs_from_the_dense_model`), so a misread format fails; the
weight comparison is exact either way. Greedy
tokens must be equal, except that from a step where transformers' choice beats the
engine's by no more than the tolerance (a near tie at that precision) the rest of that
continuation is not compared.

Bad checkpoints (a ``weight_scale`` of the wrong shape, a group size that does not divide
the input dimension, a missing ``weight_scale``, an unsupported format or method) are
refused at load with the tensor or key and the value named.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvpilot.kernels import cpu_attention
from tests.engine import quant_fixtures as qf
from tests.engine.test_model_families import make_engine, prompts

# The engine's WNA16 products on CPU: the C++ GEMM in fp32 where it loads (weights.py).
_CPU_KERNELS = cpu_attention.available()[0]

FLOOR = 1e-3
"""The smallest logprob tolerance (tests/engine/test_model_families.py's, fp32 both sides)."""
MEAN_FLOOR = 1e-4
NEW_TOKENS = 16


@dataclass(frozen=True)
class Case:
    """One fixture: ``kind`` ct (``scheme`` from ``qf.CT_SCHEMES``), gptq or awq."""

    kind: str
    arch: str
    scheme: str = ""
    bits: int = 4
    group: int = 128
    desc_act: bool = False
    experts: bool = True
    greedy: bool = False
    tied: bool = False

    @property
    def id(self) -> str:
        tied = "-tied" if self.tied else ""
        if self.kind == "ct":
            return f"{self.arch}-{self.scheme}" + ("" if self.experts else "-attn") + tied
        if self.kind == "gptq":
            return f"{self.arch}-gptq-w{self.bits}-g{self.group}" + ("-desc_act" if self.desc_act else "") + tied
        return f"{self.arch}-awq-g{self.group}"

    @property
    def weight_bits(self) -> int | None:
        if self.kind != "ct":
            return self.bits
        w = qf.CT_SCHEMES[self.scheme].weights
        return w["num_bits"] if w and w.get("type") == "int" else None

    @property
    def group_size(self) -> int | None:
        if self.kind != "ct":
            return self.group
        w = qf.CT_SCHEMES[self.scheme].weights
        return w.get("group_size") if w else None

    @property
    def bf16_products(self) -> bool:
        """Whether the engine's products for this case carry a 16-bit rounding (bf16's
        tolerance applies). With the C++ CPU kernels every integer-weight product is fp32
        on the canonical layout, whose offsets ``-zero * scale`` are held in the scales'
        dtype: AWQ's fp16 (asymmetric zeros, so the offsets round). Without them, torch's
        bf16 kernels: 4 bits (groups 32..256, every N here a multiple of 16), or 8 bits
        where a layer has one group per row (``K = 128`` layers at group 128, and every
        layer of a per-channel scheme, whose ``group_size`` is None)."""
        if _CPU_KERNELS:
            return self.kind == "awq"
        bits = self.weight_bits
        return bits == 4 or (bits == 8 and (self.group_size is None or self.group_size >= 128))


def _ct(arch: str, scheme: str, greedy: bool = False, experts: bool = True, tied: bool = False) -> Case:
    return Case("ct", arch, scheme, greedy=greedy, experts=experts, tied=tied)


GREEDY_CT = {"fp8_dynamic", "fp8_static", "int8_w8a8", "w4a16_g32_sym", "w8a16_g64_asym", "w4a16_g32_actorder"}
CASES = [
    *(_ct("llama", s, greedy=s in GREEDY_CT) for s in qf.CT_SCHEMES),
    _ct("qwen3", "fp8_dynamic"), _ct("qwen3", "int8_w8a8"), _ct("qwen3", "w4a16_g64_asym", greedy=True),
    _ct("qwen3", "w8a16_g32_sym"),
    _ct("mixtral", "fp8_dynamic", greedy=True), _ct("mixtral", "fp8_static"), _ct("mixtral", "fp8_w8a16"),
    _ct("mixtral", "w4a16_g32_sym"),
    _ct("mixtral", "fp8_dynamic", experts=False),
    Case("gptq", "llama", bits=4, group=128), Case("gptq", "llama", bits=4, group=32, desc_act=True, greedy=True),
    Case("gptq", "llama", bits=8, group=64), Case("gptq", "llama", bits=8, group=32, desc_act=True),
    Case("gptq", "qwen3", bits=4, group=64, desc_act=True),
    Case("awq", "llama", group=64, greedy=True), Case("awq", "qwen3", group=32),
    # tied heads: an fp32 table (read in place) and an fp16 one (kept fp16)
    _ct("llama", "w4a16_g64_sym", greedy=True, tied=True), Case("gptq", "qwen3", bits=4, group=64, tied=True),
]


@dataclass
class Prepared:
    """A written case with its reference: ``ref`` (fp32 model), its log-probabilities of
    :data:`IDS`, the tolerance and the spreads it came from."""

    case: Case
    fixture: qf.Fixture
    ref: torch.nn.Module
    ref_lp: torch.Tensor
    spread: torch.Tensor  # |ref in the yardstick dtype - ref fp32|, [39, vocab]
    tol: float
    mean_tol: float
    engine: object = None
    notes: dict[str, float] = field(default_factory=dict)


(IDS,) = prompts(1, 40, seed=1)
_PREPARED: dict[str, Prepared] = {}


def _reference(case: Case, fixture: qf.Fixture, dtype: torch.dtype) -> torch.nn.Module:
    if fixture.reference is not None:
        return copy.deepcopy(fixture.reference).to(dtype)
    return qf.reference_model(fixture.path, case.scheme, dtype)


def prepare(case: Case, tmp_path_factory) -> Prepared:
    """Write ``case``'s checkpoint once per session; its reference and tolerance."""
    if case.id in _PREPARED:
        return _PREPARED[case.id]
    path = tmp_path_factory.mktemp(case.id)
    if case.kind == "ct":
        fixture = qf.write_ct_checkpoint(case.arch, case.scheme, path, experts=case.experts, tied=case.tied)
    elif case.kind == "gptq":
        fixture = qf.write_gptq_checkpoint(case.arch, path, case.bits, case.group, case.desc_act, tied=case.tied)
    else:
        fixture = qf.write_awq_checkpoint(case.arch, path, case.group)
    ref = _reference(case, fixture, torch.float32)
    ref_lp = qf.logprobs(ref, IDS)
    yardstick = torch.bfloat16 if case.bf16_products else torch.float64
    spread = (qf.logprobs(_reference(case, fixture, yardstick), IDS) - ref_lp).abs()
    tol = max(FLOOR, 2 * float(spread.max()))
    mean_tol = max(MEAN_FLOOR, 2 * float(spread.mean()))
    _PREPARED[case.id] = Prepared(case, fixture, ref, ref_lp, spread, tol, mean_tol)
    return _PREPARED[case.id]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def prepared(request, tmp_path_factory) -> Prepared:
    return prepare(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[c for c in CASES if c.greedy], ids=lambda c: c.id)
def greedy_case(request, tmp_path_factory) -> Prepared:
    return prepare(request.param, tmp_path_factory)


def engine_of(p: Prepared):
    """The engine of ``p``'s checkpoint (default scheduling, torch attention), built once."""
    if p.engine is None:
        p.engine = make_engine(p.fixture.path, attention_backend="torch")
    return p.engine


# --------------------------------------------------------------------- the fixtures
def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _linears(case: Case) -> list[tuple[str, int, int]]:
    """``(checkpoint module, N, K)`` of every linear the case quantizes."""
    h, heads, kv, hd = 128, 4, 2, 32
    inter = 128 if case.arch == "mixtral" else 256
    out = []
    for layer in range(2):
        pre = f"model.layers.{layer}"
        out += [(f"{pre}.self_attn.q_proj", heads * hd, h), (f"{pre}.self_attn.k_proj", kv * hd, h),
                (f"{pre}.self_attn.v_proj", kv * hd, h), (f"{pre}.self_attn.o_proj", h, heads * hd)]
        if case.arch != "mixtral":
            out += [(f"{pre}.mlp.gate_proj", inter, h), (f"{pre}.mlp.up_proj", inter, h),
                    (f"{pre}.mlp.down_proj", h, inter)]
        elif case.experts:
            for e in range(4):
                ex = f"{pre}.block_sparse_moe.experts.{e}"
                out += [(f"{ex}.w1", inter, h), (f"{ex}.w3", inter, h), (f"{ex}.w2", h, inter)]
    return out


def expected_parts(case: Case, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """What llm-compressor / AutoGPTQ / AutoAWQ write for one ``[N, K]`` linear (the
    fixtures' docstring): suffix -> (dtype, shape)."""
    if case.kind == "gptq":
        b, g = case.bits, case.group
        return {"qweight": (torch.int32, (k * b // 32, n)), "qzeros": (torch.int32, (k // g, n * b // 32)),
                "scales": (torch.float16, (k // g, n)), "g_idx": (torch.int32, (k,))}
    if case.kind == "awq":
        g = case.group
        return {"qweight": (torch.int32, (k, n // 8)), "qzeros": (torch.int32, (k // g, n // 8)),
                "scales": (torch.float16, (k // g, n))}
    spec = qf.CT_SCHEMES[case.scheme]
    f32 = torch.float32
    if spec.preset == "FP8":
        return {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (f32, (1,)), "input_scale": (f32, (1,))}
    if spec.preset == "FP8_DYNAMIC" or (spec.weights and spec.weights["type"] == "float"):
        return {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (f32, (n, 1))}
    if spec.preset == "W8A8":
        return {"weight": (torch.int8, (n, k)), "weight_scale": (f32, (n, 1))}
    w = spec.weights
    assert w is not None
    bits, g = w["num_bits"], w.get("group_size") or k  # channel: one group per row
    parts = {"weight_packed": (torch.int32, (n, k * bits // 32)), "weight_scale": (f32, (n, k // g)),
             "weight_shape": (torch.int64, (2,))}
    if not w["symmetric"]:
        parts["weight_zero_point"] = (torch.int32, (n * bits // 32, k // g))
    if spec.actorder:
        parts["weight_g_idx"] = (torch.int32, (k,))
    return parts


def test_checkpoints_hold_the_libraries_tensors(prepared):
    """Each quantized linear has exactly the tensors its library writes, by name, dtype and
    shape; nothing else is quantized (embeddings, norms, routers and ``lm_head`` stay
    dense); config.json's ``quantization_config`` is the library's."""
    case, path = prepared.case, prepared.fixture.path
    tensors = _tensors(path)
    linears = _linears(case)
    want: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for module, n, k in linears:
        want.update({f"{module}.{part}": v for part, v in expected_parts(case, n, k).items()})
    quantized = {m for m, _, _ in linears}
    got = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items() if name.rpartition(".")[0] in quantized}
    assert got == want, case.id
    rest = {name for name in tensors if name.rpartition(".")[0] not in quantized}
    assert all(name.endswith((".weight", ".bias")) for name in rest), sorted(rest)[:5]
    dense_dtype = torch.float32 if case.kind == "ct" else torch.float16
    assert {tensors[name].dtype for name in rest} == {dense_dtype}
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= rest
    assert ("lm_head.weight" in rest) != case.tied  # a tied head is the embedding table's (not saved)
    q = json.loads((path / "config.json").read_text())["quantization_config"]
    if case.kind == "ct":
        spec = qf.CT_SCHEMES[case.scheme]
        assert q["quant_method"] == "compressed-tensors" and q["quantization_status"] == "compressed"
        fmt = {"FP8": "float-quantized", "FP8_DYNAMIC": "float-quantized", "W8A8": "int-quantized"}.get(
            spec.preset or "", "naive-quantized" if spec.weights and spec.weights["type"] == "float"
            else "pack-quantized")
        assert q["format"] == fmt and q["config_groups"]["group_0"]["format"] == fmt
        assert q["config_groups"]["group_0"]["targets"] == ["Linear"]
        assert "lm_head" in q["ignore"]
        if case.arch == "mixtral":  # routers in checkpoint names; the experts by name when left dense
            assert "model.layers.0.block_sparse_moe.gate" in q["ignore"]
            assert ("model.layers.1.block_sparse_moe.experts.3.w2" in q["ignore"]) == (not case.experts)
        assert q["config_groups"]["group_0"]["weights"].get("actorder") == ("group" if spec.actorder else None)
    elif case.kind == "gptq":
        assert {k: q[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == {
            "quant_method": "gptq", "bits": case.bits, "group_size": case.group, "desc_act": case.desc_act,
            "sym": True, "checkpoint_format": "gptq"}
    else:
        assert {k: q[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} == {
            "quant_method": "awq", "bits": 4, "group_size": case.group, "zero_point": True, "version": "gemm"}


def test_reference_differs_from_the_dense_model(prepared):
    """The quantization is there and plausible: the reference's log-probabilities differ
    from the unquantized model's by more than twice the case's tolerance (so a loader that
    ignored the quantization, or misread it by that much, fails the parity test), yet stay
    close on average (a garbled checkpoint would not).

    Not for 8-bit weights the engine serves over bf16 activations (group 128): their whole
    quantization (0.4..0.8 here) is within bf16's spread, so only
    :func:`test_dequantized_weights_match_the_reference` can tell them from the dense
    model; for them the quantization need only be visible beyond fp32's rounding."""
    dense = qf.logprobs(prepared.fixture.dense, IDS)
    diff = (dense - prepared.ref_lp).abs()
    case = prepared.case
    if case.bf16_products and case.weight_bits == 8:
        assert float(diff.max()) > 0.1, (case.id, float(diff.max()))
    else:
        assert float(diff.max()) > 2 * prepared.tol, (case.id, float(diff.max()), prepared.tol)
        assert float(diff.mean()) > 2 * prepared.mean_tol, (case.id, float(diff.mean()), prepared.mean_tol)
    assert float(diff.mean()) < 1.5, (case.id, float(diff.mean()))


def _unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """GPTQ v1 dequantization as vLLM's and AutoGPTQ's readers do it: code of column ``k``
    from word ``k // (32 / bits)`` at bit ``(k % (32 / bits)) * bits``, zero point
    ``qzeros`` nibble + 1, scale row ``g_idx[k]`` -> ``W [N, K]`` fp32."""
    per, mask = 32 // bits, (1 << bits) - 1
    k = qweight.shape[0] * per
    col = torch.arange(k)
    q = (qweight[col // per].long() >> ((col % per) * bits)[:, None]) & mask  # [K, N]
    n = scales.shape[1]
    ncol = torch.arange(n)
    z = ((qzeros[:, ncol // per].long() >> ((ncol % per) * bits)[None, :]) & mask) + 1  # [G, N]
    g = g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).t()


_AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def _unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """AWQ GEMM dequantization as vLLM's ``awq_dequantize_torch``: the eight nibbles of each
    word, low first, reordered by ``[0, 4, 1, 5, 2, 6, 3, 7]`` into columns ->
    ``W [N, K]`` fp32."""
    def nibbles(t: torch.Tensor) -> torch.Tensor:
        v = torch.stack([(t.long() >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [R, C, 8]
        return v[..., list(_AWQ_REVERSE)].reshape(t.shape[0], -1)

    q, z = nibbles(qweight), nibbles(qzeros).repeat_interleave(group, dim=0)
    return ((q - z).float() * scales.float().repeat_interleave(group, dim=0)).t()


@pytest.mark.parametrize("case", [c for c in CASES if c.kind in ("gptq", "awq")], ids=lambda c: c.id)
def test_gptq_and_awq_packing_read_back_as_vllm_reads_it(case, tmp_path_factory):
    """The packed tensors, read with vLLM's rules (written independently above), give the
    reference model's weights exactly; and the packers agree with AutoGPTQ's
    ``QuantLinear.pack`` and AutoAWQ's ``WQLinear_GEMM.from_linear`` loops (restated here
    element by element) on random codes."""
    p = prepare(case, tmp_path_factory)
    tensors = _tensors(p.fixture.path)
    ref = dict(p.ref.named_parameters())
    for module, _, _ in _linears(case):
        if case.kind == "gptq":
            w = _unpack_gptq(tensors[f"{module}.qweight"], tensors[f"{module}.qzeros"], tensors[f"{module}.scales"],
                             tensors[f"{module}.g_idx"], case.bits)
        else:
            w = _unpack_awq(tensors[f"{module}.qweight"], tensors[f"{module}.qzeros"], tensors[f"{module}.scales"],
                            case.group)
        assert torch.equal(w, ref[f"{module}.weight"]), module
    gen = torch.Generator().manual_seed(0)
    bits = case.bits
    codes = torch.randint(0, 1 << bits, (64, 16), generator=gen)  # [K, N]
    per = 32 // bits
    loop = torch.zeros(64 // per, 16, dtype=torch.int64)  # AutoGPTQ: rows of qweight along K
    for row in range(64 // per):
        for j in range(per):
            loop[row] |= codes[row * per + j] << (bits * j)
    assert torch.equal(qf.pack_gptq_rows(codes, bits), qf._as_int32(loop))
    loop = torch.zeros(16, 64 // per, dtype=torch.int64)  # AutoGPTQ qzeros: along N
    for col in range(64 // per):
        for j in range(per):
            loop[:, col] |= codes.t()[:, col * per + j] << (bits * j)
    assert torch.equal(qf.pack_gptq_cols(codes.t().contiguous(), bits), qf._as_int32(loop))
    nib = torch.randint(0, 16, (16, 64), generator=gen)
    loop = torch.zeros(16, 8, dtype=torch.int64)  # AutoAWQ: order_map per 8 columns
    for col in range(8):
        for i, src in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
            loop[:, col] |= nib[:, col * 8 + src] << (i * 4)
    assert torch.equal(qf.pack_awq_cols(nib), qf._as_int32(loop))


# ----------------------------------------------------------------------- the engine
def _engine_weights(engine) -> dict[str, tuple[list[str], torch.Tensor, torch.Tensor | None, bool]]:
    """Our quantized matrices: name -> (the checkpoint modules whose rows it joins, its
    dequantized ``W`` fp32 in the matrix's column order, the act-order permutation or None,
    whether it is served by a bf16 kernel). MoE experts appear as ``<block>.experts.E.w13``
    (gate rows, then up) and ``.w2``."""
    from kvpilot.engine.model.layers import QuantizedLinear
    from kvpilot.engine.model.moe import SparseMoeBlock, expert_checkpoint_names
    from kvpilot.engine.quantization.weights import FloatWeight

    model = engine.loaded.model
    found: dict[str, tuple[list[str], object]] = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear) and m.qweight is not None:
            if isinstance(m.qweight, FloatWeight):  # kept as stored, not quantized (test_float_...)
                continue
            found[name] = (model.checkpoint_names(name), m.qweight)
        elif isinstance(m, SparseMoeBlock) and m.quantized_experts is not None:
            layer = int(name.split(".")[1])
            for e, (w13, w2) in enumerate(m.quantized_experts):
                gate, up, down = expert_checkpoint_names(layer, e)[:3]
                found[f"{name}.experts.{e}.w13"] = ([gate, up], w13)
                found[f"{name}.experts.{e}.w2"] = ([down], w2)
    out = {}
    for name, (parts, w) in found.items():
        bf16 = getattr(w, "_int4pack", None) is not None or getattr(w, "_int8", None) is not None
        out[name] = (parts, w.dequantize(dtype=torch.float32), getattr(w, "perm", None), bf16)
    return out


def _reference_weight(ref: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """The reference model's weight of checkpoint module ``module``; Mixtral's experts from
    transformers' fused ``gate_up_proj [E, 2I, H]`` (w1 rows, then w3) and ``down_proj``
    (or the fixture's own per-expert modules)."""
    if f"{module}.weight" in ref:
        return ref[f"{module}.weight"]
    pre, e, proj = module.rsplit(".", 2)
    fused = pre.replace(".block_sparse_moe.", ".mlp.")
    if proj == "w2":
        return ref[f"{fused}.down_proj"][int(e)]
    gate_up = ref[f"{fused}.gate_up_proj"][int(e)]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "w1" else gate_up[half:]


def test_dequantized_weights_match_the_reference(prepared):
    """Every quantized projection the engine built (fused q/k/v and gate/up included)
    holds the reference's weights: exactly up to fp32 rounding, or, where the engine
    serves it from torch's bf16 kernels (their scales and zero points in bf16) or holds
    AWQ's offsets ``-zero * scale`` in its fp16 scale dtype, within 2**-7 of the row's
    largest weight (bf16 keeps 8 significant bits; a wrong code, zero
    point or group is a whole quantization step, >= 1/15 of the row's range)."""
    engine = engine_of(prepared)
    ref = {n: t.detach().float() for n, t in prepared.ref.named_parameters()}
    ours = _engine_weights(engine)
    assert ours, "the engine built no quantized module"
    want_modules = {m for m, _, _ in _linears(prepared.case)}
    covered: set[str] = set()
    for name, (parts, w, perm, bf16) in ours.items():
        expect = torch.cat([_reference_weight(ref, p) for p in parts])
        if perm is not None:
            expect = expect[:, perm]
        scale = expect.abs().amax(dim=1, keepdim=True)
        err = float(((w - expect).abs() / scale).max())
        sixteen = bf16 or prepared.case.kind == "awq"  # AWQ's offsets rounded to its fp16 scales
        assert err <= (2**-7 if sixteen else 1e-6), (prepared.case.id, name, err)
        covered.update(parts)
    assert covered == want_modules


def test_logprobs_match_the_reference(prepared):
    from kvpilot.engine.scoring import score_tokens

    engine = engine_of(prepared)
    ours = score_tokens(engine, IDS, chunk_size=5, return_logprobs=True).logprobs
    diff = (ours - prepared.ref_lp).abs()
    print(f"{prepared.case.id}: max {float(diff.max()):.2e} (tol {prepared.tol:.2e}), mean {float(diff.mean()):.2e} "
          f"(tol {prepared.mean_tol:.2e})")
    assert float(diff.max()) <= prepared.tol, (prepared.case.id, float(diff.max()), prepared.tol)
    assert float(diff.mean()) <= prepared.mean_tol, (prepared.case.id, float(diff.mean()), prepared.mean_tol)


def assert_greedy_matches(ours: list[list[int]], expect: list[tuple[list[int], torch.Tensor]], tol: float,
                          label: str) -> int:
    """Each continuation equals transformers' until a step where the two choose differently
    and transformers' log-probability of its token beats that of ours by at most ``tol``
    (a tie at the tolerance; the rest of that continuation is not compared). Returns the
    number of tokens compared."""
    compared = 0
    for i, (got, (want, lps)) in enumerate(zip(ours, expect)):
        assert len(got) == len(want) == NEW_TOKENS, (label, i, len(got))
        for step, (g, w) in enumerate(zip(got, want)):
            if g != w:
                margin = float(lps[step, w] - lps[step, g])
                assert margin <= tol, (f"{label}: prompt {i} step {step}: engine {g}, transformers {w}, "
                                       f"which it prefers by {margin:.3g} > {tol:.3g}")
                break
            compared += 1
    return compared


def test_greedy_through_chunked_prefill_preemption_and_prefix_hits(greedy_case):
    from kvpilot.engine.sampling_params import SamplingParams

    p = greedy_case
    batch = prompts(3, 22, seed=2)
    expect = qf.greedy(p.ref, batch, NEW_TOKENS)
    # 3 requests of 38 tokens need 30 blocks of 4; 14 make the scheduler preempt.
    engine = make_engine(p.fixture.path, attention_backend="torch", max_num_batched_tokens=8,
                         num_gpu_blocks_override=14, max_model_len=48)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def run(order: list[int]) -> tuple[list[list[int]], int]:
        for i in order:
            engine.add_request(f"r{i}", batch[i], params)
        done, preempted = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
            preempted += engine.take_stats().num_preemptions
        return [done[f"r{i}"] for i in range(len(batch))], preempted

    first, preempted = run([0, 1, 2])
    compared = assert_greedy_matches(first, expect, p.tol, p.case.id)
    hits = engine.scheduler.prefix_stats.hits
    second, _ = run([2, 1, 0])  # last in first: the pool still holds the last request's blocks
    assert_greedy_matches(second, expect, p.tol, p.case.id)
    assert engine.scheduler.prefix_stats.hits > hits, f"{p.case.id}: the second round had no prefix hit"
    assert preempted > 0, f"{p.case.id}: the small pool did not preempt"
    assert compared >= NEW_TOKENS, f"{p.case.id}: only {compared} tokens compared"


def _module_of(name: str) -> str:
    return name.rpartition(".")[0]


def test_resident_weight_bytes(prepared):
    """The engine holds the quantized projections in at most 1.15x their checkpoint bytes.

    ``weight_bytes`` (parameters plus the packed and quantized modules' bytes) is bounded by
    ``1.15 x`` the file bytes of the quantized modules' tensors plus every other tensor
    (embedding, ``lm_head``, norms, routers, dense experts) at the engine's dtype (fp32:
    the same bytes as the compressed-tensors files), except the embedding and head the
    engine keeps as stored (GPTQ's and AWQ's fp16), at their file bytes. The 15% is the canonical layout's overhead: zero-point offsets beside
    the scales, per-tensor scales expanded per row, the act-order permutation as int64.
    The check also catches a weight held twice (canonical and kernel forms) or dequantized.
    """
    engine = engine_of(prepared)
    quantized = {m for m, _, _ in _linears(prepared.case)}
    tensors = _tensors(prepared.fixture.path)
    quant_file = sum(t.numel() * t.element_size() for n, t in tensors.items() if _module_of(n) in quantized)
    kept = _kept_as_stored(tensors)
    assert _kept_modules(engine) == kept  # the embedding and head held as stored (test_float_...)
    other = sum(t.numel() * (t.element_size() if _module_of(n) in kept else 4)
                for n, t in tensors.items() if _module_of(n) not in quantized)
    assert quant_file == qf.safetensors_bytes(prepared.fixture.path) - sum(
        t.numel() * t.element_size() for n, t in tensors.items() if _module_of(n) not in quantized)
    resident = engine.loaded.weight_bytes
    # Served in the canonical layout (the C++ CPU GEMM, as the Triton GEMM on CUDA), 4-bit
    # group-32 weights with fp32 scales hold an fp32 offset beside each scale: 4 bytes per
    # 16 bytes of codes (measured 1.17-1.20x); torch's int4 pack, which serves them without
    # the C++ kernels, holds a bf16 scale and zero instead.
    canonical_g32 = _CPU_KERNELS and prepared.case.weight_bits == 4 and prepared.case.group_size == 32
    bound = (1.25 if canonical_g32 else 1.15) * quant_file + other
    print(f"{prepared.case.id}: resident {resident} B, quantized tensors in the file {quant_file} B, other "
          f"{other} B: {(resident - other) / quant_file:.3f}x")
    assert resident <= bound, (prepared.case.id, resident, bound)
    assert resident - other > 0.5 * quant_file  # the quantized modules are counted at all


_HEAD_MODULES = ("model.embed_tokens", "lm_head")


def _kept_as_stored(tensors: dict[str, torch.Tensor]) -> set[str]:
    """The embedding and head modules a float32 engine on CPU keeps as the file stores
    them (``model_runner.stored_float_modules``): a bf16/fp16 embedding or head, and an
    fp32 embedding the head is tied to (no ``lm_head.weight`` in the file)."""
    tied = "lm_head.weight" not in tensors
    kept = set()
    for m in _HEAD_MODULES:
        t = tensors.get(f"{m}.weight")
        if t is not None and (t.dtype in (torch.bfloat16, torch.float16) or (tied and t.dtype == torch.float32)):
            kept.add(m)
    return kept


def _kept_modules(engine) -> set[str]:
    from kvpilot.engine.model.layers import QuantizedEmbedding, QuantizedLinear
    from kvpilot.engine.quantization.weights import FloatWeight

    model = engine.loaded.model
    kept = set()
    for name, module in (("model.embed_tokens", model.embed_tokens), ("lm_head", model.lm_head)):
        inner = module.inner if isinstance(module, QuantizedEmbedding) else module
        if isinstance(inner, QuantizedLinear) and isinstance(inner.qweight, FloatWeight):
            kept.add(name)
    return kept


def test_float_embedding_and_head_kept_as_stored(prepared):
    """A float32 engine keeps a quantized checkpoint's 16-bit embedding and LM head (and a
    tied fp32 table) as stored, one copy each, with the stored values exactly, and its
    logits are the float32 product of those weights: ``hidden @ W.float().T`` to fp32
    rounding. An untied fp32 embedding stays a float32 parameter."""
    engine = engine_of(prepared)
    tensors = _tensors(prepared.fixture.path)
    kept = _kept_as_stored(tensors)
    assert _kept_modules(engine) == kept
    model = engine.loaded.model
    assert ("lm_head.weight" not in tensors) == prepared.case.tied and (model.lm_head is None) == prepared.case.tied
    stored = tensors["model.embed_tokens.weight"]
    if prepared.case.kind != "ct":
        assert {"model.embed_tokens", "lm_head"} & kept  # GPTQ/AWQ tools save fp16
    if "model.embed_tokens" not in kept:
        assert model.embed_tokens.weight.dtype == torch.float32
    ids = torch.tensor([0, 5, stored.shape[0] - 1])
    with torch.no_grad():
        assert torch.equal(model.embed_tokens(ids), stored[ids].float())
    head = tensors.get("lm_head.weight", stored)
    hidden = torch.randn(5, head.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    expect = hidden.double() @ head.double().T
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), expect, rtol=1e-5, atol=1e-5 * float(expect.abs().max()))
    for i in range(hidden.shape[0] if _CPU_KERNELS else 0):  # the C++ GEMM is batch invariant
        with torch.no_grad():
            assert torch.equal(model.compute_logits(hidden[i:i + 1]), logits[i:i + 1])


@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("llama-gptq-w4-g128", "qwen3-gptq-w4-g64-tied")],
                         ids=lambda c: c.id)
def test_kept_head_serves_without_onednn_packing(case, tmp_path_factory, monkeypatch):
    """Where oneDNN cannot pack (no ``PackedLinear``), the kept head is called as a module:
    the same logits as the packed engine's."""
    from kvpilot.engine import model_runner

    p = prepare(case, tmp_path_factory)
    hidden = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = engine_of(p).loaded.model.compute_logits(hidden)
    monkeypatch.setattr(model_runner, "can_pack_linears", lambda device, dtype: False)
    engine = make_engine(p.fixture.path, attention_backend="torch")
    assert engine.loaded.model.packed_head is None and _kept_modules(engine)
    with torch.no_grad():
        assert torch.allclose(engine.loaded.model.compute_logits(hidden), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ the reference itself
def test_int8_reference_rule(tmp_path_factory):
    """Why INT8 W8A8's reference uses vLLM's activation rule (module docstring):
    compressed-tensors' ``amax / 127.5`` puts a tie in every token, so its fp64 and fp32
    runs disagree broadly (mean 0.039 here), vLLM's ``amax / 127`` much less (4.5e-4); and
    the two rules differ by as much as the quantization itself."""
    p = prepare(Case("ct", "llama", "int8_w8a8"), tmp_path_factory)
    path = p.fixture.path

    def lp(dtype, rule):
        return qf.logprobs(qf.reference_model(path, "int8_w8a8", dtype, int8_rule=rule), IDS).double()

    ct32, ct64 = lp(torch.float32, "compressed-tensors"), lp(torch.float64, "compressed-tensors")
    vllm64 = lp(torch.float64, "vllm")
    vllm32 = p.ref_lp.double()
    ct_spread = float((ct64 - ct32).abs().mean())
    vllm_spread = float((vllm64 - vllm32).abs().mean())
    print(f"INT8 fp64-fp32 mean: compressed-tensors {ct_spread:.2e}, vllm {vllm_spread:.2e}; rules differ by "
          f"{float((ct32 - vllm32).abs().mean()):.2e} (max {float((ct32 - vllm32).abs().max()):.2e})")
    assert ct_spread > 10 * vllm_spread
    assert float((ct32 - vllm32).abs().mean()) > 10 * p.mean_tol


def test_transformers_simulates_activation_quantization(tmp_path_factory):
    """transformers' compressed-tensors forward fake-quantizes the inputs of W8A8 layers
    (switching compressed-tensors' ``quantization_enabled`` off changes the result by a
    quantization's worth), and its default load refuses asymmetric pack-quantized
    checkpoints (the zero point's packed shape against the unpacked one it builds) which
    is why those load with ``dequantize=True``."""
    p = prepare(Case("ct", "llama", "fp8_dynamic"), tmp_path_factory)
    model = qf.reference_model(p.fixture.path, "fp8_dynamic")
    qf.logprobs(model, IDS)  # the first forward decompresses
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            m.quantization_enabled = False
    no_act = qf.logprobs(model, IDS)
    assert float((no_act - p.ref_lp).abs().mean()) > 0.05
    import transformers

    asym = prepare(Case("ct", "llama", "w4a16_g128_asym"), tmp_path_factory)
    with pytest.raises(RuntimeError, match=r"(?i)size mismatch|mismatch"):
        transformers.AutoModelForCausalLM.from_pretrained(str(asym.fixture.path), dtype=torch.float32)


# ------------------------------------------------------------------ bad checkpoints
@pytest.fixture(scope="module")
def w4_checkpoint(tmp_path_factory) -> Path:
    return prepare(Case("ct", "llama", "w4a16_g32_sym"), tmp_path_factory).fixture.path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def test_weight_scale_of_the_wrong_shape_is_refused(w4_checkpoint, tmp_path):
    path = _copy(w4_checkpoint, tmp_path / "ckpt")
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    _edit_tensors(path, lambda t: t.__setitem__(name, t[name][:, :3].contiguous()))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight_scale: shape \(128, 3\) "
                                         r"does not match .*expected \[128, 4\]"):
        make_engine(path)


def test_group_size_that_does_not_divide_the_input_is_refused(w4_checkpoint, tmp_path):
    path = _copy(w4_checkpoint, tmp_path / "ckpt")
    _edit_config(path, lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("group_size", 48))
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.\w+\.\w+_proj: group size 48 does not divide the "
                                         r"input dimension (128|256)"):
        make_engine(path)


def test_missing_weight_scale_is_refused(w4_checkpoint, tmp_path):
    path = _copy(w4_checkpoint, tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale: missing from the "
                                         r"checkpoint"):
        make_engine(path)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("format", "nvfp4-pack-quantized", r"quantization_config\.format = 'nvfp4-pack-quantized' is not supported"),
    ("quant_method", "bitsandbytes", r"quantization_config\.quant_method = 'bitsandbytes' is not supported"),
])
def test_unsupported_quantization_config_is_refused(w4_checkpoint, tmp_path, key, value, message):
    path = _copy(w4_checkpoint, tmp_path / "ckpt")
    _edit_config(path, lambda q: q.__setitem__(key, value))
    if key == "format":  # the group's own format wins over the top-level one in compressed-tensors
        _edit_config(path, lambda q: q["config_groups"]["group_0"].pop("format"))
    with pytest.raises(ValueError, match=message):
        make_engine(path)
