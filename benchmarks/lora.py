"""Many LoRA adapters on one base model, served: the base alone against adapters mixed in
one batch, in the same run.

    .venv/bin/python benchmarks/lora.py                      # kvpilot, 3 rounds
    .venv/bin/python benchmarks/lora.py --engines kvpilot,vllm
    .venv/bin/python benchmarks/lora.py --quick              # smoke test

Modes, each a fresh server on the SmolLM2-135M HF folder of ``benchmarks/vllm_cpu.py``
(fp32, one thread, 1 GiB of KV cache, prefix caching on):

* ``base``: no ``--enable-lora``; every request names the base model.
* ``mixed8``: ``--enable-lora --max-loras 8``, 8 adapters; request ``i`` names adapter
  ``i % 8`` (evenly mixed, every batch holds all eight).
* ``swap32``: ``--max-loras 8 --max-cpu-loras 32``, 32 adapters; request ``i`` names
  adapter ``i % 32``: at most 8 adapters run at once, the others wait for a slot.

With ``--replicas N`` each mode runs N servers behind vllm-router (``--router-policy``,
``random`` by default: a router without adapter affinity spreads adapter requests at
random), the same client against the router: what a fleet with more adapters than slots
costs.

The load is ``vllm_cpu.py``'s serve workload: 128 requests of 256 random prompt tokens and
64 greedy output tokens (``ignore_eos``), concurrency 32, streaming. Every request must
finish at its length; a failed request fails the run (exit status 1).

The adapters are random PEFT folders (``adapter_config.json`` + safetensors) for the base's
shapes, rank ``--rank`` on ``--targets``, written once under ``.bench/lora-adapters``.
Modes alternate within each round (base, mixed8, swap32, base, ...); the report is the
median over rounds of each round's ratio to that round's base. Results:
``benchmarks/results/lora.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_cpu as vc

MODES = ("base", "mixed8", "swap32")
ADAPTER_DIR = vc.BENCH_DIR / "lora-adapters"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(count: int, rank: int, targets: list[str], seed: int) -> list[Path]:
    """``count`` random PEFT LoRA folders for the HF model's shapes (written once per
    rank/targets; the tensors are random normal, B scaled so each adapter changes the
    greedy output)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(vc.HF_DIR))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q, kv, h, inter = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    tag = f"r{rank}-{'-'.join(sorted(t.removesuffix('_proj') for t in targets))}"
    out = []
    for i in range(count):
        folder = ADAPTER_DIR / tag / f"adapter{i}"
        out.append(folder)
        if (folder / "adapter_model.safetensors").is_file():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for t in targets:
                fin, fout = shapes[t]
                part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                base = f"base_model.model.model.layers.{layer}.{part}.{t}"
                tensors[f"{base}.lora_A.weight"] = torch.randn(rank, fin, generator=gen) / fin ** 0.5
                tensors[f"{base}.lora_B.weight"] = torch.randn(fout, rank, generator=gen) * 0.05
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "base_model_name_or_path": str(vc.HF_DIR), "task_type": "CAUSAL_LM"}))
    return out


def server_args(mode: str, adapters: list[Path], rank: int) -> tuple[list[str], dict[str, str]]:
    """Both engines take vLLM's flags for the same mode."""
    if mode == "base":
        return [], {}
    n = 8 if mode == "mixed8" else 32
    mods = [f"a{i}={p}" for i, p in enumerate(adapters[:n])]
    return (["--enable-lora", "--max-loras", "8", "--max-lora-rank", str(rank), "--max-cpu-loras", str(max(n, 8)),
             "--lora-modules", *mods], {})


