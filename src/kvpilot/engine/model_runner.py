"""The model runner: owns the device, the weights and the KV cache tensors.

It turns a :class:`SchedulerOutput` into tensors, runs the model and returns logits for
the requests that sample this step. It is the only engine component that touches the
device (besides the sampler, which works on its logits).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.attention.backend import (
    AttentionMetadata,
    get_attention_backend,
    resolve_backend_name,
)
from kvpilot.engine.config import (
    KV4_CACHE_DTYPES,
    EngineArgs,
    ResolvedConfig,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.cpu_threads import cpu_threads
from kvpilot.engine.distributed import TPGroup, check_tensor_parallel, rank_config, shard_weights
from kvpilot.engine.kv_cache import PagedKVCache, bytes_per_block, check_skip_layers, element_bytes
from kvpilot.engine.kv_scales import (
    CALIBRATION_MAX_TOKENS,
    calibrate_at_startup,
    calibration_token_ids,
)
from kvpilot.engine.lora.manager import LoRAConfig, LoRAManager
from kvpilot.engine.model.config import GEMMA_ARCHITECTURES, ModelConfig, UnsupportedModelError
from kvpilot.engine.model.gemma import GemmaForCausalLM
from kvpilot.engine.model.layers import (
    can_pack_linears,
    finish_quantized,
    probe_batch_invariance,
    quantize_linears,
)
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.loader import (
    GGUFModelFile,
    ModelSource,
    iter_weights,
    load_model_config,
    resolve_model,
)
from kvpilot.engine.model.moe import finish_quantized_experts, quantize_experts
from kvpilot.engine.quantization.checkpoint import group_quantized
from kvpilot.engine.quantization.config import CheckpointQuantization, load_quantization
from kvpilot.engine.quantization.weights import FloatWeight, QuantizedWeight
from kvpilot.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

GIB = 1 << 30


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class for ``config.architecture``: Gemma 2/3 have their own
    (:mod:`kvpilot.engine.model.gemma`), every other architecture runs the Llama one."""
    return GemmaForCausalLM if config.architecture in GEMMA_ARCHITECTURES else LlamaForCausalLM


