"""KV-cache quality: perplexity and greedy agreement of quantized KV caches against the
full-precision cache, on the embedded SmolLM2-135M (CPU is enough).

- Perplexity of ``data/public_domain_en.txt`` (3,162 tokens), teacher-forced through the
  engine's own model runner, attention backend and paged cache (kvpilot.engine.scoring),
  in chunks of ``--chunk`` tokens: the first chunk is a prefill, the rest extend over the
  cached (quantized) prefix. Also the share of positions whose greedy prediction equals
  the full-precision one.
- Greedy agreement: the 16 prompts of ``data/kv_quality_prompts.json``, 64 tokens each,
  batched through the engine: tokens until the first difference, prompts identical over
  all 64 tokens, and position-wise agreement.

Usage: OMP_NUM_THREADS=1 python benchmarks/kv_cache_quality.py [--configs ...]
Writes results/kv_cache_quality.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import machine_info, write_result

DATA = Path(__file__).resolve().parent / "data"

# name -> (kv_cache_dtype, kv_cache_key_rotation, kv_cache_skip_layers)
CONFIGS = {
    "full": ("auto", True, ()),
    "bfloat16": ("bfloat16", True, ()),
    "fp8_e4m3": ("fp8_e4m3", True, ()),
    "fp8_e4m3-no-rotation": ("fp8_e4m3", False, ()),
    "fp8_e5m2": ("fp8_e5m2", True, ()),
    "fp8_e5m2-no-rotation": ("fp8_e5m2", False, ()),
    "int4": ("int4", True, ()),
    "int4-no-rotation": ("int4", False, ()),
    "fp4_e2m1": ("fp4_e2m1", True, ()),
    "fp4_e2m1-no-rotation": ("fp4_e2m1", False, ()),
    # the three best single layers of `--skip-sweep fp4_e2m1` (results/kv_cache_quality-skip-sweep.json)
    "fp4_e2m1-skip-13,19,23": ("fp4_e2m1", True, (13, 19, 23)),
}


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from kvpilot.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.output_token_ids)
    return [done[f"q{i}"] for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def skip_sweep(loaded, base_args: dict, ids: list[int], args) -> int:
    """Perplexity with every layer quantized, then with each single layer kept in full
    precision: the drop says how much that layer costs. Writes results/<out>-skip-sweep.json."""
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.scoring import score_tokens

    def ppl(**cache_args) -> float:
        engine = LLMEngine(EngineArgs(**base_args, **cache_args), loaded=loaded)
        return score_tokens(engine, ids, chunk_size=args.chunk).perplexity

    full = ppl()
    quant = ppl(kv_cache_dtype=args.skip_sweep)
    rows = []
    for layer in range(loaded.config.num_layers):
        p = ppl(kv_cache_dtype=args.skip_sweep, kv_cache_skip_layers=(layer,))
        rows.append({"skip_layer": layer, "perplexity": p, "recovered_pct": 100 * (quant - p) / (quant - full)})
        print(json.dumps(rows[-1]), flush=True)
    payload = {"machine": machine_info(), "kv_cache_dtype": args.skip_sweep, "tokens": len(ids),
               "full_perplexity": full, "quantized_perplexity": quant, "rows": rows}
    print(f"wrote {write_result(args.out + '-skip-sweep', payload)}")
    print(f"full {full:.3f}, all layers {args.skip_sweep} {quant:.3f}; best single skips:")
    for r in sorted(rows, key=lambda r: r["perplexity"])[:6]:
        print(f"  layer {r['skip_layer']:2d}: {r['perplexity']:.3f} ({r['recovered_pct']:.0f}% of the loss recovered)")
    return 0


def sensitivity(loaded, base_args: dict, ids: list[int], args) -> int:
    """Perplexity unperturbed and with each layer's attention output times (1 + 1e-6 noise),
    per KV dtype: the spread is how far a difference of fp32 rounding size (another
    backend, another thread count) can move that dtype's figure. Writes
    results/<out>-sensitivity.json."""
    import torch

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.scoring import score_tokens

    def ppl(kv_dtype: str, seed: int | None) -> float:
        engine = LLMEngine(EngineArgs(**base_args, kv_cache_dtype=kv_dtype), loaded=loaded)
        backend = engine.runner.backend
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            plain = backend.forward

            def forward(*a, **kw):
                out = plain(*a, **kw)
                return out * (1 + 1e-6 * torch.randn(out.shape, generator=gen))

            backend.forward = forward  # this engine's instance only
        return score_tokens(engine, ids, chunk_size=args.chunk).perplexity

    rows = []
    for kv_dtype in args.sensitivity:
        base = ppl(kv_dtype, None)
        perturbed = [ppl(kv_dtype, seed) for seed in range(args.seeds)]
        rows.append({"kv_cache_dtype": kv_dtype, "perplexity": base, "perturbed": perturbed,
                     "spread_pct": 100 * (max(*perturbed, base) - min(*perturbed, base)) / base})
        print(json.dumps(rows[-1]), flush=True)
    payload = {"machine": machine_info(), "tokens": len(ids), "chunk": args.chunk, "relative_noise": 1e-6,
               "rows": rows}
    print(f"wrote {write_result(args.out + '-sensitivity', payload)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--dtype", default="float32", help="model dtype (the full-precision cache uses it)")
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per perplexity step")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="kv_cache_quality")
    ap.add_argument("--skip-sweep", metavar="KV_DTYPE",
                    help="instead: perplexity of the first --sweep-tokens tokens with each single layer "
                         "kept in full precision (which layers suffer from this dtype)")
    ap.add_argument("--sweep-tokens", type=int, default=1024)
    ap.add_argument("--sensitivity", nargs="+", metavar="KV_DTYPE",
                    help="instead: perplexity of the first --sweep-tokens tokens with every attention "
                         "output multiplied by (1 + 1e-6 N(0,1)), seeds 0..--seeds-1, per KV dtype (how much "
                         "a rounding-sized change upstream moves the figure)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--skip-layers", default="", help="comma-separated layers kept in full precision for "
                    "every quantized config (--kv-cache-skip-layers)")
    args = ap.parse_args(argv)

    import torch

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.model_runner import load_model
    from kvpilot.engine.scoring import score_tokens

    base_args = {"device": "cpu", "dtype": args.dtype, "kv_cache_memory": 0.25, "max_num_seqs": 16,
                 "attention_backend": args.attention_backend}
    loaded = load_model(EngineArgs(**base_args))
    tok = loaded.tokenizer
    text_ids = tok.encode((DATA / "public_domain_en.txt").read_text())
    prompts = [tok.encode(p) for p in json.loads((DATA / "kv_quality_prompts.json").read_text())]
    if args.skip_sweep:
        return skip_sweep(loaded, base_args, text_ids[: args.sweep_tokens], args)
    if args.sensitivity:
        return sensitivity(loaded, base_args, text_ids[: args.sweep_tokens], args)
    extra_skip = tuple(int(x) for x in args.skip_layers.split(",") if x)
    configs = ["full"] + [c for c in args.configs if c != "full"]
    rows = []
    base = None
    for name in configs:
        kv_dtype, rotation, skip = CONFIGS[name]
        if extra_skip and kv_dtype not in ("auto", "bfloat16"):
            skip = extra_skip
        t0 = time.monotonic()
        cache_args = {"kv_cache_dtype": kv_dtype, "kv_cache_key_rotation": rotation, "kv_cache_skip_layers": skip}
        engine = LLMEngine(EngineArgs(**base_args, **cache_args), loaded=loaded)
        scores = score_tokens(engine, text_ids, chunk_size=args.chunk)
        outs = greedy(LLMEngine(EngineArgs(**base_args, **cache_args), loaded=loaded), prompts, args.max_tokens)
        row = {"config": name, "kv_cache_dtype": engine.config.kv_cache_dtype_name,
               "key_rotation": engine.runner.kv_cache.rotates_keys, "skip_layers": list(skip),
               "capacity_tokens": engine.config.num_blocks * engine.config.block_size,
               "perplexity": scores.perplexity, "seconds": round(time.monotonic() - t0, 1)}
        if base is None:
            base = {"scores": scores, "outs": outs}
        else:
            firsts = [first_difference(a, b) for a, b in zip(base["outs"], outs)]
            row |= {
                "perplexity_delta_pct": 100 * (scores.perplexity / base["scores"].perplexity - 1),
                "teacher_forced_top1_agreement": float((scores.argmax == base["scores"].argmax).float().mean()),
                "greedy_mean_tokens_to_first_difference": sum(firsts) / len(firsts),
                "greedy_first_differences": firsts,
                "greedy_identical_prompts": sum(f == args.max_tokens for f in firsts),
                "greedy_positionwise_agreement": sum(
                    sum(x == y for x, y in zip(a, b)) for a, b in zip(base["outs"], outs)
                ) / (len(outs) * args.max_tokens),
            }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "greedy_first_differences"}), flush=True)
    payload = {"machine": machine_info(), "model": loaded.source.name, "dtype": args.dtype,
               "attention_backend": args.attention_backend, "text_tokens": len(text_ids),
               "chunk": args.chunk, "prompts": len(prompts), "max_tokens": args.max_tokens,
               "torch": torch.__version__, "results": rows}
    path = write_result(args.out, payload)
    print(f"\nwrote {path}\n")
    print("| KV cache | keys rotated | capacity vs bf16 | perplexity | vs full | top-1 agree (text) | greedy: tokens to 1st diff (mean) | identical / 16 | position-wise agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    bf16_cap = next((r["capacity_tokens"] for r in rows if r["kv_cache_dtype"] == "bfloat16"), None)
    for r in rows:
        cap = f"{r['capacity_tokens'] / bf16_cap:.2f}x" if bf16_cap else "-"
        if r["config"] == "full":
            print(f"| {r['kv_cache_dtype']} (full) | - | {cap} | {r['perplexity']:.3f} | - | - | - | - | - |")
            continue
        name = r["kv_cache_dtype"] + (f", layers {','.join(map(str, r['skip_layers']))} skipped" if r["skip_layers"] else "")
        print(f"| {name} | {'yes' if r['key_rotation'] else 'no'} | {cap} | {r['perplexity']:.3f} | "
              f"{r['perplexity_delta_pct']:+.2f}% | {r['teacher_forced_top1_agreement']:.3f} | "
              f"{r['greedy_mean_tokens_to_first_difference']:.1f} | {r['greedy_identical_prompts']} | "
              f"{r['greedy_positionwise_agreement']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
