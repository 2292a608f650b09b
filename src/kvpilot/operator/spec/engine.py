"""``spec.engine``: the ``kvpilot serve`` settings of the engine pods (KV-cache dtype,
block size, batch limits, prefix caching, tensor parallelism, ``extraArgs``).

``engine.extraArgs`` is refused when it repeats a flag the operator sets from a spec field
(:data:`MANAGED_FLAGS`) or holds anything ``kvpilot serve`` would refuse
(:mod:`kvpilot.flags.check`). The tensor-parallel size is resolved against the pod's GPUs
afterwards, by :func:`kvpilot.operator.spec.gpus.resolve_tensor_parallel`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvpilot.flags.check import VLLMFlagError, split_vllm_flags
from kvpilot.flags.serve import MANAGED_FLAGS, OPERATOR_LORA_FLAGS, OPERATOR_QUANTIZATION_FLAGS
from kvpilot.operator.spec.adapters import LoraSpec, parse_lora
from kvpilot.operator.spec.defaults import DEFAULTS
from kvpilot.operator.spec.fields import FieldReader, SpecError

KV_CACHE_DTYPES = (
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int4",
)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# The managed flags engine.tensorParallelSize sets (vLLM's long and short spellings).
TENSOR_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp")
MAX_TENSOR_PARALLEL_SIZE = 64
# The /dev/shm sizeLimit of a tensor-parallel pod when engine.shmSize is not set.
DEFAULT_SHM_SIZE = "2Gi"
# engine.shmSize (the CRD's pattern): a whole number of bytes with an optional suffix.
_SHM_SIZE = re.compile(r"^[1-9][0-9]*(Ki|Mi|Gi|Ti|k|M|G|T)?$")
# Why engine.extraArgs may hold no positional argument (kvpilot serve's would be the model).
POSITIONAL_REASON = ("a positional argument: the engine would take it for the model, which "
                     "the operator sets from model.uri")
# Set by the operator when the router's kv_aware policy needs the engines' KV events.
KV_EVENTS_FLAG = "--kv-events-config"


@dataclass(frozen=True)
class EngineSpec:
    """``spec.engine``: the ``kvpilot serve`` settings. ``image`` None = operator default."""

    image: str | None
    image_pull_policy: str
    kv_cache_dtype: str
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float | None
    max_model_len: int | None
    extra_args: tuple[str, ...]
    # Resolved by parse_spec: engine.tensorParallelSize, else the pod's whole-GPU count
    # (1 for CPU pods and MIG slices).
    tensor_parallel_size: int = 1
    shm_size: str | None = None
    # engine.lora (None: absent; LoRA is then on only with spec.adapters, at the defaults).
    lora: LoraSpec | None = None

    @property
    def shm_size_limit(self) -> str | None:
        """The /dev/shm volume's sizeLimit: engine.shmSize, else 2Gi with tensor
        parallelism (its workers exchange tensors through shared memory), else none."""
        if self.shm_size is not None:
            return self.shm_size
        return DEFAULT_SHM_SIZE if self.tensor_parallel_size > 1 else None


def _check_serve_flags(extra: tuple[str, ...]) -> None:
    """Refuse ``engine.extraArgs`` the engine would refuse (:mod:`kvpilot.flags.check`): vLLM
    flags kvpilot cannot honour, unknown flags and positional arguments (the operator sets
    ``--model``); vLLM's no-op flags pass, as the engine accepts them. One SpecError names
    every such argument with its reason."""
    try:
        split_vllm_flags(extra, positional_reason=POSITIONAL_REASON)
    except VLLMFlagError as exc:
        bad = [p.arg for p in exc.problems]
        raise SpecError("engine.extraArgs", bad[0] if len(bad) == 1 else bad,
                        f"kvpilot serve would fail: {exc}") from None


def parse_engine(raw: Any) -> EngineSpec:
    """``spec.engine`` with the CRD's defaults. ``tensor_parallel_size`` is 0 when the
    field is absent (resolved from the pod's GPUs by ``resolve_tensor_parallel``). Raises
    SpecError on the first invalid field."""
    r = FieldReader(raw, "engine", DEFAULTS)
    extra = r.items("extraArgs")
    for arg in extra:
        if not isinstance(arg, str):
            raise SpecError("engine.extraArgs", arg, "each entry must be a string")
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            field_hint = (" (engine.tensorParallelSize; default: the pod's GPU count)"
                          if flag in TENSOR_PARALLEL_FLAGS else
                          " (spec.adapters and engine.lora)" if flag in OPERATOR_LORA_FLAGS
                          else " (model.quantization)" if flag in OPERATOR_QUANTIZATION_FLAGS
                          else "")
            raise SpecError("engine.extraArgs", arg, "set the matching spec field"
                            f"{field_hint} instead of repeating a managed flag")
        if arg in ("-h", "--help"):
            raise SpecError("engine.extraArgs", arg, "the engine would print its help and exit")
    _check_serve_flags(extra)
    engine = EngineSpec(
        image=r.string("image"),
        image_pull_policy=r.choice("imagePullPolicy", PULL_POLICIES),
        kv_cache_dtype=r.choice("kvCacheDtype", KV_CACHE_DTYPES),
        max_num_batched_tokens=r.integer("maxNumBatchedTokens", 1, 1 << 20),
        max_num_seqs=r.integer("maxNumSeqs", 1, 65536),
        block_size=r.choice("blockSize", BLOCK_SIZES),
        enable_prefix_caching=r.boolean("enablePrefixCaching"),
        gpu_memory_utilization=r.optional_number("gpuMemoryUtilization", 0.0, 1.0, lo_open=True),
        max_model_len=r.optional_integer("maxModelLen", 1, 1 << 30),
        extra_args=extra,
        # 0 until parse_spec resolves it (absent = the pod's GPU count).
        tensor_parallel_size=r.optional_integer("tensorParallelSize", 1,
                                                MAX_TENSOR_PARALLEL_SIZE) or 0,
        shm_size=r.string("shmSize"),
        lora=parse_lora(r.raw.get("lora")),
    )
    if engine.shm_size is not None and not _SHM_SIZE.fullmatch(engine.shm_size):
        raise SpecError("engine.shmSize", engine.shm_size,
                        "a positive whole quantity of bytes such as 2Gi, 512Mi or 8G")
    if engine.max_num_batched_tokens < engine.max_num_seqs:
        raise SpecError("engine.maxNumBatchedTokens", engine.max_num_batched_tokens,
                        f"must be >= engine.maxNumSeqs ({engine.max_num_seqs})")
    if engine.max_model_len is not None and engine.max_model_len < engine.block_size:
        raise SpecError("engine.maxModelLen", engine.max_model_len,
                        f"must be >= engine.blockSize ({engine.block_size})")
    return engine
