"""The ``kvpilot serve`` command line of an engine pod, from the spec.

Flag names are the engine's (vLLM-compatible, docs/architecture.md "CLI"). Every flag the
spec controls is written explicitly, defaults included, so a pod's command line says
exactly how it runs and a change of engine default never changes a running fleet silently.
"""

from __future__ import annotations

import json

from kvpilot.operator import constants as c
from kvpilot.operator.spec import InferenceSpec
from kvpilot.operator.spec.engine import KV_EVENTS_FLAG
from kvpilot.operator.spec.gpus import GPU_RESOURCE_SUFFIX, MIG_RESOURCE_PREFIX, nonzero_quantity
from kvpilot.sizing.quantization import AUTO, weight_format

QUANTIZATION_FLAG = "--quantization"

ENGINE_COMMAND = ("kvpilot", "serve")
# On deletion the kubelet runs the preStop sleep (so the Service drops the pod first), then
# sends SIGTERM; terminationGracePeriodSeconds counts from the start of both. The engine's
# drain gets what is left, minus time to exit before the SIGKILL.
PRESTOP_SLEEP_SECONDS = 10
EXIT_MARGIN_SECONDS = 5


def prestop_sleep_seconds(spec: InferenceSpec) -> int:
    """The preStop sleep: 10 s, or a third of a shorter grace period."""
    return min(PRESTOP_SLEEP_SECONDS, spec.pod.termination_grace_period_seconds // 3)


def drain_timeout_seconds(spec: InferenceSpec) -> int:
    """``--drain-timeout``: how long in-flight generations may run after SIGTERM, so that
    the engine exits 0 on its own before the grace period ends (never negative)."""
    grace = spec.pod.termination_grace_period_seconds
    return max(0, grace - prestop_sleep_seconds(spec) - EXIT_MARGIN_SECONDS)


def is_gpu_resource(name: str) -> bool:
    """``*/gpu`` (nvidia.com/gpu, amd.com/gpu) or an NVIDIA MIG slice (nvidia.com/mig-1g.10gb)."""
    return name.endswith(GPU_RESOURCE_SUFFIX) or name.startswith(MIG_RESOURCE_PREFIX)


def gpu_resource_names(spec: InferenceSpec) -> list[str]:
    """The accelerator resources the pod asks for at least one of, sorted (a limit of 0
    asks for none: such a pod runs on the CPU)."""
    resources = spec.pod.resources
    asked = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
    return sorted(name for name, qty in asked.items() if is_gpu_resource(name) and nonzero_quantity(qty))


def uses_gpu(spec: InferenceSpec) -> bool:
    """True when the pod asks for an accelerator: the engine then runs with ``--device cuda``."""
    return bool(gpu_resource_names(spec))


def kv_events_config() -> str:
    """``--kv-events-config``: vLLM's KVEventsConfig as JSON. The engine publishes its KV
    block stored/removed events on a ZMQ PUB socket on every interface (the router connects
    to the pod IP) and keeps a replay socket for a subscriber that missed some."""
    return json.dumps({
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{c.KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{c.KV_EVENTS_REPLAY_PORT}",
        "topic": c.KV_EVENTS_TOPIC,
    }, separators=(", ", ": "))


def adapters_file() -> str:
    """Where the engine reads the adapter list it loads at start-up (the ConfigMap's key)."""
    return f"{c.ADAPTERS_DIR}/{c.ADAPTERS_FILE_KEY}"


def lora_args(spec: InferenceSpec) -> list[str]:
    """The LoRA flags while LoRA is on (``spec.adapters`` or ``engine.lora``), else [].
    Only the limits are written, never the adapters: the list lives in the adapters
    ConfigMap, so changing it leaves the pod template (and the pods) alone."""
    lora = spec.lora
    if lora is None:
        return []
    args = ["--enable-lora", "--max-loras", str(lora.max_loras),
            "--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return [*args, "--lora-adapters-file", adapters_file()]


def quantization_args(spec: InferenceSpec) -> list[str]:
    """``--quantization`` with vLLM's value for ``model.quantization`` (``w4a16-g128``
    -> ``compressed-tensors``, ``gptq-int4`` -> ``gptq``, ``gguf-q4_k`` -> ``gguf``: the
    table of :mod:`kvpilot.sizing.quantization`): the engine checks the checkpoint against
    it. [] for ``auto`` (the engine reads the format from the checkpoint)."""
    if spec.model.quantization == AUTO:
        return []
    value = weight_format(spec.model.quantization).vllm
    return [QUANTIZATION_FLAG, value]


def engine_args(spec: InferenceSpec) -> list[str]:
    """Arguments after ``kvpilot serve``; ``engine.extraArgs`` come last, unchanged."""
    e = spec.engine
    args = ["--host", "0.0.0.0", "--port", str(c.ENGINE_PORT), "--model", spec.model.model_arg]
    if spec.model.served_model_name:
        args += ["--served-model-name", spec.model.served_model_name]
    args += [
        "--device", "cuda" if uses_gpu(spec) else "cpu",
        # engine.tensorParallelSize, else the pod's whole-GPU count (spec.parse_spec).
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--kv-cache-dtype", e.kv_cache_dtype,
        "--max-num-batched-tokens", str(e.max_num_batched_tokens),
        "--max-num-seqs", str(e.max_num_seqs),
        "--block-size", str(e.block_size),
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
        "--drain-timeout", str(drain_timeout_seconds(spec)),
        *quantization_args(spec),
    ]
    if e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", repr(e.gpu_memory_utilization)]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    if spec.router.wants_kv_events:
        args += [KV_EVENTS_FLAG, kv_events_config()]
    return args + lora_args(spec) + list(e.extra_args)
