"""Engine step time with KV cache events on vs off, the same workload in the same run.

Workload: ``--requests`` requests of ``--prompt-len`` tokens (every other one starting
with the same ``--shared``-token prefix, every fourth one salted) and ``--output`` greedy
tokens each, through an engine whose KV pool (``--blocks`` blocks of 16) is small enough
that published blocks keep being evicted: every step stores blocks, many evict some, so
events are as frequent as this workload allows. "On" runs the real ZMQ publisher on a
loopback port (encoding and sending in its thread, no subscriber); "off" has no events.
Rounds alternate on and off so machine noise hits both alike.

    .venv/bin/python benchmarks/kv_events_step_time.py

Reports, per mode, the median over rounds of: the process CPU time of the whole workload
(all threads, so the publisher thread's encoding counts) and the median per-step process
CPU time; the on/off ratio of each round pair and their median (the headline); the
events sent; and the CPU cost of the event work alone (the collector per stored block,
msgpack per batch), which bounds what events can add per step. Goal: events cost under
1% of step time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_result

EVENTS_ON = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}'


class CountingPublisher:
    """Forwards to the real publisher and counts what went through it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches = 0
        self.stored = 0
        self.removed = 0

    def publish(self, events) -> None:
        from kvpilot.engine.kv_events import BlockRemoved, BlockStored

        self.batches += 1
        for ev in events:
            if type(ev) is BlockStored:
                self.stored += len(ev.block_hashes)
            elif type(ev) is BlockRemoved:
                self.removed += len(ev.block_hashes)
        self.inner.publish(events)

    def shutdown(self) -> None:
        self.inner.shutdown()


def workload(args) -> list[tuple[list[int], str | None]]:
    rng = random.Random(0)
    shared = [rng.randrange(1000, 20000) for _ in range(args.shared)]
    out = []
    for i in range(args.requests):
        head = shared if i % 2 == 0 else [rng.randrange(1000, 20000) for _ in range(args.shared)]
        tail = [rng.randrange(1000, 20000) for _ in range(args.prompt_len - args.shared)]
        out.append((head + tail, f"tenant-{i % 3}" if i % 4 == 3 else None))
    return out


def one_round(loaded, events: bool, prompts, args) -> dict[str, float]:
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.kv_events import KVEventsConfig, ZmqEventPublisher
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.sampling_params import SamplingParams

    engine_args = EngineArgs(device="cpu", num_gpu_blocks_override=args.blocks,
                             max_num_batched_tokens=args.budget, max_num_seqs=args.max_num_seqs,
                             kv_events_config=EVENTS_ON if events else None)
    publisher = None
    if events:
        publisher = CountingPublisher(ZmqEventPublisher(KVEventsConfig.from_json(EVENTS_ON)))
        publisher.inner.start()
    engine = LLMEngine(engine_args, loaded=loaded, kv_event_publisher=publisher)
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    for i, (ids, salt) in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params, cache_salt=salt)
    steps = []
    start = time.process_time()
    while engine.has_unfinished_requests():
        t0 = time.process_time()
        engine.step()
        steps.append(time.process_time() - t0)
    if publisher is not None:
        publisher.shutdown()  # joins the thread: its last encodes count in the total
    total = time.process_time() - start
    out = {"total_cpu_s": total, "step_cpu_s": statistics.median(steps), "steps": len(steps)}
    if publisher is not None:
        out |= {"batches": publisher.batches, "blocks_stored": publisher.stored, "blocks_removed": publisher.removed,
                "batches_sent": publisher.inner.published_batches}
    return out


def collector_cost(n: int = 20000) -> float:
    """Seconds of CPU per ``block_stored`` call (hash + list append or merge)."""
    from kvpilot.engine.kv_events import KVEventCollector

    c = KVEventCollector(16)
    key = tuple(range(16))
    parent = None
    t0 = time.process_time()
    for _ in range(n):
        parent = c.block_stored(parent, key, None)
    return (time.process_time() - t0) / n


def encode_cost(n: int = 2000) -> float:
    """Seconds of CPU to msgpack-encode one batch of a 10-block BlockStored and a
    2-block BlockRemoved (the publisher thread's work per step, before the send)."""
    from kvpilot.engine.kv_events import BlockRemoved, BlockStored, encode_batch

    batch = [BlockStored(list(range(2**40, 2**40 + 10)), 2**41, list(range(1000, 1160)), 16),
             BlockRemoved([2**42, 2**43])]
    t0 = time.process_time()
    for _ in range(n):
        encode_batch(time.time(), batch)
    return (time.process_time() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--shared", type=int, default=64, help="tokens of the prefix every other request shares")
    ap.add_argument("--output", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=96, help="KV blocks (16 tokens each): small, so blocks are evicted")
    ap.add_argument("--budget", type=int, default=256, help="--max-num-batched-tokens")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()

    import torch

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.model_runner import load_model

    loaded = load_model(EngineArgs(device="cpu"))
    torch.set_num_threads(args.threads)
    prompts = workload(args)
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            runs[mode].append(one_round(loaded, mode == "on", prompts, args))
            print(f"round {r} {mode}: {runs[mode][-1]}", flush=True)
    rows = {m: {k: statistics.median(x[k] for x in runs[m]) for k in ("total_cpu_s", "step_cpu_s")} for m in runs}
    per_block = collector_cost()
    per_batch = encode_cost()
    on = runs["on"][0]
    pairs = [(on_r["total_cpu_s"] / off_r["total_cpu_s"], on_r["step_cpu_s"] / off_r["step_cpu_s"])
             for on_r, off_r in zip(runs["on"], runs["off"])]
    summary = {
        "total_ratio": statistics.median(p[0] for p in pairs),
        "step_ratio": statistics.median(p[1] for p in pairs),
        "paired_total_ratios": [round(p[0], 4) for p in pairs],
        "paired_step_ratios": [round(p[1], 4) for p in pairs],
        "collector_s_per_block": per_block,
        "encode_s_per_batch": per_batch,
        "steps": on["steps"], "batches": on["batches"], "batches_sent": on["batches_sent"],
        "blocks_stored": on["blocks_stored"], "blocks_removed": on["blocks_removed"],
    }
    print(f"{'events':<7} {'workload CPU (s)':>17} {'median step CPU (s)':>20}")
    for mode, row in rows.items():
        print(f"{mode:<7} {row['total_cpu_s']:>17.3f} {row['step_cpu_s']:>20.5f}")
    print(f"paired rounds on/off: workload {summary['paired_total_ratios']}, step {summary['paired_step_ratios']}")
    print(f"on/off (median of pairs): workload {summary['total_ratio']:.4f}, median step {summary['step_ratio']:.4f}; "
          f"{on['steps']} steps, {on['batches']} step batches ({on['batches_sent']} sent after the salted split), "
          f"{on['blocks_stored']} blocks stored, {on['blocks_removed']} removed; "
          f"collector {per_block * 1e6:.2f} us per stored block, encoding {per_batch * 1e6:.1f} us per batch")
    path = write_result("kv_events_step_time", {"machine": machine_info(), "args": vars(args), "results": rows,
                                                "summary": summary, "rounds": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
