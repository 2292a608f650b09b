"""``kvpilot kv-calc``: KV-cache sizing and the FinOps formula, offline.

    kvpilot kv-calc --model llama-3-70b --kv-cache-dtype float16 --context 8192 --context 65536
    kvpilot kv-calc --model ./my-hf-folder --gpu H100-80GB --kv-cache-dtype fp8
    kvpilot kv-calc --model llama-3.1-8b --gpu H100-80GB --quantization w4a16-g128
    kvpilot kv-calc --list

The arithmetic lives in :mod:`kvpilot.sizing.capacity` (shared with the engine's KV pool
and the operator's FinOps status); this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvpilot.sizing import capacity, presets
from kvpilot.sizing import quantization as quant

DEFAULT_CONTEXTS = (2048, 8192, 32768)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="llama-3-8b",
        help="preset name (see --list) or a HF model folder with config.json",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="bfloat16",
        help=f"one of {', '.join(sorted(capacity.KV_DTYPES))} (default bfloat16)",
    )
    parser.add_argument(
        "--context",
        type=int,
        action="append",
        metavar="TOKENS",
        help="context length (prompt + output) per request; repeatable"
        f" (default {', '.join(map(str, DEFAULT_CONTEXTS))})",
    )
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", help=f"GPU preset: {', '.join(presets.GPU_MEMORY_MIB)}")
    gpu.add_argument("--gpu-memory-gib", type=float, help="GPU memory in GiB (instead of --gpu)")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="GPUs per replica: weights and KV heads are split across them",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of GPU memory the engine may use (default 0.9)",
    )
    parser.add_argument(
        "--weight-dtype",
        default="bfloat16",
        help="the model dtype: of the weights, or with --quantization of what stays"
        " unquantized (default bfloat16)",
    )
    parser.add_argument(
        "--quantization",
        default=quant.AUTO,
        metavar="FORMAT",
        help="the weights' format: auto (the preset's or config.json's, else none) or one of"
        f" {', '.join(quant.WEIGHT_FORMATS)} (see --list)",
    )
    parser.add_argument(
        "--reserved-gib",
        type=float,
        default=0.0,
        help="activations, CUDA graphs, runtime (default 0: an upper bound)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument("--replicas", type=int, default=1, help="replicas, for the cost")
    parser.add_argument(
        "--cost-per-replica-hour", type=float, help="finops.costPerReplicaHour, for cost per hour"
    )
    parser.add_argument(
        "--generated-tokens-per-second",
        type=float,
        help="fleet output rate, for cost per million generated tokens",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--list", action="store_true", help="list model and GPU presets")


def _load_model(name: str) -> presets.ModelShape:
    if Path(name).is_dir():
        return presets.load_model_folder(name)
    return presets.model_preset(name)


def _quantization(model: presets.ModelShape, flag: str) -> str | None:
    """The weight format to size ``model`` in: ``--quantization``, or with ``auto`` the
    preset's or config.json's (None: the model dtype). Raises ValueError naming the flag,
    the value and the allowed values."""
    if flag != quant.AUTO:
        if flag not in quant.WEIGHT_FORMATS:
            raise ValueError(f"--quantization must be one of {quant.AUTO},"
                             f" {', '.join(quant.WEIGHT_FORMATS)}; got {flag!r}")
        return flag
    if model.quantization and model.quantization not in quant.WEIGHT_FORMATS:
        raise ValueError(f"the config.json of {model.name!r} declares weights kv-calc cannot"
                         f" size ({model.quantization}): pass --quantization with one of"
                         f" {', '.join(quant.WEIGHT_FORMATS)}")
    return model.quantization or None


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """Everything kv-calc prints, as a JSON-ready dict. Raises ValueError on bad input.

    ``args`` holds the flags' values by attribute (``model``, ``kv_cache_dtype``,
    ``quantization``, ...; :func:`add_arguments` on a parser makes them)."""
    model = _load_model(args.model)
    quantization = _quantization(model, getattr(args, "quantization", quant.AUTO))
    contexts = args.context or list(DEFAULT_CONTEXTS)
    for c in contexts:
        if c <= 0:
            raise ValueError(f"--context must be > 0; got {c}")
    dtype = capacity.kv_dtype(args.kv_cache_dtype)
    per_token = capacity.kv_bytes_per_token(
        model.num_layers, model.num_kv_heads, model.head_dim, dtype.name
    )
    weights = model.weight_bytes(capacity.kv_dtype(args.weight_dtype).bytes_per_element,
                                 quantization)
    weight_bytes = weights.total
    fmt = None if quantization is None else quant.weight_format(quantization)
    if args.block_size <= 0:
        raise ValueError(f"--block-size must be > 0; got {args.block_size}")
    # Only a model whose every layer slides holds less than its context (ModelShape.kv_window).
    window = model.kv_window
    cap = capacity.sliding_window_tokens(window, args.block_size) if window else None

    def held(context: int) -> int:
        return min(context, cap) if cap else context

    out: dict[str, Any] = {
        "model": model.name,
        "num_params": model.num_params,
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "kv_cache_dtype": dtype.name,
        "bytes_per_element": dtype.bytes_per_element,
        "scale_format": dtype.scale_format or None,
        "kv_bytes_per_token": per_token,
        "block_size": args.block_size,
        "weight_dtype": args.weight_dtype,
        "weight_bytes": weight_bytes,
        "quantization": quantization,
        "vllm_quantization": None if fmt is None else fmt.vllm,
        "embeddings_quantized": bool(fmt and fmt.quantizes_embeddings),
        # the quantized linear layers (None when nothing is quantized)
        "linear_params": weights.linear_params if fmt else None,
        "linear_weight_bytes": weights.linear_bytes if fmt else None,
        "linear_bits_per_weight": weights.linear_bits_per_weight if fmt else None,
        "sliding_window": model.sliding_window or None,
        "num_sliding_layers": model.num_sliding_layers,
        "kv_tokens_per_request_max": cap,
        "per_request": [
            {
                "context_tokens": c,
                "kv_tokens": held(c),
                "kv_bytes": capacity.kv_bytes(per_token, held(c)),
            }
            for c in contexts
        ],
    }
    gpu_bytes: float | None = None
    if args.gpu:
        gpu_bytes = presets.gpu_memory_bytes(args.gpu)
        out["gpu"] = args.gpu
    elif args.gpu_memory_gib is not None:
        if args.gpu_memory_gib <= 0:
            raise ValueError(f"--gpu-memory-gib must be > 0; got {args.gpu_memory_gib}")
        gpu_bytes = args.gpu_memory_gib * capacity.GIB
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1; got {tp}")
    kv_heads, heads = model.num_kv_heads, model.num_attention_heads
    # The engine's split (kvpilot.engine.distributed.check_tensor_parallel): any size up to
    # the KV heads (uneven when it does not divide them); beyond, a multiple of the KV
    # heads that divides the query heads; the MLP's intermediate sizes split evenly.
    if kv_heads < tp and (tp % kv_heads or heads % tp):
        raise ValueError(
            f"--tensor-parallel-size {tp} cannot split the model: with fewer KV heads"
            f" ({kv_heads}) than GPUs it must be a multiple of them and divide the"
            f" {heads} attention heads"
        )
    for what, value in (("intermediate_size", model.intermediate_size),
                        ("moe_intermediate_size", model.moe_intermediate_size),
                        ("shared_expert_intermediate_size", model.shared_expert_intermediate_size)):
        if value % tp:
            raise ValueError(
                f"--tensor-parallel-size {tp} cannot split the model: it does not divide its"
                f" {what} {value}"
            )
    if gpu_bytes is not None:
        out["tensor_parallel_size"] = tp
        # Beyond one KV head per GPU, each head is replicated on tp / kv_heads GPUs (vLLM's
        # layout). Below, an uneven split gives some GPUs ceil(kv_heads / tp) heads, and
        # every GPU holds every block: the fullest GPU decides the pool (with the GPUs'
        # memory counted together, as if each held heads_per_gpu).
        replication = tp // kv_heads if tp > kv_heads else 1
        heads_per_gpu = -(-kv_heads // tp) if tp <= kv_heads else 1
        out["kv_head_replication"] = replication
        out["kv_heads_per_gpu"] = heads_per_gpu
        kv_mem = capacity.kv_memory_bytes(
            gpu_bytes * tp, args.gpu_memory_utilization, weight_bytes, args.reserved_gib * capacity.GIB
        )
        # The tp GPUs hold (heads_per_gpu x tp) KV heads' worth of every token: kv_heads
        # of them for an even split, tp for replication, more for an uneven split.
        stored = heads_per_gpu * tp / kv_heads
        tokens = capacity.kv_capacity_tokens(kv_mem, per_token * stored, args.block_size)
        out.update(
            gpu_memory_bytes=gpu_bytes * tp,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_memory_bytes=kv_mem,
            kv_capacity_tokens=tokens,
        )
        for row in out["per_request"]:
            row["max_concurrent_requests"] = capacity.max_concurrent_requests(
                tokens, row["context_tokens"], args.block_size, window
            )
    if args.cost_per_replica_hour is not None:
        hourly = capacity.cost_per_hour(args.cost_per_replica_hour, args.replicas)
        out["cost_per_hour"] = hourly
        if args.generated_tokens_per_second is not None:
            out["cost_per_million_tokens"] = capacity.cost_per_million_tokens(
                hourly, args.generated_tokens_per_second
            )
    return out


def _gb(n: float) -> str:
    return f"{n / capacity.GB:,.2f} GB"


def _weights(r: Mapping[str, Any]) -> str:
    """What the weights line says they are stored as."""
    if not r.get("quantization"):
        return str(r["weight_dtype"])
    bits = f"{r['linear_bits_per_weight']:.6g} bits per weight"
    if r["embeddings_quantized"]:
        return (f"{r['quantization']}: linear layers, embeddings and LM head {bits};"
                f" norms {r['weight_dtype']}")
    return (f"{r['quantization']}: linear layers {bits}; embeddings, LM head and norms"
            f" {r['weight_dtype']}")


def render(r: Mapping[str, Any]) -> str:
    lines = [
        f"model            {r['model']}  ({r['num_params'] / 1e9:.2f} B params, {r['num_layers']}"
        f" layers, {r['num_kv_heads']} KV heads x head_dim {r['head_dim']})",
        f"KV dtype         {r['kv_cache_dtype']}  ({r['bytes_per_element']:g} B/value"
        + (f", one {r['scale_format']} scale per 16 values" if r["scale_format"] else "")
        + ")",
        f"KV per token     {r['kv_bytes_per_token']:,.0f} B  (2 x bytes x layers x KV heads x"
        " head_dim)",
        f"weights          {_gb(r['weight_bytes'])}  ({_weights(r)})",
    ]
    window = r.get("sliding_window")
    if window and r.get("kv_tokens_per_request_max"):
        cap = r["kv_tokens_per_request_max"]
        lines.append(
            f"sliding window   {window:,}: a sequence holds at most {cap:,} tokens of KV"
            f" ({cap // r['block_size']:,} blocks of {r['block_size']}; every layer slides)"
        )
    elif window:
        lines += [
            f"sliding window   {window:,} on {r['num_sliding_layers']} of {r['num_layers']} layers:"
            " the sliding layers do not save memory yet",
            "                 (blocks are shared by all layers and the full-attention layers"
            " keep every one),",
            "                 so the KV is sized as full attention",
        ]
    if "kv_capacity_tokens" in r:
        tp = r["tensor_parallel_size"]
        gpus = f"{tp} x {r.get('gpu', 'custom')}" if tp > 1 else r.get("gpu", "custom")
        lines += [
            f"GPU              {gpus}: {_gb(r['gpu_memory_bytes'])} x"
            f" {r['gpu_memory_utilization']:g} - weights = {_gb(r['kv_memory_bytes'])} for KV",
            f"KV capacity      {r['kv_capacity_tokens']:,} tokens per replica",
        ]
        if r["kv_capacity_tokens"] == 0:
            lines.append(
                "warning          the weights leave no room for a KV cache: raise"
                " --tensor-parallel-size, or size a quantized checkpoint (--quantization)"
            )
    if "cost_per_hour" in r:
        lines.append(f"cost             {r['cost_per_hour']:,.2f} per hour")
        if r.get("cost_per_million_tokens") is not None:
            lines.append(
                f"                 {r['cost_per_million_tokens']:,.4f} per million generated tokens"
            )
    has_conc = "kv_capacity_tokens" in r
    header = f"\n{'context':>10}  {'KV per request':>15}" + (
        f"  {'max concurrent':>15}" if has_conc else ""
    )
    lines.append(header)
    for row in r["per_request"]:
        line = f"{row['context_tokens']:>10,}  {_gb(row['kv_bytes']):>15}"
        if has_conc:
            line += f"  {row['max_concurrent_requests']:>15,}"
        if row["kv_tokens"] < row["context_tokens"]:
            line += f"  (window: {row['kv_tokens']:,} tokens held)"
        lines.append(line)
    return "\n".join(lines)


def _listing() -> str:
    lines = ["models (preset: layers / KV heads / head_dim / params / sliding window,"
             " weight format):"]
    for m in presets.MODEL_PRESETS.values():
        window = ""
        if m.sliding_window:
            which = "all layers" if m.kv_window else f"{m.num_sliding_layers} of {m.num_layers} layers"
            window = f"  W {m.sliding_window} on {which}"
        if m.quantization:
            window += f"  {m.quantization}"
        lines.append(
            f"  {m.name:31} {m.num_layers:>4} {m.num_kv_heads:>3} {m.head_dim:>4}"
            f"  {m.num_params / 1e9:7.2f} B{window}"
        )
    lines.append("GPUs (memory as nvidia-smi reports it):")
    for g, mib in presets.GPU_MEMORY_MIB.items():
        lines.append(f"  {g:10} {mib:>7,} MiB")
    lines.append(f"KV dtypes: {', '.join(sorted(capacity.KV_DTYPES))}")
    lines.append("weight formats (--quantization: name, vLLM's --quantization, storage):")
    for f in quant.WEIGHT_FORMATS.values():
        lines.append(f"  {f.name:17} {f.vllm:19} {f.summary}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(_listing())
        return 0
    try:
        result = compute(args)
    except ValueError as exc:
        print(f"kvpilot kv-calc: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
