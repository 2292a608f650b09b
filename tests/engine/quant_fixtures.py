"""Tiny quantized checkpoints, written by the quantization libraries' own code, and their
references computed by transformers (a helper module for
tests/engine/test_quantized_checkpoints.py, not a test file).

The models follow tests/engine/test_model_families.py (its ``COMMON``, weights scaled by 3
so greedy paths are well separated) with the shapes every group size here divides: hidden
128, intermediate 256 (Mixtral: 128 per expert), Qwen3's head_dim 32, so every linear has
``K`` in {128, 256} and groups of 32, 64 and 128 all fit. Two layers, vocabulary 256,
fp32, untied ``lm_head``.

compressed-tensors checkpoints (:func:`write_ct_checkpoint`) are made the way
llm-compressor's ``oneshot`` makes them, with compressed-tensors 0.20's API directly
(llm-compressor pins torch/transformers versions this venv cannot hold): the dense model
saved and loaded back with ``from_pretrained`` (so compressed-tensors writes ``ignore`` in
checkpoint names), ``apply_quantization_config`` on it, round-to-nearest weight
quantization parameters from min/max (``calculate_qparams``) set on each module,
static input scales from a calibration pass (``calculate_qparams`` of the observed
``-amax, amax``: ``amax / 448`` for FP8), status ``frozen``, then
``ModelCompressor.from_pretrained_model`` -> ``compress_model`` -> ``save_pretrained`` ->
``update_config``. ``ignore`` is what compressed-tensors derives: ``["lm_head"]`` (and
Mixtral's routers, ``model.layers.N.block_sparse_moe.gate``, and its experts by name when
``experts=False`` leaves them dense). Mixtral's experts are fused
3-D parameters in transformers 5, which compressed-tensors cannot target, so they are first
split into ``nn.Linear`` ``w1``/``w2``/``w3`` per expert (llm-compressor's
``linearize_moe_model`` does the same); transformers' save renames ``mlp`` to
``block_sparse_moe``, giving the layout of published Mixtral checkpoints.

The schemes (:data:`CT_SCHEMES`; each one ``config_groups.group_0`` targeting
``["Linear"]``) and the tensors each quantized linear has in the saved file:

==================  ===================  ================================================
scheme              format               tensors (``N`` out, ``K`` in, ``G = K / group``)
==================  ===================  ================================================
fp8_dynamic         float-quantized      preset FP8_DYNAMIC: weights float 8 bits
                                         ``channel`` symmetric, input_activations float 8
                                         ``token`` dynamic. ``weight`` float8_e4m3fn
                                         ``[N, K]``, ``weight_scale`` f32 ``[N, 1]``
fp8_static          float-quantized      preset FP8: weights ``tensor``, input_activations
                                         ``tensor`` static (observer static_minmax).
                                         ``weight`` fp8 ``[N, K]``, ``weight_scale``
                                         ``[1]``, ``input_scale`` ``[1]``
fp8_w8a16           naive-quantized      weights float 8 ``channel``, no activations.
                                         ``weight`` fp8 ``[N, K]``, ``weight_scale``
                                         ``[N, 1]``
int8_w8a8           int-quantized        preset W8A8: weights int 8 ``channel``
                                         symmetric, input_activations int 8 ``token``
                                         dynamic. ``weight`` int8 ``[N, K]``,
                                         ``weight_scale`` ``[N, 1]``
w{4,8}a16_g{32,64,  pack-quantized       weights int 4/8 ``group`` (group_size 32/64/128),
128}_{sym,asym}                          symmetric or not. ``weight_packed`` int32
                                         ``[N, K * bits / 32]``, ``weight_scale`` ``[N, G]``,
                                         ``weight_shape`` int64 ``[2]`` (= ``[N, K]``), and
                                         asymmetric: ``weight_zero_point`` int32
                                         ``[N * bits / 32, G]`` (packed along ``N``)
w4a16_g32_actorder  pack-quantized       as w4a16_g32_sym with ``actorder: "group"`` and
                                         ``weight_g_idx`` int32 ``[K]`` (see below)
==================  ===================  ================================================

Packing (compressed-tensors' ``pack_to_int32``): element ``i`` of a row in bits
``i * bits ..`` of word ``i * bits // 32``, codes stored offset to unsigned
(``q + 2**(bits-1)``); zero points likewise, packed along dimension 0.

Act-order: compressed-tensors 0.20 refuses ``actorder: "group"`` ("has been removed";
``QuantizationArgs`` raises) and no longer writes or reads ``weight_g_idx``, but
checkpoints made before (llm-compressor's GPTQ with ``actorder="group"``) carry it and vLLM
serves them. :func:`write_ct_checkpoint` writes that fixture itself: the 4-bit
group-32 symmetric checkpoint with columns assigned to groups as GPTQ's ``desc_act`` does
(:func:`desc_act_g_idx`: by decreasing Hessian diagonal of the calibration inputs, so
q/k/v and gate/up, which share an input, share ``g_idx``), each group's scale from its own
columns' min/max, codes packed in the original column order with compressed-tensors'
``pack_to_int32``, and ``weight_g_idx`` beside. transformers cannot load it, so its
reference is the dense model holding the dequantized weights (``w[:, k] =
q[:, k] * scale[:, g_idx[k]]``).

GPTQ and AWQ (:func:`write_gptq_checkpoint`, :func:`write_awq_checkpoint`): auto-gptq,
gptqmodel and autoawq cannot be installed beside this venv's torch, so the tensors are
packed here per their documented formats, checked against AutoGPTQ's
``qlinear_cuda_old.QuantLinear.pack`` and AutoAWQ's ``WQLinear_GEMM.from_linear`` (and
vLLM's readers; see the test module):

- GPTQ (v1, ``checkpoint_format: gptq``): ``qweight`` int32 ``[K * bits / 32, N]``
  (column ``k``'s code in word ``k * bits // 32``, bits ``(k % (32 / bits)) * bits``),
  ``qzeros`` int32 ``[K / g, N * bits / 32]`` holding ``zero - 1`` packed the same way
  along ``N``, ``scales`` fp16 ``[K / g, N]``, ``g_idx`` int32 ``[K]``;
  ``w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])``. Symmetric: ``zero =
  2**(bits-1)``, scale ``2 * amax / (2**bits - 1)`` (GPTQ's quantizer); ``desc_act``
  groups as above, else ``g_idx[k] = k // g``.
- AWQ GEMM: ``qweight`` int32 ``[K, N / 8]`` packed along ``N`` in the order
  ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``i`` of word ``j`` is column ``8 j + order[i]``),
  ``qzeros`` int32 ``[K / g, N / 8]`` the same way, ``scales`` fp16 ``[K / g, N]``;
  ``w[n, k] = scales[k // g, n] * (q[k, n] - zero[k // g, n])``, zero from min/max.

Their unquantized tensors are saved in fp16, as those tools save them, and the reference
model holds the same fp16-rounded values.

References (:func:`reference_model`): ``AutoModelForCausalLM.from_pretrained(folder,
dtype=...)``. What transformers 5.25 with compressed-tensors 0.20 does with them:

- It keeps the checkpoint's compressed modules and decompresses them on the first forward
  pass; each quantized ``Linear``'s forward is compressed-tensors' ``quantized_forward``,
  which fake-quantizes (quantize, then dequantize) the layer's input per
  ``input_activations``: dynamic per-token scales ``amax / 448`` (FP8) or
  ``amax / 127.5`` (INT8, ``calculate_qparams``' symmetric range 255 / 2, where vLLM's
  ``scaled_int8_quant`` uses ``amax / 127``), or the checkpoint's static ``input_scale``.
  So the reference does simulate W8A8's activation quantization. With ``dequantize=True``
  it does not (the modules are plain dense ``Linear``).
- For INT8 W8A8 :func:`reference_model` replaces that rule by vLLM's (``int8_rule``): the
  ``amax / 127.5`` scale puts each token's largest element on a rounding tie, which makes
  the simulation unstable (tests/engine/test_quantized_checkpoints.py has the numbers).
- Asymmetric pack-quantized checkpoints do not load that way: transformers builds the
  modules' parameters on the meta device, where compressed-tensors does not pack the zero
  point, and refuses ``weight_zero_point`` ``[N * bits / 32, G]`` against ``[N, G]``
  ("size mismatch"). Those load with ``CompressedTensorsConfig(dequantize=True)``, which
  dequantizes every weight at load (right for weight-only schemes).
- MoE experts are 3-D tensors dequantized at load: no activation quantization on them,
  and transformers cannot read INT8 or asymmetric packed experts at all, nor dense
  experts beside packed attention (its expert converter assumes the packed scheme); FP8
  attention with dense experts loads. For Mixtral FP8 W8A8 with quantized experts the
  reference re-runs transformers' expert loop with compressed-tensors' ``fake_quantize`` of
  each expert's two inputs (:func:`reference_model`): per token (``fp8_dynamic``, as vLLM's
  dynamic FP8 MoE), or with each expert's own static ``input_scale`` (``fp8_static``; vLLM
  instead takes the largest over a layer's experts). Note compressed-tensors' ``token``
  strategy keeps the first two dimensions: a 2-D ``[T, H]`` input would get one scale.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.engine.test_model_families import COMMON, VOCAB, prompts

# Shapes that groups of 32, 64 and 128 divide (see the module docstring).
QCOMMON = {**COMMON, "hidden_size": 128, "intermediate_size": 256}


def _llama(t):
    return t.LlamaConfig(**QCOMMON, rope_theta=10000.0), t.LlamaForCausalLM


def _qwen3(t):
    return t.Qwen3Config(**QCOMMON, head_dim=32, rope_theta=1e6), t.Qwen3ForCausalLM


def _mixtral(t):
    return (t.MixtralConfig(**{**QCOMMON, "intermediate_size": 128}, num_local_experts=4,
                            num_experts_per_tok=2, rope_theta=1e6), t.MixtralForCausalLM)


ARCHS: dict[str, Callable] = {"llama": _llama, "qwen3": _qwen3, "mixtral": _mixtral}


def dense_model(arch: str, seed: int = 0, tied: bool = False):
    """The fp32 transformers model (eval) every fixture of ``arch`` quantizes: random
    weights scaled by 3 (biases none), as tests/engine/test_model_families.py's
    ``tiny_checkpoint``; ``tied``: the LM head is the embedding table."""
    import transformers

    cfg, cls = ARCHS[arch](transformers)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


# ----------------------------------------------------------------------------- MoE
class _ExpertMLP(nn.Module):
    """One Mixtral expert as the checkpoint names it: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class _LinearExperts(nn.ModuleList):
    """transformers' ``MixtralExperts`` split into per-expert ``nn.Linear`` modules (same
    call signature, same result): what compressed-tensors can quantize."""

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]) * top_k_weights[tok, slot, None])
        return out