def build_model(
    config: ModelConfig,
    source: ModelSource | None,
    gguf_file: GGUFModelFile | None,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    tp: TPGroup | None = None,
    quant: CheckpointQuantization | None = None,
) -> LlamaForCausalLM:
    """Create the model on ``device`` in ``dtype`` and load its weights.

    ``load_format="dummy"`` fills random weights (std 0.02; norms 1) instead, for
    benchmarks of large shapes without a checkpoint. With ``tp`` (more than one rank) the
    model is rank ``tp.rank``'s shard (:mod:`kvpilot.engine.distributed`): built from
    :func:`~kvpilot.engine.distributed.rank_config`, loaded from the sliced checkpoint
    tensors; dummy weights are then drawn per rank (seed + rank). With ``quant`` (the
    checkpoint's quantization) the linears it quantizes are built as
    :class:`~kvpilot.engine.model.layers.QuantizedLinear` before any memory is allocated,
    so their dense weights never exist; they are joined and repacked for ``device`` after
    loading (``model.packed_bytes`` counts their bytes).
    """
    size = 1 if tp is None else tp.size
    local = config if tp is None else rank_config(config, tp.rank, size)
    with torch.device("meta"):
        model = model_class(local)(local, max_positions)
        if tp is not None and size > 1:
            model.enable_tensor_parallel(tp, config.vocab_size)
            seed += tp.rank
        quantized_names: set[str] = set()
        kept_float: dict[str, torch.dtype] = {}
        if quant is not None:
            stored = checkpoint_dtypes(source)
            parts = None if stored is None else checkpoint_modules(stored)
            has = None if parts is None else parts.__contains__
            quantized = quant.is_quantized

            def quantized_here(name: str) -> bool:
                """The config quantizes it and the checkpoint holds it so (GPTQ and AWQ leave
                modules they cannot quantize, e.g. a 1-row shared-expert gate, dense)."""
                assert parts is not None
                return quant.is_quantized(name) and (quant.online or bool(parts.get(name, set()) - {"weight", "bias"}))

            if parts is not None:
                quantized = quantized_here
            kept_float = stored_float_modules(stored, model, dtype, device, size)
            if kept_float:
                logger.info("weights: %s kept as stored (%s)", ", ".join(sorted(kept_float)),
                            ", ".join(sorted({str(d).removeprefix("torch.") for d in kept_float.values()})))
            quantized_names = quantize_linears(model, model.checkpoint_names,
                                               lambda n: n in kept_float or quantized(n), dtype, has,
                                               embeddings=quant.method == "gguf" or "model.embed_tokens" in kept_float)
            quantized_names |= quantize_experts(model, quantized, has)
            logger.info("weights: %s (%d checkpoint modules quantized)", quant.summary(),
                        len(quantized_names - kept_float.keys()))
    model = model.to_empty(device=device).to(dtype)
    if load_format == "dummy":
        # Drawn where the weights live: an 8B model's 8e9 normals take about a minute on
        # the host and well under a second on a GPU. Seeded per device type, so CPU and
        # CUDA weights differ, each reproducible.
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif device.type == "cpu":  # float32 draws, then cast: the bytes the tests know
                    p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(dtype))
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    else:
        assert source is not None
        weights = iter_weights(source, config, gguf_file, keep_quantized=quant is not None)
        if quant is not None and source.kind != "gguf":  # GGUF yields its quantized weights itself
            weights = keep_stored_dtype(group_quantized(weights, quant, quantized_names - kept_float.keys()), kept_float)
        model.load_weights(weights if tp is None else shard_weights(weights, config, tp.rank, size))
    if quant is not None:
        model.packed_bytes += finish_quantized(model, device) + finish_quantized_experts(model, device)
    model.init_rotary(device)
    model.eval()
    if can_pack_linears(device, dtype):
        try:
            packed = model.pack_linears()
            logger.info("packed %d linear weights for oneDNN (CPU)", packed)
        except RuntimeError as e:  # oneDNN cannot pack here: plain F.linear (MKL) stays
            logger.warning("oneDNN weight packing unavailable, using F.linear: %s", e)
    model.batch_invariant, detail = probe_batch_invariance(model)
    if model.batch_invariant:
        logger.info("matrix products are batch invariant here (%s): a request's bytes do not depend on its batch",
                    detail)
    else:
        logger.info("matrix products are not batch invariant here (%s): a request's last bits, and with a quantized "
                    "KV cache sometimes its tokens, can depend on what it was batched with (docs/engine.md, "
                    "Determinism)", detail)
    return model


_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_float_modules(stored: dict[str, str] | None, model: torch.nn.Module, dtype: torch.dtype,
                         device: torch.device, tp_size: int) -> dict[str, torch.dtype]:
    """The token embedding and LM head of a quantized HF checkpoint that a float32 model on
    CPU keeps as stored (:class:`~kvpilot.engine.quantization.weights.FloatWeight`):
    checkpoint module -> stored dtype. Those are a bfloat16/float16 embedding or LM head
    (widened they would take twice their file bytes), and a tied float32 embedding (its
    head then reads the table in place instead of holding a packed copy of it). Empty for
    other dtypes, devices and sources, and with tensor parallelism (the
    vocabulary-parallel embedding keeps the model dtype).

    Args:
        stored: the checkpoint's tensors and dtypes (:func:`checkpoint_dtypes`); None for
            a source that is not an HF folder.
    """
    if stored is None or dtype != torch.float32 or device.type != "cpu" or tp_size > 1:
        return {}
    tied = getattr(model, "lm_head", None) is None
    kept: dict[str, torch.dtype] = {}
    for module in ("model.embed_tokens",) if tied else ("model.embed_tokens", "lm_head"):
        kind = _FLOAT_DTYPES.get(stored.get(f"{module}.weight", ""))
        if kind in (torch.bfloat16, torch.float16) or (kind == torch.float32 and tied):
            kept[module] = kind
    return kept


