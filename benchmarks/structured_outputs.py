"""Structured outputs: overhead of constrained decoding and validity over varied schemas.

Three measurements on the embedded model, one run (``benchmarks/data/structured_schemas.json``):

1. **Overhead** at concurrency 1 and 32: JSON-schema requests vs unconstrained requests
   with the same prompts and the same output lengths. The constrained run goes first;
   each unconstrained twin then generates exactly as many tokens as its constrained
   request did (``min_tokens`` = ``max_tokens`` = that count), so both sides do the same
   model work and differ only by the grammar (bitmask fill, mask application, matcher
   advance). Rounds alternate constrained / free; output tokens/s per side, ratio
   constrained / free (goal >= 0.9).
2. **Compile time** of a 30-field schema on a fresh compiler (cold) and again (cached).
3. **Validity**: ``--validity-requests`` requests (default 200) cycling through the
   schemas, temperature 1.0, distinct seeds: every output must parse and validate
   (jsonschema), none may be cut by the token limit.

    .venv/bin/python benchmarks/structured_outputs.py            # ~5 minutes on 2 CPUs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_result

SCHEMAS = json.loads((Path(__file__).resolve().parent / "data/structured_schemas.json").read_text())["schemas"]
PROMPTS = [
    "Describe a person as JSON.", "Give me an order as JSON.", "List some colors.", "Where is the summit?",
    "Who is the user?", "Search for recent papers.", "Report the result.", "Fill in the form.",
]


def run_batch(engine, requests) -> tuple[float, dict[str, object]]:
    """Add all ``(id, prompt_ids, params)`` and step until done. Returns the wall seconds
    of the step loop and the finished outputs by id."""
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    outs = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return time.perf_counter() - t0, outs


def overhead(engine, tokenizer, concurrency: int, rounds: int, seed0: int) -> dict[str, object]:
    """One round: ``max(concurrency, 8)`` constrained requests run ``concurrency`` at a
    time, then their unconstrained twins the same way; tokens/s of each side."""
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.structured_output import StructuredOutputsParams as SO

    names = ["person", "tool_args", "bounded_numbers", "nested_optional"]
    n_requests = max(concurrency, 8)
    ratios, tps_c, tps_f = [], [], []
    for r in range(rounds):
        reqs = []
        for i in range(n_requests):
            name = names[i % len(names)]
            ids = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
            so = SO(json=SO.schema_text(SCHEMAS[name], "json"))
            reqs.append((f"c{r}-{i}", ids, SamplingParams(max_tokens=256, temperature=1.0, seed=seed0 + r * 1000 + i,
                                                          structured_outputs=so)))
        # Grammars are compiled (and cached) at add time: outside the timed step loop on
        # both sides, as the server compiles them before queueing.
        t_c, outs = 0.0, {}
        for k in range(0, n_requests, concurrency):
            t, o = run_batch(engine, reqs[k : k + concurrency])
            t_c += t
            outs.update(o)
        n_tokens = {rid: outs[rid].num_output_tokens for rid, _, _ in reqs}
        free = [(f"f{r}-{i}", ids, SamplingParams(max_tokens=n_tokens[rid], min_tokens=n_tokens[rid], temperature=1.0,
                                                  seed=p.seed))
                for i, (rid, ids, p) in enumerate(reqs)]
        t_f, outs_f = 0.0, {}
        for k in range(0, n_requests, concurrency):
            t, o = run_batch(engine, free[k : k + concurrency])
            t_f += t
            outs_f.update(o)
        total = sum(n_tokens.values())
        assert total == sum(o.num_output_tokens for o in outs_f.values())
        tps_c.append(total / t_c)
        tps_f.append(total / t_f)
        ratios.append((total / t_c) / (total / t_f))
    return {"concurrency": concurrency, "requests_per_round": n_requests, "rounds": rounds,
            "output_tokens_per_round": total,
            "constrained_tok_s": [round(x, 1) for x in tps_c], "free_tok_s": [round(x, 1) for x in tps_f],
            "ratio_per_round": [round(x, 3) for x in ratios], "ratio_median": round(statistics.median(ratios), 3)}


def compile_times(engine) -> dict[str, float]:
    from kvpilot.engine.structured_output import GrammarCompiler
    from kvpilot.engine.structured_output import StructuredOutputsParams as SO

    so = SO(json=SO.schema_text(SCHEMAS["thirty_fields"], "json"))
    t0 = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    t1 = time.perf_counter()
    compiler.compile(so)
    t2 = time.perf_counter()
    compiler.compile(so)
    t3 = time.perf_counter()
    return {"tokenizer_info_s": round(t1 - t0, 4), "thirty_fields_cold_s": round(t2 - t1, 4),
            "thirty_fields_cached_s": round(t3 - t2, 6)}


def validity(engine, tokenizer, n: int, batch: int) -> dict[str, object]:
    import jsonschema

    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.structured_output import StructuredOutputsParams as SO

    names = sorted(SCHEMAS)
    per_schema = {name: {"requests": 0, "valid": 0} for name in names}
    failures = []
    tokens = 0
    for start in range(0, n, batch):
        reqs = []
        for i in range(start, min(n, start + batch)):
            name = names[i % len(names)]
            so = SO(json=SO.schema_text(SCHEMAS[name], "json"))
            reqs.append((f"v{i}:{name}", tokenizer.encode(PROMPTS[i % len(PROMPTS)]),
                         SamplingParams(max_tokens=700, temperature=1.0, seed=i, structured_outputs=so)))
        _, outs = run_batch(engine, reqs)
        for rid, o in outs.items():
            name = rid.split(":", 1)[1]
            per_schema[name]["requests"] += 1
            tokens += o.num_output_tokens
            try:
                if o.finish_reason != "stop":
                    raise ValueError(f"finish_reason {o.finish_reason}")
                jsonschema.validate(json.loads(o.output_text), SCHEMAS[name])
                per_schema[name]["valid"] += 1
            except Exception as e:
                failures.append({"id": rid, "error": str(e)[:200], "text": o.output_text[:300]})
    valid = sum(v["valid"] for v in per_schema.values())
    return {"requests": n, "valid": valid, "valid_share": valid / n, "output_tokens": tokens,
            "per_schema": per_schema, "failures": failures[:10]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--validity-requests", type=int, default=200)
    args = ap.parse_args()

    import torch

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine

    torch.manual_seed(0)
    engine = LLMEngine(EngineArgs(device="cpu", dtype="float32", max_num_seqs=32))
    tok = engine.tokenizer
    result: dict[str, object] = {"machine": machine_info(), "model": "embedded SmolLM2-135M-Instruct, fp32, CPU"}
    result["compile"] = compile_times(engine)
    print("compile:", result["compile"], flush=True)
    result["overhead"] = [overhead(engine, tok, c, args.rounds, seed0=100 * c) for c in (1, 32)]
    for o in result["overhead"]:
        print("overhead:", o, flush=True)
    result["validity"] = validity(engine, tok, args.validity_requests, batch=32)
    v = result["validity"]
    print(f"validity: {v['valid']}/{v['requests']} valid, per schema {v['per_schema']}", flush=True)
    for f in v["failures"]:
        print("  failure:", f)
    path = write_result("structured_outputs", result)
    print("wrote", path)
    return 0 if v["valid"] == v["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
