"""Reading a PEFT LoRA adapter folder into the products the engine adds.

A PEFT adapter (``peft``'s ``save_pretrained``) is a folder with ``adapter_config.json``
and ``adapter_model.safetensors`` (or the older ``adapter_model.bin``). For each adapted
projection ``W`` ``[out, in]`` it holds ``lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]``; the adapted layer computes
``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (Hu et al. 2021), or
``lora_alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski 2023).

The engine fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
(:mod:`kvpilot.engine.model.layers`), so an adapter's q/k/v (gate/up) pairs are laid out
for the fused projection: their ``A`` rows stacked (``[n * r, in]``) and their ``B``
placed block-diagonally in the fused output rows (``[out_fused, n * r]``, zeros outside
each slice's block), which gives each slice exactly its own ``B_i (A_i x)``. The scaling is
folded into ``B`` once, here (as vLLM's ``LoRAModel.optimize`` does).

What is refused, by name (:class:`~kvpilot.engine.errors.InvalidRequestError`, ``param``
naming the file and field): an adapter type other than LoRA, DoRA, bias training,
``fan_in_fan_out``, rank or alpha patterns, layer selection, extra trained modules
(``modules_to_save``: embeddings, LM head), embedding or LM-head adapters, MoE expert
adapters, target modules the engine does not know, a rank above ``--max-lora-rank``, and
any tensor whose shape does not match the base model (an adapter for another base).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# HF projection name -> (the engine's module under a decoder layer, slice index in it).
# Phi-3 checkpoints are fused already: an adapter on ``qkv_proj``/``gate_up_proj`` adapts
# the whole fused projection (one slice).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "qkv_proj": ("self_attn.qkv_proj", -1),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "gate_up_proj": ("mlp.gate_up_proj", -1),
    "down_proj": ("mlp.down_proj", 0),
}
NOT_SUPPORTED = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(.+?)\.lora_([AB])(?:\.default)?\.weight$")

# adapter_config.json fields that change the adapted layer's math and are supported only
# at these values (field -> allowed values); anything else is refused by name.
_FIXED: dict[str, tuple[Any, ...]] = {
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "use_dora": (False, None),
    "lora_bias": (False, None),
    "layers_to_transform": (None, []),
    "layer_replication": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "modules_to_save": (None, []),
    "trainable_token_indices": (None, [], {}),
    "target_parameters": (None, []),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (False, None),
}


def module_slices(config: ModelConfig, module: str) -> tuple[int, int, list[int]]:
    """``(in_features, out_features, slice sizes)`` of an adaptable projection of one
    decoder layer (``self_attn.qkv_proj`` ...), at tensor-parallel size 1."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {
        "self_attn.qkv_proj": (h, q + 2 * kv, [q, kv, kv]),
        "self_attn.o_proj": (q, h, [h]),
        "mlp.gate_up_proj": (h, 2 * inter, [inter, inter]),
        "mlp.down_proj": (inter, h, [h]),
    }[module]


@dataclass
class LoRAWeights:
    """One adapter's products, ready to copy into a slot.

    Attributes:
        name, int_id: the registration's name and id (:class:`~kvpilot.engine.lora.request.LoRARequest`).
        rank: ``r``; scaling: ``lora_alpha / r`` (or ``/ sqrt(r)``), already in ``B``.
        modules: ``(layer, module)`` -> ``(A [w, in], B [out, w])`` fp32 on the CPU, with
            ``w = r * slices present`` (``module`` as :data:`TARGETS`' values).
        nbytes: the bytes of all ``A`` and ``B``.
    """

    name: str
    int_id: int
    rank: int
    scaling: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param)


def read_config(folder: Path) -> dict[str, Any]:
    """The parsed ``adapter_config.json`` of ``folder``.

    Raises:
        InvalidRequestError: no such folder or file, or not a JSON object (``param``
            ``lora_path`` or ``adapter_config.json``).
    """
    if not folder.is_dir():
        raise _refuse(f"lora_path: {str(folder)!r} is not a folder with a PEFT adapter", "lora_path")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(f"lora_path: {str(folder)!r} has no {CONFIG_FILE}", "lora_path")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise _refuse(f"{CONFIG_FILE}: not valid JSON ({e})", CONFIG_FILE) from None
    if not isinstance(cfg, dict):
        raise _refuse(f"{CONFIG_FILE}: must be a JSON object, got {type(cfg).__name__}", CONFIG_FILE)
    return cfg