def linearize_experts(model) -> None:
    """Replace every ``MixtralExperts`` (fused ``gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``) by :class:`_LinearExperts` holding the same weights."""
    for layer in model.model.layers:
        fused = layer.mlp.experts
        inter = fused.intermediate_dim
        experts = _LinearExperts([_ExpertMLP(fused.hidden_dim, inter) for _ in range(fused.num_experts)])
        with torch.no_grad():
            for e, ex in enumerate(experts):
                ex.w1.weight.copy_(fused.gate_up_proj[e, :inter])
                ex.w3.weight.copy_(fused.gate_up_proj[e, inter:])
                ex.w2.weight.copy_(fused.down_proj[e])
        layer.mlp.experts = experts


# ------------------------------------------------------------------ compressed-tensors
@dataclass(frozen=True)
class CTScheme:
    """One compressed-tensors scheme: a preset name, or the weights' QuantizationArgs
    (keyword arguments) alone; ``actorder``: the hand-written ``weight_g_idx`` fixture."""

    preset: str | None = None
    weights: dict[str, Any] | None = None
    actorder: bool = False

    def scheme(self):
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationScheme,
            preset_name_to_scheme,
        )

        if self.preset is not None:
            return preset_name_to_scheme(self.preset, ["Linear"])
        return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**(self.weights or {})))

    @property
    def act_quant(self) -> bool:
        return self.preset in ("FP8", "FP8_DYNAMIC", "W8A8")

    @property
    def asymmetric(self) -> bool:
        return bool(self.weights) and self.weights.get("symmetric") is False


