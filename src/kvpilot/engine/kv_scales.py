"""Fixed KV-cache scales from a calibration pass at start-up.

A quantized KV cache (FP8, fp4_e2m1, int4) needs a per-layer ``k_scale``/``v_scale``.
When the checkpoint has none, the engine runs the model once, before serving, over
:data:`CALIBRATION_MESSAGES` (chat-formatted when the tokenizer has a template) and fixes
each layer's scales from the K/V that text produces
(:meth:`kvpilot.engine.kv_cache.PagedKVCache.fit_scales`). The text is the same every
time, so the scales are too: the same request gets the same answer whatever traffic came
before it, cached prefix or not. vLLM's equivalent is a checkpoint calibrated offline
(llm-compressor) or scales of 1.0; its ``--calculate-kv-scales`` learns them from the
first batch instead, which our ``--calculate-kv-scales`` also offers (opt-in).

The text mixes what agentic traffic sends (instructions, prose, code, JSON tool calls,
numbers, several scripts) so the K/V magnitudes it produces cover typical requests;
anything larger is clamped to the format's range on store.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvpilot.engine.attention.backend import AttentionMetadata
from kvpilot.engine.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

# Tokens of the calibration pass at most (the text gives about 700 with SmolLM2's tokenizer).
CALIBRATION_MAX_TOKENS = 1024

CALIBRATION_MESSAGES: tuple[dict[str, str], ...] = (
    {
        "role": "system",
        "content": (
            "You are a careful assistant for a platform team. Answer briefly, cite the "
            "commands you ran, and call a tool when live data is needed. Tools: "
            "get_weather(city: string, unit: 'celsius' | 'fahrenheit'), "
            "search_docs(query: string, limit: integer)."
        ),
    },
    {
        "role": "user",
        "content": (
            "Our inference pods restart every few hours. Here is the log tail:\n"
            "2026-11-30T04:12:55Z WARN kv cache usage 0.97, 14 requests waiting\n"
            "2026-11-30T04:13:02Z ERROR OOMKilled (exit 137), restartCount=6\n"
            "What should I check first? Also, what's the weather in Zürich and in 東京?"
        ),
    },
    {
        "role": "assistant",
        "content": (
            "First check the memory limit against the KV cache size: bytes per token = "
            "2 x layers x kv_heads x head_dim x bytes, so 32 layers, 8 KV heads and "
            "head_dim 128 in bf16 give 131072 bytes (128 KiB) per token. At 32768 tokens "
            "that is 4 GiB per full-context request.\n"
            '{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n'
            '{"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}'
        ),
    },
    {
        "role": "user",
        "content": (
            "Write a Python function that returns the p99 of a list of latencies, then "
            "explain it in one sentence in French and in German.\n\n"
            "def p99(values: list[float]) -> float:\n"
            "    ordered = sorted(values)\n"
            "    index = max(0, int(round(0.99 * len(ordered))) - 1)\n"
            "    return ordered[index]\n\n"
            "La fonction trie les latences et renvoie la valeur sous laquelle se trouvent "
            "99 % des mesures. Die Funktion sortiert die Latenzen und gibt den Wert zurück, "
            "unter dem 99 % der Messungen liegen. Once upon a time, a lighthouse keeper "
            "counted the ships that passed: 3, 14, 15, 92, 65, 35 — and wrote each number "
            "in a ledger by candlelight, because the sea, he said, remembers everything."
        ),
    },
)


def calibration_token_ids(tokenizer: Any, limit: int) -> list[int]:
    """The calibration text as token ids, chat-formatted when ``tokenizer`` has a chat
    template, else the messages' contents joined by blank lines; at most ``limit``."""
    messages = [dict(m) for m in CALIBRATION_MESSAGES]
    if getattr(tokenizer, "chat_template", None):  # rendered as the server renders a chat
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode("\n\n".join(m["content"] for m in messages))
    return [int(t) for t in ids][:limit]


@torch.inference_mode()
def calibrate_at_startup(model: Any, backend: Any, cache: PagedKVCache, token_ids: list[int]) -> None:
    """Run ``token_ids`` through ``model`` as one prefill and fix every uncalibrated
    layer's scales from its K/V (:meth:`PagedKVCache.fit_scales`), then zero the cache.

    The pass writes into blocks ``0..ceil(n / block_size) - 1`` of a cache that nothing
    uses yet; each layer's scales are set from its real K/V before they are stored, so
    later layers see what serving will give them. Mutates the cache's scales (and, until
    :meth:`PagedKVCache.reset_contents`, its storage).

    Raises:
        ValueError: fewer than 2 tokens, or more than the cache holds.
    """
    n = len(token_ids)
    block_size = cache.block_size
    num_blocks = -(-n // block_size)
    if n < 2 or num_blocks > cache.num_blocks:
        raise ValueError(f"calibration needs 2..{cache.num_blocks * block_size} tokens; got {n}")
    dev = cache.storage.device
    meta = AttentionMetadata(
        num_decodes=0,
        slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
    )

    def fit(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache.fit_scales(layer, k, v, source="start-up calibration")

    ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
    positions = torch.arange(n, dtype=torch.int64, device=dev)
    rows = torch.tensor([n - 1], dtype=torch.int64, device=dev)
    model(ids, positions, meta, cache.layers, backend, rows, fit)
    cache.reset_contents()
    logger.info("kv cache %s: scales fixed by a start-up pass over %d calibration tokens",
                cache.dtype_name, n)
