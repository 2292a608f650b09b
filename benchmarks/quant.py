"""Quantized weights on CPU, each against its baseline in the same run: resident weight
bytes against the checkpoint's, decode step time against the fp32 path, and INT8 W8A8
offline throughput against vLLM's CPU build on the same checkpoint.

    .venv/bin/python benchmarks/quant.py                      # memory + step time, 3 rounds
    .venv/bin/python benchmarks/quant.py --vllm               # + offline vs vLLM (INT8 W8A8)
    .venv/bin/python benchmarks/quant.py --quick              # smoke test
    .venv/bin/python benchmarks/quant.py --memory-only        # resident bytes only (quant_memory.json)

Checkpoints (written once under ``.bench/quant/``): the SmolLM2-135M HF folder of
``benchmarks/vllm_cpu.py`` (fp32; its embedding is tied, and its LM head reads the fp32
table in place in the quantized formats), and ``wide``: a random Llama of TinyLlama-1.1B's layer shapes (hidden 2,048,
intermediate 5,632, 32 query / 4 KV heads) with 6 layers and an untied 32,000-token head,
whose decode steps read more weight bytes than the caches hold. Each is quantized the way
llm-compressor's ``oneshot`` writes it, with compressed-tensors' own code
(``tests/engine/quant_fixtures.py``, round-to-nearest from min/max, ``lm_head`` left
unquantized): ``int8_w8a8`` (INT8 W8A8: per-channel int8 weights, dynamic per-token int8
activations), ``w4a16`` (4-bit, group 64: SmolLM2's hidden 576 is no multiple of 128;
symmetric), ``w4a16_bf16`` (the same, quantized from the model loaded in bf16, the dtype
both models are published in: bf16 scales, embedding and LM head, as llm-compressor writes
them from the published checkpoint), ``w8a16`` (8-bit per channel, symmetric), ``fp8``
(FP8 W8A8 dynamic). And ``smollm2/gguf``: the embedded SmolLM2 GGUF
(Q4_1 layers, Q8_0 embedding and tied head) kept quantized, against the SmolLM2 fp32 folder,
which is that file dequantized.

Measured, all in one process per engine load, 2 threads:

* ``memory``: resident weight bytes of the loaded engine (``LoadedModel.weight_bytes``)
  against the checkpoint's tensor bytes (safetensors, or the GGUF file's tensor data).
  Goal: at most 1.15x; the embedded model under 150 MiB.
* ``decode``: the median time of one decode step of a batch of 1, 8 and 32 sequences (64
  prompt tokens each, 24 steps after the prefill, the engine's own ``step()``), each format
  against the fp32 checkpoint it was made from; formats alternate within each round and the
  report is the median over rounds of each round's ratio. Goal: 4-bit at batch 1 at least
  2x faster than fp32.
* ``vllm`` (``--vllm``): ``vllm_cpu.py``'s offline workload (64 prompts of 64-512 random
  tokens x 128 greedy tokens) on the SmolLM2 INT8 W8A8 checkpoint, kvpilot and vLLM
  alternating, one thread each, ``--dtype`` as given (vLLM's CPU int8 kernels take bf16
  activations). Goal: kvpilot >= 1.0x vLLM's output tokens/s.

Results: ``benchmarks/results/quant.json`` (``quant_quick.json`` with ``--quick``) and
``quant_vllm_int8.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import vllm_cpu as vc  # noqa: E402

QUANT_DIR = vc.BENCH_DIR / "quant"
SCHEMES = ("int8_w8a8", "w4a16", "w4a16_bf16", "w8a16", "fp8")
# The fixtures' scheme names (tests/engine/quant_fixtures.py CT_SCHEMES); a ``_bf16`` scheme
# quantizes the model loaded in bfloat16, the dtype SmolLM2 and TinyLlama are published in.
FIXTURE_SCHEME = {"int8_w8a8": "int8_w8a8", "w4a16": "w4a16_g64_sym", "w4a16_bf16": "w4a16_g64_sym",
                  "w8a16": "w8a16_channel", "fp8": "fp8_dynamic"}
WIDE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=6,
            num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
            tie_word_embeddings=False, rope_theta=10000.0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def dense_folder(model: str) -> Path:
    """The fp32 HF folder of ``model`` (``smollm2`` or ``wide``), written once."""
    if model == "smollm2":
        vc.ensure_hf_model()
        return vc.HF_DIR
    path = QUANT_DIR / "wide-fp32"
    if not (path / "config.json").is_file():
        import torch
        import transformers

        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**WIDE)).eval()
        m.save_pretrained(str(path), safe_serialization=True)
        log(f"wrote {path}")
    return path


def quantized_folder(model: str, scheme: str) -> Path:
    """``model`` quantized with ``scheme`` by compressed-tensors (once); ``*_bf16``: from
    the model loaded in bfloat16, so its scales and unquantized tensors (embedding, LM
    head, norms) are saved in bf16, as llm-compressor writes a model published in bf16."""
    path = QUANT_DIR / f"{model}-{scheme}"
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers
    from tests.engine import quant_fixtures as qf

    src = dense_folder(model)
    t0 = time.monotonic()
    dtype = torch.bfloat16 if scheme.endswith("_bf16") else torch.float32
    m = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).eval()
    qf.quantize_in_place(m, qf.CT_SCHEMES[FIXTURE_SCHEME[scheme]], ["lm_head"], {})
    tmp = path.with_name(path.name + ".tmp")
    qf.save_compressed(m, tmp)
    for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / extra).is_file() and not (tmp / extra).is_file():
            (tmp / extra).write_bytes((src / extra).read_bytes())
    tmp.rename(path)
    log(f"quantized {src.name} -> {path.name} ({scheme}) in {time.monotonic() - t0:.0f} s")
    return path


def file_tensor_bytes(path: Path) -> int:
    """Bytes of the checkpoint's tensors: the safetensors headers' byte ranges, or the GGUF
    file's tensor data."""
    if path.suffix == ".gguf":
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def make_engine(model: Path, max_seqs: int):
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=str(model), device="cpu", dtype="float32", skip_tokenizer_init=True,
                                max_model_len=512, kv_cache_memory=0.5, max_num_seqs=max_seqs,
                                max_num_batched_tokens=4096))