async def client(url: str, mode: str, sz: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    n_adapters = {"base": 0, "mixed8": 8, "swap32": 32}[mode]
    prompts = [vc.random_ids(rng, sz["serve_prompt"]) for _ in range(sz["serve_requests"])]
    sem = asyncio.Semaphore(sz["serve_concurrency"])
    async with vc.http_client(sz["serve_concurrency"]) as http:
        await vc.warm_up(http, url, seed + 1)

        async def one(i: int, p: list[int]) -> Any:
            body = vc.completion_body(p, sz["serve_output"])
            if n_adapters:
                body["model"] = f"a{i % n_adapters}"
            async with sem:
                return await vc.stream_request(http, url + "/v1/completions", body)

        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    short = [r for r in recs if r.output_tokens != sz["serve_output"]]
    if short:
        raise RuntimeError(f"{len(short)} requests did not finish at {sz['serve_output']} tokens "
                           f"(first: {short[0].output_tokens} tokens, {short[0].finish_reason})")
    tokens = sum(r.output_tokens for r in recs)
    itl = [g for r in recs for g in r.itl_s]
    return {"wall_s": round(wall, 3), "output_tokens": tokens, "output_tok_s": round(tokens / wall, 2),
            "itl_ms": vc.ms(itl), "ttft_ms": vc.ms([r.ttft_s for r in recs if r.ttft_s is not None])}


def run_mode(engine: str, mode: str, adapters: list[Path], args: argparse.Namespace, sz: dict[str, Any]
             ) -> dict[str, Any]:
    extra, env = server_args(mode, adapters, args.rank)
    if args.replicas > 1:
        return run_fleet(engine, mode, extra, env, args, sz)
    with vc.Server(engine, args.budget, args, label=f"lora-{mode}", extra=extra, env=env) as server:
        server.wait_ready(args.ready_timeout)
        out = asyncio.run(asyncio.wait_for(client(server.url, mode, sz, args.seed), args.run_timeout))
        server.stop()
        out["memory"] = server.memory
        out["startup_s"] = round(server.startup_s or 0.0, 1)
        out["log"] = str(server.log_path)
    return out


def run_fleet(engine: str, mode: str, extra: list[str], env: dict[str, str], args: argparse.Namespace,
              sz: dict[str, Any]) -> dict[str, Any]:
    """``--replicas`` servers of one mode behind vllm-router (``--router-policy``, no
    adapter affinity), the same client against the router."""
    import os
    import signal
    import subprocess

    servers = [vc.Server(engine, args.budget, args, label=f"lora-{mode}-r{i}", extra=extra, env=env)
               for i in range(args.replicas)]
    router = None
    log = None
    try:
        for server in servers:
            server.wait_ready(args.ready_timeout)
        port = vc.free_port()
        router_bin = Path(sys.executable).with_name("vllm-router")
        log = open(args.log_dir / f"router-{mode}-{port}.log", "wb")  # noqa: SIM115 - closed below
        router = subprocess.Popen([str(router_bin), "--host", "127.0.0.1", "--port", str(port),
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(vc.free_port()),
                                   "--policy", args.router_policy, "--worker-urls",
                                   *(s.url for s in servers)], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        import httpx

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            if router.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start (log {log.name})")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        out = asyncio.run(asyncio.wait_for(client(url, mode, sz, args.seed), args.run_timeout))
        out["replicas"] = args.replicas
        out["router_policy"] = args.router_policy
        return out
    finally:
        if router is not None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(timeout=30)
        if log is not None:
            log.close()
        for server in servers:
            server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="kvpilot", help="comma-separated: kvpilot, vllm")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default: vllm_cpu.py's 128)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="servers per mode; above 1 they run behind vllm-router (the fleet without adapter affinity)")
    ap.add_argument("--router-policy", default="random", help="vllm-router --policy with --replicas > 1")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--vllm-threads-bind", default="nobind")
    ap.add_argument("--vllm-preload", choices=["auto", "none"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--run-timeout", type=float, default=3600.0)
    ap.add_argument("--log-dir", type=Path, default=vc.BENCH_DIR / "logs")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    modes = [m for m in args.modes.split(",") if m]
    targets = [t for t in args.targets.split(",") if t]
    for name, got, allowed in (("engine", engines, vc.ENGINES), ("mode", modes, MODES), ("target", targets, TARGETS)):
        if bad := [x for x in got if x not in allowed]:
            raise SystemExit(f"--{name}s: unknown {bad}; choose from {', '.join(allowed)}")
    if "base" not in modes:
        raise SystemExit("--modes must include base: every ratio is to the same round's base")
    setup = vc.setup(with_vllm="vllm" in engines)
    adapters = make_adapters(32, args.rank, targets, args.seed)
    from common import machine_info, write_result

    sz = {**(vc.QUICK if args.quick else vc.FULL)}
    if args.requests:
        sz["serve_requests"] = args.requests
    payload: dict[str, Any] = {"machine": machine_info(), "setup": setup, "sizes": {k: v for k, v in sz.items()
                               if k.startswith("serve_")}, "rank": args.rank, "targets": targets,
                               "engines": engines, "modes": modes, "rounds": []}
    errors = 0
    for r in range(args.rounds):
        payload["rounds"].append({})
        for e in engines:
            for m in modes:
                vc.log(f"round {r + 1}/{args.rounds}: {e} {m}")
                try:
                    res = run_mode(e, m, adapters, args, sz)
                except Exception as exc:  # recorded; the run fails at the end
                    errors += 1
                    res = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
                payload["rounds"][-1][f"{e}/{m}"] = res
                vc.log(f"  {e} {m}: {res.get('output_tok_s', res.get('error'))} tok/s, "
                       f"ITL p50 {(res.get('itl_ms') or {}).get('p50')} ms")
        payload["summary"] = summarize(payload, engines, modes)
        payload["errors"] = errors
        write_result(args.out or ("lora_quick" if args.quick else "lora"), payload)  # after every round
    path = write_result(args.out or ("lora_quick" if args.quick else "lora"), payload)
    vc.log(f"summary {json.dumps(payload['summary'])}; results {path}")
    return 1 if errors else 0


def summarize(payload: dict[str, Any], engines: list[str], modes: list[str]) -> dict[str, Any]:
    """Per engine and mode: the median output tokens/s and the median of the per-round
    ratios to the same round's base; kvpilot over vLLM per mode when both ran."""
    summary: dict[str, Any] = {}
    for e in engines:
        for m in modes:
            ratios = [rd[f"{e}/{m}"]["output_tok_s"] / rd[f"{e}/base"]["output_tok_s"]
                      for rd in payload["rounds"] if "output_tok_s" in rd.get(f"{e}/{m}", {})
                      and "output_tok_s" in rd.get(f"{e}/base", {})]
            tok = [rd[f"{e}/{m}"]["output_tok_s"] for rd in payload["rounds"]
                   if "output_tok_s" in rd.get(f"{e}/{m}", {})]
            summary[f"{e}/{m}"] = {"output_tok_s_median": statistics.median(tok) if tok else None,
                                   "ratio_to_base_median": round(statistics.median(ratios), 3) if ratios else None,
                                   "ratios": [round(x, 3) for x in ratios]}
    if "vllm" in engines and "kvpilot" in engines:
        for m in modes:
            ratios = [rd[f"kvpilot/{m}"]["output_tok_s"] / rd[f"vllm/{m}"]["output_tok_s"]
                      for rd in payload["rounds"] if "output_tok_s" in rd.get(f"kvpilot/{m}", {})
                      and "output_tok_s" in rd.get(f"vllm/{m}", {})]
            summary[f"kvpilot_vs_vllm/{m}"] = round(statistics.median(ratios), 3) if ratios else None
    return summary


if __name__ == "__main__":
    sys.exit(main())