def _wna16(bits: int, group: int, symmetric: bool, actorder: bool = False) -> CTScheme:
    return CTScheme(weights=dict(num_bits=bits, type="int", strategy="group", group_size=group,
                                 symmetric=symmetric, dynamic=False), actorder=actorder)


CT_SCHEMES: dict[str, CTScheme] = {
    "fp8_dynamic": CTScheme(preset="FP8_DYNAMIC"),
    "fp8_static": CTScheme(preset="FP8"),
    "fp8_w8a16": CTScheme(weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True,
                                       dynamic=False)),
    "int8_w8a8": CTScheme(preset="W8A8"),
    "w8a16_channel": CTScheme(weights=dict(num_bits=8, type="int", strategy="channel", symmetric=True,
                                           dynamic=False)),
    **{f"w{b}a16_g{g}_{'sym' if s else 'asym'}": _wna16(b, g, s)
       for b in (4, 8) for g in (32, 64, 128) for s in (True, False)},
    "w4a16_g32_actorder": _wna16(4, 32, True, actorder=True),
}


@dataclass
class Fixture:
    """A written checkpoint: its folder, the fp32 model it was quantized from (``dense``)
    and, where transformers cannot load the folder, the reference model to use instead
    (the dense model holding the dequantized weights; None: :func:`reference_model`)."""

    path: Path
    dense: Any
    reference: Any = None