def decode_step_ms(engine, batch: int, steps: int, seed: int) -> float:
    """Median wall time of ``steps`` decode steps of ``batch`` sequences (after their
    prefill), ms."""
    import random

    from kvpilot.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{seed}-{i}", [rng.randrange(3, vocab) for _ in range(64)], params)
    started: set[str] = set()
    while len(started) < batch:  # every prompt prefilled (each has its first token)
        started.update(o.request_id for o in engine.step() if o.output_token_ids)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1e3


def head_copy_bytes(model: Any) -> int:
    """Bytes of the oneDNN-packed copy of a tied, unquantized embedding that serves as the
    LM head on CPU (the embedding keeps its table for the lookup: two copies, as vLLM's CPU
    backend keeps them, ``dispatch_cpu_unquantized_gemm(remove_weight=False)``); 0 when the
    head is untied, quantized or not packed."""
    from kvpilot.engine.model.layers import PackedLinear

    head = getattr(model, "packed_head", None)
    if getattr(model, "lm_head", "untied") is None and isinstance(head, PackedLinear):
        return int(head.nbytes)
    return 0


def measure(label: str, folder: Path, batches: list[int], steps: int, seed: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(2)
    t0 = time.monotonic()
    engine = make_engine(folder, max(batches, default=1))
    load_s = time.monotonic() - t0
    res: dict[str, Any] = {"load_s": round(load_s, 1), "weight_bytes": engine.loaded.weight_bytes,
                           "file_tensor_bytes": file_tensor_bytes(folder),
                           "head_copy_bytes": head_copy_bytes(engine.loaded.model)}
    res["bytes_ratio"] = round(res["weight_bytes"] / res["file_tensor_bytes"], 3)
    res["bytes_ratio_without_head_copy"] = round(
        (res["weight_bytes"] - res["head_copy_bytes"]) / res["file_tensor_bytes"], 3)
    if batches:
        decode_step_ms(engine, 1, 3, seed + 99)  # warm-up
        res["step_ms"] = {str(b): round(decode_step_ms(engine, b, steps, seed + b), 2) for b in batches}
    log(f"{label}: weights {res['weight_bytes'] / 2**20:.1f} MiB ({res['bytes_ratio']}x the file's "
        f"{res['file_tensor_bytes'] / 2**20:.1f} MiB; {res['bytes_ratio_without_head_copy']}x without the tied "
        f"head's packed copy)" + (f", step ms {res['step_ms']}" if batches else ""))
    del engine
    gc.collect()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="smollm2,wide")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--vllm", action="store_true", help="also the INT8 W8A8 offline run against vLLM")
    ap.add_argument("--vllm-rounds", type=int, default=3)
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory-only", action="store_true",
                    help="resident bytes only, one load per checkpoint (quant_memory.json)")
    args = ap.parse_args(argv)

    from common import machine_info, write_result

    from kvpilot.engine.model.loader import embedded_model_path

    batches = [1, 8] if args.quick else [1, 8, 32]
    steps = 4 if args.quick else 24
    rounds = 1 if args.quick else args.rounds
    models = [m for m in args.models.split(",") if m]
    schemes = [s for s in args.schemes.split(",") if s]
    out = "quant_quick" if args.quick else "quant"
    payload: dict[str, Any] = {"machine": machine_info(), "threads": 2, "batches": batches, "steps": steps,
                               "rounds": [], "summary": {}}
    folders = {m: {"fp32": dense_folder(m), **{s: quantized_folder(m, s) for s in schemes}} for m in models}
    gguf = embedded_model_path()
    if args.memory_only:
        memory = {f"{m}/{label}": measure(f"{m}/{label}", folder, [], 0, 0)
                  for m in models for label, folder in folders[m].items()}
        memory["smollm2/gguf"] = measure("smollm2/gguf", gguf, [], 0, 0)
        print(f"results: {write_result('quant_memory', {'machine': machine_info(), 'memory': memory})}")
        return 0
    for r in range(rounds):
        row: dict[str, Any] = {}
        for m in models:
            for label, folder in folders[m].items():
                row[f"{m}/{label}"] = measure(f"round {r + 1} {m}/{label}", folder, batches, steps, seed=r)
        row["smollm2/gguf"] = measure(f"round {r + 1} smollm2/gguf", gguf, batches, steps, r)
        payload["rounds"].append(row)
        write_result(out, payload)
    summary: dict[str, Any] = {}
    for key in payload["rounds"][0]:
        base_key = f"{key.split('/')[0]}/fp32"
        per_round = [rd[key] for rd in payload["rounds"]]
        entry: dict[str, Any] = {"weight_mib": round(per_round[0]["weight_bytes"] / 2**20, 2),
                                 "bytes_ratio": per_round[0]["bytes_ratio"]}
        for b in batches:
            ratios = [rd[base_key]["step_ms"][str(b)] / rd[key]["step_ms"][str(b)] for rd in payload["rounds"]]
            entry[f"speedup_b{b}"] = round(statistics.median(ratios), 3)
            entry[f"step_ms_b{b}"] = round(statistics.median(x["step_ms"][str(b)] for x in per_round), 2)
        summary[key] = entry
    payload["summary"] = summary
    path = write_result(out, payload)
    print("\n| checkpoint | weights MiB | vs file | " + " | ".join(f"step ms b{b} (x fp32)" for b in batches) + " |")
    print("|---|---|---|" + "---|" * len(batches))
    for key, e in summary.items():
        cells = " | ".join(f"{e[f'step_ms_b{b}']} ({e[f'speedup_b{b}']}x)" for b in batches)
        print(f"| {key} | {e['weight_mib']} | {e['bytes_ratio']}x | {cells} |")
    print(f"results: {path}")

    failed = 0
    if args.vllm:
        folder = quantized_folder("smollm2", "int8_w8a8")
        rc = vc.main(["--workloads", "offline", "--engines", "kvpilot,vllm", "--rounds", str(args.vllm_rounds),
                      "--model-dir", str(folder), "--dtype", args.vllm_dtype, "--out", "quant_vllm_int8",
                      *(["--quick"] if args.quick else [])])
        failed |= rc
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
