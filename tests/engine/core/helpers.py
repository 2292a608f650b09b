"""Shared helpers for the CPU scheduling-core tests: a deterministic fake model."""

from __future__ import annotations

from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request
from kvpilot.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.sampling_params import SamplingParams

EOS = 2


def fake_token(req: Request) -> int:
    """A deterministic 'model': the next token depends only on the request's tokens."""
    return 100 + (sum(req.token_ids) * 31 + req.num_tokens) % 97


def make_scheduler(
    num_blocks: int = 10,
    block_size: int = 4,
    budget: int = 16,
    max_num_seqs: int = 8,
    max_model_len: int | None = None,
    prefix_caching: bool = True,
    max_loras: int = 0,
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len or num_blocks * block_size,
        max_loras=max_loras,
    )
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, prefix_caching), clock=lambda: 0.0)


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None,
                 lora: LoRARequest | None = None, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), eos_token_ids=[EOS],
                   cache_salt=salt, lora_request=lora)


def adapter(name: str, lora_int_id: int) -> LoRARequest:
    """A registered adapter as the engine would hand it to the core (no weights needed)."""
    return LoRARequest(name, lora_int_id, f"/adapters/{name}")


def step(sched: Scheduler) -> SchedulerOutput:
    """schedule -> fake model -> update, checking invariants around it."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert sum(it.num_tokens for it in out.scheduled) == out.num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    assert all(it.num_tokens == 1 for it in out.scheduled[: out.num_decodes])
    tokens = [fake_token(it.request) if it.sample else None for it in out.scheduled]
    sched.update(out, tokens)
    sched.check_integrity()
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished_requests():
        out = step(sched)
        assert not out.is_empty, f"no progress with requests pending: {list(sched.requests.values())}"
        steps += 1
        assert steps < max_steps, "did not finish"
    return steps