def calibration_ids() -> torch.Tensor:
    """The calibration batch: 4 random sequences of 32 tokens."""
    return torch.tensor(prompts(4, 32, seed=7))


def calibrate(model, ids: torch.Tensor) -> dict[str, tuple[float, torch.Tensor]]:
    """For each ``nn.Linear``: the largest ``|x|`` of its inputs over ``ids`` (static input
    scales) and the per-column sums of ``x**2`` (GPTQ's Hessian diagonal ``diag(X^T X)``,
    whose descending order is ``desc_act``'s column order)."""
    stats: dict[str, tuple[float, torch.Tensor]] = {}

    def hook(name):
        def record(_mod, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            amax, sq = stats.get(name, (0.0, torch.zeros(x.shape[-1], dtype=torch.float64)))
            stats[name] = (max(amax, float(x.abs().max())), sq + (x * x).sum(0))
        return record

    hooks = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return stats


def desc_act_g_idx(hessian_diag: torch.Tensor, group_size: int) -> torch.Tensor:
    """GPTQ's act-order groups: columns taken in decreasing ``diag(H)``, ``group_size`` at
    a time: ``g_idx[perm[i]] = i // group_size`` (int64 ``[K]``). Projections that share an
    input (q/k/v, gate/up) share ``diag(H)``, hence ``g_idx``, as in real checkpoints."""
    k = hessian_diag.numel()
    perm = torch.argsort(hessian_diag, descending=True, stable=True)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group_size
    return g_idx


def _weight_minmax(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The observed min/max over the scheme's reduction: the whole tensor (``[1]``), each
    row (``[N, 1]``) or each group (``[N, G]``), as llm-compressor's min-max observer."""
    if args.strategy == "group":
        wg = w.reshape(w.shape[0], -1, args.group_size)
        return wg.amin(-1), wg.amax(-1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return w.min().reshape(1), w.max().reshape(1)


def pretrained_dense(arch: str, seed: int, workdir: Path, tied: bool = False):
    """:func:`dense_model` saved to ``workdir`` and loaded back with ``from_pretrained``,
    as llm-compressor starts (the loaded model carries transformers' checkpoint-name
    conversions, which compressed-tensors uses to write ``ignore`` in checkpoint names)."""
    import transformers

    dense_model(arch, seed, tied).save_pretrained(str(workdir))
    return transformers.AutoModelForCausalLM.from_pretrained(str(workdir), dtype=torch.float32).eval()


def write_ct_checkpoint(arch: str, scheme_name: str, path: Path, seed: int = 0, experts: bool = True,
                        tied: bool = False) -> Fixture:
    """Quantize :func:`dense_model` ``(arch, seed)`` with ``CT_SCHEMES[scheme_name]`` and
    save it to ``path`` as llm-compressor would (module docstring).

    Args:
        experts: Mixtral: quantize the experts too (False: ``ignore`` them, regex
            ``re:.*mlp[.]experts[.].*``, so only attention is quantized).
        tied: the dense model's LM head is its embedding table.
    """
    import tempfile

    spec = CT_SCHEMES[scheme_name]
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        model = pretrained_dense(arch, seed, Path(work), tied)
    if arch == "mixtral":
        linearize_experts(model)
    stats = calibrate(model, calibration_ids()) if spec.preset == "FP8" or spec.actorder else {}
    ignore = ["lm_head"] + ([] if experts else ["re:.*mlp[.]experts[.].*"])
    g_idx = quantize_in_place(model, spec, ignore, stats)
    if spec.actorder:
        if arch == "mixtral" or tied:
            raise ValueError("the act-order fixture is written for dense models")
        return Fixture(path, dense_model(arch, seed), _write_actorder(model, arch, seed, g_idx, path))
    save_compressed(model, path)
    return Fixture(path, dense_model(arch, seed, tied))


def quantize_in_place(model, spec: CTScheme, ignore: list[str],
                      stats: dict[str, tuple[float, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``apply_quantization_config`` of ``spec`` on ``model`` (loaded with
    ``from_pretrained``), round-to-nearest weight scales from min/max, static input scales
    from ``stats`` (:func:`calibrate`), status frozen: what llm-compressor's ``oneshot``
    leaves before saving. Returns the act-order ``g_idx`` per module (empty without)."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = spec.scheme()
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore),
                              show_progress=False)
    g_idx: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        sch = getattr(module, "quantization_scheme", None)
        if sch is None:
            continue
        w = module.weight.data
        args = sch.weights
        if spec.actorder:  # each group's min/max over the columns g_idx assigns it
            gi = g_idx[name] = desc_act_g_idx(stats[name][1], args.group_size)
            cols = [torch.nonzero(gi == j).flatten() for j in range(w.shape[1] // args.group_size)]
            lo = torch.stack([w[:, c].amin(-1) for c in cols], dim=1)
            hi = torch.stack([w[:, c].amax(-1) for c in cols], dim=1)
        else:
            lo, hi = _weight_minmax(w, args)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
        ia = sch.input_activations
        if ia is not None and not ia.dynamic:
            a = torch.tensor([stats[name][0]])
            s, z = calculate_qparams(-a, a, ia)
            module.input_scale.data.copy_(s)
            if hasattr(module, "input_zero_point"):
                module.input_zero_point.data.copy_(z)
        module.quantization_status = QuantizationStatus.FROZEN
    return g_idx


def save_compressed(model, path: Path) -> None:
    """Compress a model :func:`quantize_in_place` left and save it as llm-compressor does."""
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(path))
    compressor.update_config(str(path))


def _write_actorder(model, arch: str, seed: int, g_idx: dict[str, torch.Tensor], path: Path):
    """The ``actorder: group`` checkpoint compressed-tensors 0.20 no longer writes: the
    dense tensors of ``model``, and for each quantized linear ``weight_packed`` (codes in
    the original column order, compressed-tensors' ``pack_to_int32``), ``weight_scale``
    ``[N, G]``, ``weight_shape`` and ``weight_g_idx`` ``[K]``; the config is compressed-
    tensors' own with ``actorder: "group"`` added to the weights. Returns the reference:
    :func:`dense_model` with every quantized weight replaced by its dequantized value."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file

    compressor = ModelCompressor.from_pretrained_model(model)
    tensors: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    quantized = {n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    for name, module in model.named_modules():
        if name not in quantized:
            continue
        args = module.quantization_scheme.weights
        w, s, gi = module.weight.data, module.weight_scale.data, g_idx[name]
        lo, hi = -(2 ** (args.num_bits - 1)), 2 ** (args.num_bits - 1) - 1
        q = torch.clamp(torch.round(w / s[:, gi]), lo, hi).to(torch.int8)
        tensors[f"{name}.weight_packed"] = pack_to_int32(q, args.num_bits)
        tensors[f"{name}.weight_scale"] = s.clone()
        tensors[f"{name}.weight_shape"] = torch.tensor(w.shape)
        tensors[f"{name}.weight_g_idx"] = gi.to(torch.int32)
        deq[f"{name}.weight"] = q.float() * s[:, gi]
    for name, t in model.state_dict().items():
        if name.rsplit(".", 1)[0] not in quantized:
            tensors[name] = t.clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(path))
    compressor.quantization_config.format = "pack-quantized"
    compressor.quantization_config.quantization_status = "compressed"
    compressor.update_config(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    reference = dense_model(arch, seed)
    with torch.no_grad():
        params = dict(reference.named_parameters())
        for name, w in deq.items():
            params[name].copy_(w)
    return reference


# ------------------------------------------------------------------------ GPTQ / AWQ
def pack_gptq_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's ``qweight``: codes ``q`` ``[K, N]`` (unsigned) packed along ``K``, ``32 /
    bits`` per int32 word, the first in the lowest bits -> int32 ``[K * bits / 32, N]``."""
    per = 32 // bits
    k, n = q.shape
    q = q.to(torch.int64).reshape(k // per, per, n)
    shifts = (torch.arange(per, dtype=torch.int64) * bits)[None, :, None]
    return _as_int32((q << shifts).sum(dim=1))


def pack_gptq_cols(z: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's ``qzeros`` packing: ``[G, N]`` values packed along ``N`` -> ``[G, N * bits / 32]``."""
    return pack_gptq_rows(z.t().contiguous(), bits).t().contiguous()


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq_cols(q: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM packing of 4-bit values ``[R, N]`` along ``N``: nibble ``i`` of word ``j``
    holds column ``8 j + AWQ_ORDER[i]`` -> int32 ``[R, N / 8]``."""
    r, n = q.shape
    q = q.to(torch.int64).reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)]
    shifts = (torch.arange(8, dtype=torch.int64) * 4)[None, None, :]
    return _as_int32((q << shifts).sum(dim=-1))


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _fp16_model(arch: str, seed: int, tied: bool = False):
    """:func:`dense_model` rounded through fp16 (the dtype GPTQ/AWQ tools save)."""
    model = dense_model(arch, seed, tied)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def _quantized_linears(model) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]


def write_gptq_checkpoint(arch: str, path: Path, bits: int, group_size: int, desc_act: bool,
                          seed: int = 0, tied: bool = False) -> Fixture:
    """A GPTQ v1 checkpoint (module docstring) of :func:`dense_model`, symmetric, RTN from
    each group's absolute max (GPTQ's quantizer without its Hessian updates: ``scale =
    2 amax / (2**bits - 1)``, ``zero = 2**(bits-1)``, ``q = clamp(round(w / scale) + zero,
    0, 2**bits - 1)``); ``desc_act``: groups by decreasing Hessian diagonal from the
    calibration batch (:func:`desc_act_g_idx`), else ``g_idx[k] = k // group_size``.

    The fixture's reference is the fp16-rounded model holding the dequantized weights;
    ``quantization_config`` is ``{quant_method: gptq, bits, group_size, desc_act, sym:
    true, checkpoint_format: gptq, ...}``. ``tied``: the LM head is the embedding table
    (the file holds no ``lm_head.weight``, as ``save_pretrained`` writes a tied model).
    """
    if arch == "mixtral":
        raise ValueError("GPTQ fixtures are written for dense models")
    model = _fp16_model(arch, seed, tied)
    stats = calibrate(model, calibration_ids()) if desc_act else {}
    maxq = 2**bits - 1
    tensors: dict[str, torch.Tensor] = {}
    linears = _quantized_linears(model)
    for name, lin in linears:
        w = lin.weight.data  # [N, K]
        n, k = w.shape
        g_idx = desc_act_g_idx(stats[name][1], group_size) if desc_act else torch.arange(k) // group_size
        groups = k // group_size
        amax = torch.stack([w[:, g_idx == j].abs().amax(-1) for j in range(groups)], dim=1)  # [N, G]
        scale = (2 * amax / maxq).clamp(min=1e-8).half()
        zero = torch.full((n, groups), 2 ** (bits - 1), dtype=torch.int64)
        s_col, z_col = scale.float()[:, g_idx], zero[:, g_idx]  # [N, K]
        q = torch.clamp(torch.round(w / s_col) + z_col, 0, maxq).to(torch.int64)
        lin.weight.data.copy_((q - z_col).float() * s_col)
        tensors[f"{name}.qweight"] = pack_gptq_rows(q.t().contiguous(), bits)
        tensors[f"{name}.qzeros"] = pack_gptq_cols((zero - 1).t().contiguous(), bits)
        tensors[f"{name}.scales"] = scale.t().contiguous()
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    quantized = {n for n, _ in linears}
    for name, t in model.state_dict().items():
        if name.rsplit(".", 1)[0] not in quantized and not (tied and name == "lm_head.weight"):
            tensors[name] = t.half()
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": True,
          "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
          "lm_head": False}
    _save(model, tensors, qc, path, "float16")
    return Fixture(path, _fp16_model(arch, seed, tied), model)


def write_awq_checkpoint(arch: str, path: Path, group_size: int, seed: int = 0) -> Fixture:
    """An AWQ GEMM checkpoint (module docstring) of :func:`dense_model`: 4 bits,
    asymmetric (``zero_point: true``), RTN from each group's min/max as AutoAWQ's
    ``pseudo_quantize_tensor`` (without its activation-aware scale search):
    ``scale = (max - min) / 15`` (stored fp16), ``zero = clamp(-round(min / scale), 0, 15)``,
    ``q = clamp(round(w / scale) + zero, 0, 15)``.

    Reference as :func:`write_gptq_checkpoint`'s; ``quantization_config`` is
    ``{quant_method: awq, bits: 4, group_size, zero_point: true, version: gemm}``.
    """
    if arch == "mixtral":
        raise ValueError("AWQ fixtures are written for dense models")
    model = _fp16_model(arch, seed)
    tensors: dict[str, torch.Tensor] = {}
    linears = _quantized_linears(model)
    for name, lin in linears:
        w = lin.weight.data
        n, k = w.shape
        wg = w.reshape(n, k // group_size, group_size)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo).clamp(min=1e-5) / 15).half()  # [N, G]
        zero = torch.clamp(-torch.round(lo / scale.float()), 0, 15).to(torch.int64)
        s_col = scale.float().repeat_interleave(group_size, dim=1)
        z_col = zero.repeat_interleave(group_size, dim=1)
        q = torch.clamp(torch.round(w / s_col) + z_col, 0, 15).to(torch.int64)
        lin.weight.data.copy_((q - z_col).float() * s_col)
        tensors[f"{name}.qweight"] = pack_awq_cols(q.t().contiguous())
        tensors[f"{name}.qzeros"] = pack_awq_cols(zero.t().contiguous())
        tensors[f"{name}.scales"] = scale.t().contiguous()
    quantized = {n for n, _ in linears}
    for name, t in model.state_dict().items():
        if name.rsplit(".", 1)[0] not in quantized:
            tensors[name] = t.half()
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}
    _save(model, tensors, qc, path, "float16")
    return Fixture(path, _fp16_model(arch, seed), model)


def _save(model, tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any], path: Path,
          dtype: str) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    cfg["torch_dtype"] = dtype
    cfg.pop("dtype", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


# ------------------------------------------------------------------------- references
def reference_model(path: Path, scheme_name: str, dtype: torch.dtype = torch.float32, int8_rule: str = "vllm"):
    """transformers' model of the compressed-tensors checkpoint at ``path`` in ``dtype``
    (module docstring): the default load, or ``dequantize=True`` for asymmetric
    pack-quantized ones; Mixtral's experts by transformers' eager loop, fake-quantizing
    their inputs for ``fp8_dynamic`` when they are quantized.

    Args:
        int8_rule: INT8 W8A8's dynamic activation quantization: ``vllm`` (per token,
            ``s = amax / 127``, ``round(x / s)`` clamped to [-128, 127]: vLLM's
            ``scaled_int8_quant`` and the engine's rule), or ``compressed-tensors`` (its own
            fake quantization, ``s = amax / 127.5``).
    """
    import transformers

    spec = CT_SCHEMES[scheme_name]
    kwargs: dict[str, Any] = {"dtype": dtype}
    if json.loads((path / "config.json").read_text()).get("model_type") == "mixtral":
        kwargs["experts_implementation"] = "eager"  # transformers' loop (its grouped_mm has no fp64)
    if spec.asymmetric:
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
    if spec.preset == "W8A8" and int8_rule == "vllm":
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                module.quantization_enabled = False  # compressed-tensors' activation rule off
                module.register_forward_pre_hook(_int8_per_token_qdq)
    elif spec.preset == "W8A8" and int8_rule != "compressed-tensors":
        raise ValueError(f"int8_rule {int8_rule!r}: vllm or compressed-tensors")
    experts = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for e in experts:  # transformers' expert converter leaves them in the checkpoint's dtype
        e.to(dtype)
    if experts and spec.act_quant and _experts_quantized(path):
        if spec.preset not in ("FP8_DYNAMIC", "FP8"):
            raise ValueError(f"no MoE reference for {scheme_name}: transformers' experts simulate no activation "
                             "quantization, and only FP8's is re-created here")
        scales = _expert_input_scales(path) if spec.preset == "FP8" else {}
        for layer, e in enumerate(experts):
            _fake_quant_experts(e, spec.scheme().input_activations, scales.get(layer))
    return model


def _int8_per_token_qdq(_module, args):
    """vLLM's dynamic per-token INT8 activation quantization, quantized and dequantized."""
    x = args[0]
    s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127.0
    return (torch.round(x / s).clamp(-128, 127) * s, *args[1:])


def _experts_quantized(path: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return any(".experts." in k and k.endswith(("weight_scale", "weight_packed")) for k in f.keys())  # noqa: SIM118


def _expert_input_scales(path: Path) -> dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Static FP8 experts' input scales: layer -> expert -> (the gate/up input's, the
    down input's); gate and up see the same input, and a fused gate/up takes the larger."""
    from safetensors import safe_open

    out: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for layer in range(64):
            pre = f"model.layers.{layer}.block_sparse_moe.experts"
            e = 0
            while f"{pre}.{e}.w1.input_scale" in names:
                s13 = torch.maximum(f.get_tensor(f"{pre}.{e}.w1.input_scale"), f.get_tensor(f"{pre}.{e}.w3.input_scale"))
                out.setdefault(layer, {})[e] = (s13, f.get_tensor(f"{pre}.{e}.w2.input_scale"))
                e += 1
    return out


def _fake_quant_experts(experts: nn.Module, input_args, static: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
                        ) -> None:
    """Give a transformers ``MixtralExperts`` (dequantized ``gate_up_proj``/``down_proj``) a
    forward that fake-quantizes each expert's two inputs with compressed-tensors'
    ``fake_quantize``: per-token dynamic scales (``compute_dynamic_scales_and_zp``), or
    each expert's own static ``input_scale`` (``static``: expert -> (gate/up's, down's))."""
    from compressed_tensors.quantization import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    def qdq(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        # As [1, T, H], the shape a Linear sees in transformers: compressed-tensors' "token"
        # strategy reduces the dimensions after the first two, so a 2-D [T, H] would get
        # one scale for all tokens.
        x3 = x.unsqueeze(0)
        if scale is None:
            scale, zero = compute_dynamic_scales_and_zp(x3, input_args, experts)
        else:
            scale, zero = scale.to(x.dtype), torch.zeros_like(scale, dtype=x.dtype)
        return fake_quantize(x3, scale, zero, input_args)[0]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        inter = self.intermediate_dim
        for e in range(self.num_experts):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            s13, s2 = (None, None) if static is None else static[e]
            h = nn.functional.linear(qdq(hidden_states[tok], s13), self.gate_up_proj[e])
            h = self.act_fn(h[:, :inter]) * h[:, inter:]
            y = nn.functional.linear(qdq(h, s2), self.down_proj[e]) * top_k_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    experts.forward = types.MethodType(forward, experts)  # bound, as compressed-tensors' offloading expects


def logprobs(model, ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of the next-token logits at every position but the last: ``[len - 1,
    vocab]`` fp32 (what ``score_tokens(..., return_logprobs=True).logprobs`` returns)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1).float()


def greedy(model, batch: list[list[int]], new: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy continuations (``new`` tokens each, EOS ignored), each with the
    log-probabilities it chose from: ``(tokens, [new, vocab] fp32)``."""
    model.generation_config.eos_token_id = None
    out = []
    for ids in batch:
        t = torch.tensor([ids])
        gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        steps = torch.stack([torch.log_softmax(s[0].double(), -1) for s in gen.logits]).float()
        out.append((gen.sequences[0, len(ids):].tolist(), steps))
    return out


def safetensors_bytes(path: Path, exclude: tuple[str, ...] = ()) -> int:
    """Bytes of the tensors in ``path``'s ``*.safetensors`` (data only, from the headers),
    leaving out tensors whose name starts with one of ``exclude``."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, meta in header.items():
            if name == "__metadata__" or name.startswith(exclude):
                continue
            start, end = meta["data_offsets"]
            total += end - start
    return total


__all__ = ["ARCHS", "CT_SCHEMES", "VOCAB", "Fixture", "calibrate", "dense_model", "desc_act_g_idx", "greedy",
           "logprobs", "prompts", "reference_model", "safetensors_bytes", "write_awq_checkpoint",
           "write_ct_checkpoint", "write_gptq_checkpoint"]