def check_config(cfg: dict[str, Any], max_rank: int) -> tuple[int, float, set[str]]:
    """Validate a PEFT LoRA config. Returns ``(r, scaling, target module names)``; the
    target names are PEFT's (``q_proj`` ...), or empty when ``target_modules`` is a regular
    expression (the tensors present then decide).

    Raises:
        InvalidRequestError: ``param`` is ``adapter_config.json: FIELD``, the message names
            the value and what is allowed.
    """
    def param(name: str) -> str:
        return f"{CONFIG_FILE}: {name}"

    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _refuse(f"{param('peft_type')} is {peft_type!r}; only LORA adapters are served", param("peft_type"))
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _refuse(f"{param('r')} must be an integer >= 1, got {r!r}", param("r"))
    if r > max_rank:
        raise _refuse(f"{param('r')} is {r}, above --max-lora-rank {max_rank}; restart with a larger "
                      "--max-lora-rank to serve it", param("r"))
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise _refuse(f"{param('lora_alpha')} must be a number > 0, got {alpha!r}", param("lora_alpha"))
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise _refuse(f"{param('use_rslora')} must be true or false, got {rslora!r}", param("use_rslora"))
    for name, allowed in _FIXED.items():
        if name in cfg and cfg[name] not in allowed:
            shown = ", ".join(json.dumps(a) for a in allowed)
            raise _refuse(f"{param(name)} is {json.dumps(cfg[name])}; the engine serves only {shown}", param(name))
    targets = cfg.get("target_modules")
    names: set[str] = set()
    if isinstance(targets, str):
        pass  # a regular expression over module names: the tensors present decide
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        for t in targets:
            short = t.rsplit(".", 1)[-1]
            if short in NOT_SUPPORTED:
                raise _refuse(f"{param('target_modules')}: {t!r} is an embedding or LM-head adapter, which "
                              "is not supported", param("target_modules"))
            if short not in TARGETS:
                raise _refuse(f"{param('target_modules')}: {t!r} is not a projection the engine can adapt; "
                              f"allowed: {', '.join(TARGETS)}", param("target_modules"))
            names.add(short)
    else:
        raise _refuse(f"{param('target_modules')} must be a non-empty list of module names or a regular "
                      f"expression, got {targets!r}", param("target_modules"))
    scaling = float(alpha) / (math.sqrt(r) if rslora else r)
    return r, scaling, names


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors by name (safetensors, else a ``.bin`` read with
    ``weights_only``). Raises InvalidRequestError (``lora_path``) when there is none or it
    cannot be read."""
    for fname in WEIGHT_FILES:
        path = folder / fname
        if not path.is_file():
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                return dict(load_file(str(path), device="cpu"))
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: refused with its reason
            raise _refuse(f"lora_path: {fname} cannot be read ({type(e).__name__}: {e})", "lora_path") from None
        if not isinstance(loaded, dict):
            raise _refuse(f"lora_path: {fname} holds no tensor dictionary", "lora_path")
        return {str(k): v for k, v in loaded.items()}
    raise _refuse(f"lora_path: {str(folder)!r} has no {' or '.join(WEIGHT_FILES)}", "lora_path")


def fingerprint(folder: Path) -> str:
    """A digest of the adapter's config and weight files (sha256, 16 hex digits): equal
    for the same files on every pod, different when the weights change."""
    h = hashlib.sha256()
    for fname in (CONFIG_FILE, *WEIGHT_FILES):
        path = folder / fname
        if path.is_file():
            h.update(fname.encode() + b"\0")
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def load_adapter(folder: str | Path, name: str, int_id: int, config: ModelConfig, max_rank: int,
                 adaptable: set[tuple[int, str]]) -> LoRAWeights:
    """Read and check one adapter folder against the base model.

    Args:
        folder: the adapter folder (local).
        name, int_id: the registration.
        config: the base model's architecture (tensor-parallel size 1).
        max_rank: ``--max-lora-rank``.
        adaptable: the ``(layer, module)`` projections the model can adapt (an MoE layer's
            experts cannot: its ``mlp.*`` is absent).
    Returns:
        the weights, fp32 on the CPU, scaling folded into ``B``.
    Raises:
        InvalidRequestError: a bad folder, config, tensor name or shape (``param`` names the
            file and field or tensor); nothing is kept.
    """
    folder = Path(folder)
    cfg = read_config(folder)
    r, scaling, targets = check_config(cfg, max_rank)
    pattern = cfg["target_modules"] if isinstance(cfg["target_modules"], str) else None
    if pattern is not None:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise _refuse(f"{CONFIG_FILE}: target_modules is not a valid regular expression ({e})",
                          f"{CONFIG_FILE}: target_modules") from None
    tensors = read_tensors(folder)
    # (layer, HF module path under the layer) -> {"A": t, "B": t}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tname, t in tensors.items():
        if any(f".{bad}." in tname or tname.startswith(f"{bad}.") for bad in NOT_SUPPORTED) \
                or "lora_embedding" in tname:
            raise _refuse(f"lora_path: tensor {tname!r} adapts an embedding or the LM head, which is not "
                          "supported", "lora_path")
        m = _TENSOR.match(tname)
        if m is None:
            raise _refuse(f"lora_path: tensor {tname!r} is not a LoRA A/B weight of a decoder layer's "
                          "projection", "lora_path")
        layer, path, ab = int(m.group(1)), m.group(2), m.group(3)
        pairs.setdefault((layer, path), {})[ab] = t
    if not pairs:
        raise _refuse("lora_path: the adapter holds no LoRA weights", "lora_path")
    by_module: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, path), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{path}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise _refuse(f"lora_path: {where} has no {missing} weight", "lora_path")
        proj = path.rsplit(".", 1)[-1]
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        target = TARGETS.get(proj)
        if target is None:
            raise _refuse(f"lora_path: {where} is not a projection the engine can adapt "
                          f"(allowed: {', '.join(TARGETS)})", "lora_path")
        # PEFT's rule: a list names module suffixes, a string must match the whole module
        # name; a tensor of a module the config does not select is refused, never applied.
        selected = (regex.fullmatch(f"model.{where}") is not None or regex.fullmatch(where) is not None
                    ) if pattern is not None else proj in targets
        if not selected:
            raise _refuse(f"lora_path: {where} has weights, but {CONFIG_FILE}'s target_modules "
                          f"{cfg['target_modules']!r} does not select it", "lora_path")
        module, slice_idx = target
        if parent != module.split(".")[0] or not 0 <= layer < config.num_layers:
            raise _refuse(f"lora_path: {where} has no place in this base model (layers 0..{config.num_layers - 1}; "
                          "MoE experts and shared experts cannot be adapted)", "lora_path")
        if (layer, module) not in adaptable:
            raise _refuse(f"lora_path: {where} adapts a mixture-of-experts layer's MLP, which is not "
                          "supported (adapt the attention projections)", "lora_path")
        a, b = ab["A"], ab["B"]
        fin, fout, sizes = module_slices(config, module)
        out_rows = fout if slice_idx < 0 else sizes[slice_idx]
        if a.dim() != 2 or tuple(a.shape) != (r, fin):
            raise _refuse(f"lora_path: {where}.lora_A has shape {tuple(a.shape)}, expected ({r}, {fin}) for "
                          f"r={r} on this base model (an adapter for another base?)", "lora_path")
        if b.dim() != 2 or tuple(b.shape) != (out_rows, r):
            raise _refuse(f"lora_path: {where}.lora_B has shape {tuple(b.shape)}, expected ({out_rows}, {r}) on "
                          "this base model (an adapter for another base?)", "lora_path")
        slices = by_module.setdefault((layer, module), {})
        slices[slice_idx] = (a, b)
        if -1 in slices and len(slices) > 1:
            raise _refuse(f"lora_path: layers.{layer} adapts {module} both fused and by its parts", "lora_path")
    weights = LoRAWeights(name, int_id, r, scaling)
    for (layer, module), slices in by_module.items():
        fin, fout, sizes = module_slices(config, module)
        if -1 in slices:  # a whole fused projection
            a, b = slices[-1]
            weights.modules[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
            continue
        present = sorted(slices)
        a_full = torch.cat([slices[i][0].float() for i in present], dim=0)
        b_full = torch.zeros(fout, r * len(present))
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        for k, i in enumerate(present):
            b_full[offsets[i]:offsets[i + 1], k * r:(k + 1) * r] = slices[i][1].float() * scaling
        weights.modules[(layer, module)] = (a_full.contiguous(), b_full)
    return weights