def keep_stored_dtype(weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]],
                      modules: dict[str, torch.dtype]) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Pass tensors through, ``<module>.weight`` of ``modules``
    (:func:`stored_float_modules`) as a
    :class:`~kvpilot.engine.quantization.weights.FloatWeight` of the stored tensor."""
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and name.endswith(".weight") and name.removesuffix(".weight") in modules:
            # A copy: the loader's tensors may view the file's memory map, which would then
            # stay mapped (and fault if the file changed) for as long as the engine runs.
            yield name, FloatWeight(tensor.clone(), name)
        else:
            yield name, tensor


def checkpoint_dtypes(source: ModelSource | None) -> dict[str, str] | None:
    """An HF checkpoint's tensor names and stored dtypes (safetensors' names: ``F32``,
    ``BF16``, ``I32`` ...), read from the safetensors headers only, once per load; None
    for other sources (a GGUF file's quantization names its modules itself)."""
    if source is None or source.kind != "hf":
        return None
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    for file in sorted(source.path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                dtypes[key] = f.get_slice(key).get_dtype()
    return dtypes


def checkpoint_modules(stored: dict[str, str]) -> dict[str, set[str]]:
    """The checkpoint's module names and their tensors' suffixes
    (``model.layers.0.self_attn.q_proj`` -> ``{weight_packed, weight_scale, ...}``), from
    :func:`checkpoint_dtypes`."""
    modules: dict[str, set[str]] = {}
    for key in stored:
        module, _, part = key.rpartition(".")
        modules.setdefault(module, set()).add(part)
    return modules


def num_kv_blocks(
    args: EngineArgs,
    config: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    weight_bytes: int,
    num_layers: int,
    kv4: str | None = None,
    act_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Size the pool: the override, else ``--kv-cache-memory`` GiB on CPU, else on CUDA
    ``total x --gpu-memory-utilization`` minus what is in use, minus an activation
    estimate for one full step. A block's bytes count 4-bit group scales and the
    ``--kv-cache-skip-layers`` at the model dtype."""
    per_block = bytes_per_block(
        num_layers, args.block_size, config.num_kv_heads, config.head_dim, kv_dtype, kv4,
        tuple(sorted(set(args.kv_cache_skip_layers))), act_dtype,
    )
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    if device.type != "cuda":
        return max(1, int(args.kv_cache_memory * GIB) // per_block)
    # Memory torch's caching allocator holds but no tensor uses (the dummy weights' draws,
    # the load-time probes) reads as "in use" to the driver: return it first, or the
    # cache comes out smaller. On the H200 the first Llama-3-8B engine of a process got
    # 695k bf16 tokens and a later one 816k-equivalent before this (benchmarks/README.md).
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    act_bytes = element_bytes(torch.float32) * args.max_num_batched_tokens * (
        4 * config.hidden_size + 3 * config.intermediate_size + config.q_size + 2 * config.kv_size
    ) + args.max_num_seqs * config.vocab_size * 4 * 3
    budget = int(total * args.gpu_memory_utilization) - used - act_bytes
    if budget < per_block:
        raise ValueError(
            f"no GPU memory left for the KV cache: total {total / GIB:.1f} GiB x utilization "
            f"{args.gpu_memory_utilization} - in use {used / GIB:.1f} GiB (weights {weight_bytes / GIB:.1f} GiB) "
            f"- activations {act_bytes / GIB:.2f} GiB; raise --gpu-memory-utilization"
        )
    return budget // per_block


@dataclass
class LoadedModel:
    """Weights, tokenizer and architecture, loaded once and shareable between engines
    that differ only in cache or scheduler settings (tests, side-by-side benchmarks).

    With tensor parallelism this is one rank's shard; the worker processes of the other
    ranks are not this object's: the engine owns them
    (:class:`~kvpilot.engine.tp_executor.TPExecutor`)."""

    source: ModelSource
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    model_max_len: int
    load_seconds: float
    # Tensor parallelism: this rank's group.
    tp: TPGroup | None = None

    @property
    def weight_bytes(self) -> int:
        """This rank's weights (with tensor parallelism, its shard)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + self.model.packed_bytes

    @property
    def rank_config(self) -> ModelConfig:
        """The shapes this rank holds (its heads and slices); ``config`` is the whole model."""
        return self.model.config

    def close(self) -> None:
        """Drop this rank's tensor-parallel group (idempotent)."""
        if self.tp is not None:
            self.tp.close()


@dataclass
class LoadPlan:
    """What :func:`plan_load` resolved before any weight is read (and before any
    tensor-parallel worker starts): the model's source, config and tokenizer, the device
    and dtype, and the served context. ``started``: ``time.monotonic()`` at the start."""

    source: ModelSource
    config: ModelConfig
    gguf_file: GGUFModelFile | None
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    model_max_len: int
    served_len: int
    started: float
    quantization: CheckpointQuantization | None = None


def plan_load(args: EngineArgs) -> LoadPlan:
    """Resolve ``args.model``, read its config and tokenizer, check the tensor-parallel
    split and pick the device, dtype and CPU threads (sets ``torch``'s thread count on CPU).

    Raises:
        ModelNotFoundError, UnsupportedModelError: with what was found and what is supported.
        ValueError: ``--max-model-len`` above the model's context; a tensor-parallel size
            the model cannot be split into.
    """
    t0 = time.monotonic()
    source = resolve_model(args.model)
    if source.kind == "preset" and args.load_format != "dummy":
        raise ValueError(f"--model preset:{source.name} is an architecture without weights; add --load-format dummy")
    config, gguf_file = load_model_config(source)
    check_tensor_parallel(config, args.tensor_parallel_size)
    quant = load_quantization(source, gguf_file, args.quantization, args.load_format)
    if quant is not None and args.tensor_parallel_size > 1:
        if source.kind != "gguf":
            raise UnsupportedModelError(f"--tensor-parallel-size {args.tensor_parallel_size} with quantized weights "
                                        f"({quant.summary()}) is not supported yet; use 1")
        # A GGUF file can be read dequantized: its ranks hold their slices in the model dtype.
        logger.warning("--tensor-parallel-size %d: tensor parallelism over quantized weights is not supported "
                       "yet, so the GGUF file is dequantized at load (%s)", args.tensor_parallel_size,
                       quant.summary())
        quant = None
    if args.skip_tokenizer_init or (source.kind == "preset" and args.tokenizer is None):
        tokenizer = None  # token ids in and out
    else:
        tokenizer = load_tokenizer(source, args.tokenizer)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if device.type == "cpu":
        # Tensor-parallel ranks on one host share its cores.
        threads = max(1, cpu_threads() // args.tensor_parallel_size)
        if threads != torch.get_num_threads():
            logger.info("using %d CPU threads (affinity and cgroup quota)", threads)
            torch.set_num_threads(threads)
    model_max = config.max_position_embeddings
    if args.disable_sliding_window and config.sliding_window:
        # vLLM's --disable-sliding-window: full attention, context capped to the window.
        model_max = min(model_max, config.sliding_window)
        config = config.without_sliding_window()
    if args.max_model_len is not None and args.max_model_len > model_max:
        raise ValueError(f"--max-model-len {args.max_model_len} is larger than the model's context ({model_max} tokens)")
    # The served context picks LongRoPE's factor list and sizes the RoPE tables.
    served = args.max_model_len if args.max_model_len is not None else model_max
    return LoadPlan(source, config, gguf_file, tokenizer, device, dtype, model_max, served, t0, quant)


def load_planned(args: EngineArgs, plan: LoadPlan, tp: TPGroup | None = None) -> LoadedModel:
    """Build and load the model :func:`plan_load` planned: the whole model, or with ``tp``
    rank ``tp.rank``'s shard on ``tp.device``."""
    device = plan.device if tp is None else tp.device
    model = build_model(plan.config, plan.source, plan.gguf_file, plan.served_len, plan.dtype, device,
                        args.load_format, args.seed, tp, plan.quantization)
    return LoadedModel(plan.source, plan.config, model, plan.tokenizer, device, plan.dtype, plan.model_max_len,
                       time.monotonic() - plan.started, tp)


def load_model(args: EngineArgs, tp: TPGroup | None = None) -> LoadedModel:
    """Resolve ``args.model``, read its config and tokenizer, and load the weights: the
    whole model, or with ``tp`` (a tensor-parallel worker) rank ``tp.rank``'s shard.

    This loads one rank; with ``--tensor-parallel-size N > 1`` the engine starts the other
    ranks first (:func:`kvpilot.engine.tp_executor.load_with_workers`).

    Raises:
        ModelNotFoundError, UnsupportedModelError: with what was found and what is supported.
        ValueError: ``--max-model-len`` above the model's context; a tensor-parallel size
            the model cannot be split into; ``--tensor-parallel-size`` above 1 without ``tp``.
    """
    if tp is None and args.tensor_parallel_size > 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: load_model loads one rank; "
                         "kvpilot.engine.tp_executor.load_with_workers starts the workers and loads rank 0")
    return load_planned(args, plan_load(args), tp)


@dataclass
class StepInputs:
    """One step, flattened (plain lists: what rank 0 sends each tensor-parallel worker).

    ``ids``/``positions``/``slots``: per token; ``qsl``: query start offsets (``num_seqs +
    1``); ``seq_lens``: per sequence; ``tables``: block tables, ``num_seqs x max_blocks``
    row-major (0-padded); ``logits_rows``: rows whose logits are computed, in ``chunks``
    (the sampling rows, then each prompt-logprobs span).
    """

    ids: list[int]
    positions: list[int]
    slots: list[int]
    qsl: list[int]
    seq_lens: list[int]
    tables: list[int]
    max_blocks: int
    num_decodes: int
    max_query_len: int
    logits_rows: list[int]
    chunks: list[int]


class ModelRunner:
    """Loads the model, allocates the KV cache, and executes scheduler outputs."""

    def __init__(self, args: EngineArgs, loaded: LoadedModel) -> None:
        # The KV cache holds this rank's KV heads (with tensor parallelism, its shard).
        device, dtype, model_config = loaded.device, loaded.dtype, loaded.rank_config
        self.tp = loaded.tp
        if (args.device != "auto" and torch.device(args.device).type != device.type) or (
            args.dtype != "auto" and resolve_dtype(args.dtype, device) != dtype
        ):
            raise ValueError("the loaded model's device/dtype differ from these engine args")
        kv_dtype, kv_name = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
        kv4 = kv_name if kv_name in KV4_CACHE_DTYPES else None
        check_skip_layers(args.kv_cache_skip_layers, model_config.num_layers,
                          kv4 is not None or kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2), kv_name)
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.model = loaded.model
        # Adapter slots are allocated before the KV cache is sized (on CUDA they count
        # as memory in use).
        self.lora: LoRAManager | None = None
        if args.enable_lora:
            if self.tp is not None:
                raise ValueError("--enable-lora with --tensor-parallel-size > 1 is not supported yet: the adapter "
                                 "products are not split over the ranks; serve adapters with one rank")
            self.lora = LoRAManager(self.model, model_config, LoRAConfig(
                args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras), device, dtype)
        num_blocks = num_kv_blocks(
            args, model_config, kv_dtype, device, loaded.weight_bytes, model_config.num_layers, kv4, dtype
        )
        if self.tp is not None:  # every rank holds every block: the smallest rank decides
            num_blocks = self.tp.min_int(num_blocks)
        capacity = num_blocks * args.block_size
        max_model_len = args.max_model_len or min(loaded.model_max_len, capacity)
        # (request, first position, count) of this step's prompt-logprob rows (prepare_inputs).
        self.prompt_spans: list[tuple[Any, int, int]] = []
        self.kv_cache = PagedKVCache(
            model_config.num_layers, num_blocks, args.block_size, model_config.num_kv_heads,
            model_config.head_dim, kv_dtype, device, act_dtype=dtype, rotate_keys=args.kv_cache_key_rotation,
            kv4=kv4, skip_layers=args.kv_cache_skip_layers, live=args.calculate_kv_scales,
            reduce_max=self.tp.all_reduce_max if self.tp is not None else None,
        )
        self.kv_cache.load_checkpoint_scales(
            {i: (d["k"], d["v"]) for i, d in loaded.model.kv_cache_scales.items() if "k" in d and "v" in d}
        )
        backend_name = resolve_backend_name(args.attention_backend, device)
        self.backend = get_attention_backend(backend_name, device)
        if self.kv_cache.needs_calibration and not args.calculate_kv_scales:
            self._fix_kv_scales(loaded.tokenizer, min(capacity, loaded.model_max_len, CALIBRATION_MAX_TOKENS))
        self.resolved = ResolvedConfig(
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            kv_cache_dtype_name=kv_name,
            attention_backend=backend_name,
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_model_len=max_model_len,
            served_model_name=args.served_model_name or loaded.source.name,
            sliding_window=model_config.sliding_window if model_config.all_layers_slide else None,
            tensor_parallel_size=1 if self.tp is None else self.tp.size,
        )
        logger.info(
            "engine ready: %s %s on %s%s, weights %.0f MiB (loaded in %.1fs); KV cache %s, %d blocks x %d = %d tokens; "
            "attention %s", self.resolved.served_model_name, dtype, device,
            "" if self.tp is None else f" (tensor-parallel rank {self.tp.rank} of {self.tp.size}, per rank)",
            loaded.weight_bytes / 2**20, loaded.load_seconds,
            kv_name + (" (keys rotated)" if self.kv_cache.rotates_keys else ""), num_blocks, args.block_size,
            capacity, backend_name,
        )

    def _fix_kv_scales(self, tokenizer: Any, limit: int) -> None:
        """Scales for a quantized cache without checkpoint scales, fixed before serving:
        a start-up pass over the built-in calibration text, or 1.0 without a tokenizer
        (:mod:`kvpilot.engine.kv_scales`)."""
        ids = calibration_token_ids(tokenizer, limit) if tokenizer is not None else []
        if len(ids) < 2:
            self.kv_cache.default_scales()
            return
        # The torch backend (the reference) runs the pass whatever serves, so the scales
        # depend on the model, the text and the device, not on the attention backend.
        calibrate_at_startup(self.model, get_attention_backend("torch", self.device), self.kv_cache, ids)

    # ------------------------------------------------------------- inputs
    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the step into ``input_ids``, ``positions``, attention metadata and the
        rows whose logits are needed: the last token of each sampling request, then the
        prompt positions of requests that asked for prompt logprobs (their spans are in
        ``self.prompt_spans``)."""
        return self.to_tensors(self.flatten(out))

    def flatten(self, out: SchedulerOutput) -> StepInputs:
        """The step as plain lists (:class:`StepInputs`): what tensor-parallel workers are
        sent. Sets ``self.prompt_spans``."""
        items = out.scheduled
        prompt_rows: list[int] = []
        self.prompt_spans = []
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        max_blocks = 1
        for it in items:
            n = it.num_tokens
            ids.extend(it.token_ids)
            positions.extend(range(it.start_position, it.start_position + n))
            slots.extend(it.slot_mapping)
            qsl.append(qsl[-1] + n)
            seq_lens.append(it.start_position + n)
            if it.sample:
                logits_rows.append(qsl[-1] - 1)
            req = it.request
            if req.needs_prompt_logprobs:
                # Position p's logits score prompt token p + 1: positions up to P - 2.
                first = max(it.start_position, len(req.prompt_logprobs or ()))
                last = min(it.start_position + n, req.num_prompt_tokens - 1)
                if last > first:
                    base = qsl[-2] - it.start_position
                    prompt_rows.extend(range(base + first, base + last))
                    self.prompt_spans.append((req, first, last - first))
            max_blocks = max(max_blocks, len(it.block_ids))
        tables: list[int] = []
        for it in items:
            tables.extend(it.block_ids)
            tables.extend([0] * (max_blocks - len(it.block_ids)))
        chunks = [len(logits_rows)] + [count for _, _, count in self.prompt_spans]
        return StepInputs(ids, positions, slots, qsl, seq_lens, tables, max_blocks, out.num_decodes,
                          max(it.num_tokens for it in items), logits_rows + prompt_rows, chunks)

    def to_tensors(self, x: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """:class:`StepInputs` as tensors on this rank's device: ``(input_ids, positions,
        attention metadata, logits rows)``."""
        dev = self.device
        num_seqs = len(x.seq_lens)
        meta = AttentionMetadata(
            num_decodes=x.num_decodes,
            slot_mapping=torch.tensor(x.slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(x.qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(x.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(x.tables, dtype=torch.int32, device=dev).view(num_seqs, x.max_blocks),
            query_start_loc_cpu=x.qsl,
            seq_lens_cpu=x.seq_lens,
            max_query_len=x.max_query_len,
            max_seq_len=max(x.seq_lens),
        )
        return (
            torch.tensor(x.ids, dtype=torch.int64, device=dev),
            torch.tensor(x.positions, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(x.logits_rows, dtype=torch.int64, device=dev),
        )

    def _logits(self, hidden: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
        """``compute_logits`` of consecutive row chunks of ``hidden``; every tensor-parallel
        rank makes the same calls (each is an all-gather). An empty chunk gives
        ``[0, vocab]`` without a call."""
        parts = []
        row = 0
        for n in chunks:
            if n == 0:
                parts.append(hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32))
            else:
                parts.append(self.model.compute_logits(hidden[row : row + n]))
            row += n
        return parts

    @torch.inference_mode()
    def run_inputs(self, x: StepInputs) -> list[torch.Tensor]:
        """The forward pass of one step and the logits of its row chunks (``x.chunks``):
        what every tensor-parallel rank runs, in step (all-reduces, all-gathers). Mutates
        the KV cache, and its scales while they are being learned
        (``--calculate-kv-scales``: the same calls on every rank, whose all-reduces they
        join)."""
        input_ids, positions, meta, logits_rows = self.to_tensors(x)
        calibrate = self.kv_cache.calibrate if self.kv_cache.calibrating else None
        hidden = self.model(input_ids, positions, meta, self.kv_cache.layers, self.backend, logits_rows,
                            calibrate)
        return self._logits(hidden, x.chunks)

    def execute_inputs(self, x: StepInputs) -> None:
        """A tensor-parallel worker's step: :meth:`run_inputs`, the logits dropped (rank 0
        samples)."""
        self.run_inputs(x)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step. Returns logits ``[num_sampling_requests, vocab]`` fp32, in the
        order of the sampling entries of ``out.scheduled``. Mutates the KV cache.

        Requests that asked for prompt logprobs get them here (:meth:`finish_step`). With
        tensor parallelism the engine's executor runs the step instead
        (:meth:`kvpilot.engine.tp_executor.TPExecutor.execute_model`: the same calls, and
        the step's inputs sent to the workers first)."""
        inputs = self.flatten(out)
        if self.lora is None:
            return self.finish_step(self.run_inputs(inputs))
        self.lora.prepare_step([it.num_tokens for it in out.scheduled],
                               [it.request.lora_weights for it in out.scheduled])
        try:
            return self.finish_step(self.run_inputs(inputs))
        finally:
            self.lora.finish_step()

    @torch.inference_mode()
    def finish_step(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The sampling rows' logits out of :meth:`run_inputs`'s ``parts`` (the first), after
        the prompt-logprob spans of :meth:`flatten` (the others): each prompt position
        computed this step appends ``(logprob of the next prompt token, its rank (1 =
        most likely), top k)`` to the request's ``prompt_logprobs`` (from the log-softmax
        of the raw logits). Mutates those requests."""
        logits = parts[0]
        for (req, first, count), span_logits in zip(self.prompt_spans, parts[1:]):
            lps = torch.log_softmax(span_logits, dim=-1)
            nxt = torch.tensor(req.prompt_token_ids[first + 1 : first + 1 + count], device=lps.device)
            chosen_t = lps.gather(1, nxt[:, None])
            ranks = ((lps > chosen_t).sum(dim=-1) + 1).tolist()
            chosen = chosen_t[:, 0].tolist()
            k = req.sampling_params.prompt_logprobs or 0
            tops = lps.topk(k, dim=-1) if k else None
            for j in range(count):
                top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else []
                req.prompt_logprobs.append((chosen[j], ranks[j], top))
        return logits
