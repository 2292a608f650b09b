"""The vLLM (v1 engine) metric names that vLLM's Grafana dashboard and the Gateway API
Inference Extension's endpoint picker read: present with vLLM's types, labels and buckets,
and moved by real requests by the right amounts, first through an :class:`EngineMetrics`
fed by a real engine on the embedded model, then through a real server."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.metrics import (
    VLLM_ITERATION_TOKEN_BUCKETS,
    VLLM_N_BUCKETS,
    VLLM_REQUEST_BUCKETS,
    VLLM_TOKEN_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    EngineMetrics,
    build_1_2_5_buckets,
)
from tests.engine.test_model_families import WINDOW, tiny_checkpoint
from tests.engine.test_model_families import make_engine as make_family_engine

from .metrics_util import scrape, wait_metric

# Every series the `expr`s of vLLM's dashboard read
# (vllm-project/vllm examples/online_serving/prometheus_grafana/grafana.json).
GRAFANA_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
)
# Read by the dashboard too, but vLLM observes it once per user request (all n choices
# finished), which only the fan-out layer sees: declared, samples come from
# EngineMetrics.observe_finished_parent().
GRAFANA_PER_PARENT_SERIES = ("vllm:request_max_num_generation_tokens_sum",)
# The endpoint picker's defaults (queue, running, KV usage old and new, cache config).
GATEWAY_SERIES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
)

# family name -> (type, label names besides model_name/engine, buckets or None)
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc")
LATENCY_HISTOGRAMS = {
    "time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
    "inter_token_latency_seconds": VLLM_TOKEN_LATENCY_BUCKETS,
    "time_per_output_token_seconds": VLLM_TOKEN_LATENCY_BUCKETS,
    "request_time_per_output_token_seconds": VLLM_TOKEN_LATENCY_BUCKETS,
    "e2e_request_latency_seconds": VLLM_REQUEST_BUCKETS,
    "request_queue_time_seconds": VLLM_REQUEST_BUCKETS,
    "request_inference_time_seconds": VLLM_REQUEST_BUCKETS,
    "request_prefill_time_seconds": VLLM_REQUEST_BUCKETS,
    "request_decode_time_seconds": VLLM_REQUEST_BUCKETS,
    "iteration_tokens_total": VLLM_ITERATION_TOKEN_BUCKETS,
}
TOKEN_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                    "request_max_num_generation_tokens")
PER_PARENT = ("request_params_n", "request_max_num_generation_tokens")
CACHE_INFO_LABELS = {"block_size", "cache_dtype", "calculate_kv_scales", "enable_prefix_caching",
                     "gpu_memory_utilization", "num_gpu_blocks", "num_gpu_blocks_override", "sliding_window",
                     "engine"}

MAX_MODEL_LEN = 512


def families(metrics: EngineMetrics) -> dict:
    return {f.name: f for f in metrics.registry.collect() if f.name.startswith("vllm:")}


def check_families(fams: dict, max_model_len: int) -> None:
    """Every vLLM family with vLLM's type, label names and bucket boundaries."""
    vl = {"model_name", "engine"}
    for name in COUNTERS:
        f = fams[f"vllm:{name}"]
        assert f.type == "counter", name
        assert {s.name for s in f.samples} == {f"vllm:{name}_total"}
        assert all(set(s.labels) == vl for s in f.samples)
    f = fams["vllm:request_success"]
    assert f.type == "counter"
    assert {s.labels["finished_reason"] for s in f.samples} >= {"stop", "length", "abort"}
    assert all(set(s.labels) == vl | {"finished_reason"} for s in f.samples)
    for name in GAUGES:
        f = fams[f"vllm:{name}"]
        assert f.type == "gauge" and [set(s.labels) for s in f.samples] == [vl], name
    expected = {**LATENCY_HISTOGRAMS, **{n: tuple(build_1_2_5_buckets(max_model_len)) for n in TOKEN_HISTOGRAMS},
                "request_params_n": VLLM_N_BUCKETS}
    for name, buckets in expected.items():
        f = fams[f"vllm:{name}"]
        assert f.type == "histogram", name
        for s in f.samples:
            assert set(s.labels) - {"le"} == vl, name
        bounds = [float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
        if bounds or name not in PER_PARENT:  # the per-parent ones have no samples until observed
            assert bounds == [float(b) for b in buckets], name
    f = fams["vllm:cache_config_info"]
    assert f.type == "gauge" and len(f.samples) == 1
    assert set(f.samples[0].labels) == CACHE_INFO_LABELS and f.samples[0].value == 1


def test_build_1_2_5_buckets_is_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(1024) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@pytest.fixture(scope="module")
def run(make_engine):
    """A real engine fed to EngineMetrics the way the server does (observe after every
    step): three requests that run to their length (5, 3 and 1 tokens), one aborted while
    waiting with max_tokens set and one without. Prefix caching off, so the tokens each
    step computes are exactly the prompts plus the decodes."""
    engine = make_engine(kv_cache_memory=0.05, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    metrics = EngineMetrics("m")
    metrics.set_config(engine)
    prompts = {f"r{i}": list(range(100 + 40 * i, 100 + 40 * i + 17 + 3 * i)) for i in range(3)}
    max_tokens = {"r0": 5, "r1": 3, "r2": 1}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens[rid], ignore_eos=True, temperature=0))
    engine.add_request("a0", [7, 8, 9], SamplingParams(max_tokens=4))
    engine.add_request("a1", [7, 8, 9, 10], SamplingParams(max_tokens=None))
    assert sorted(engine.abort_request(["a0", "a1"])) == ["a0", "a1"]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        metrics.observe(engine)
    metrics.observe(engine)  # idle: nothing more is observed
    return metrics, engine, prompts, max_tokens, steps


def test_engine_run_moves_every_vllm_series_by_the_right_amounts(run):
    metrics, engine, prompts, max_tokens, steps = run

    def v(name, **labels):
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    def k(name, **labels):
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})

    check_families(families(metrics), MAX_MODEL_LEN)
    done_prompt = sum(len(p) for p in prompts.values())
    generated = sum(max_tokens.values())
    # Counters: as kvpilot's, and what was asked.
    assert v("vllm:prompt_tokens_total") == k("kvpilot:prompt_tokens_total") == done_prompt
    assert v("vllm:generation_tokens_total") == k("kvpilot:generation_tokens_total") == generated
    assert v("vllm:prefix_cache_queries_total") == k("kvpilot:prefix_cache_queries_total")
    assert v("vllm:prefix_cache_hits_total") == 0 and v("vllm:num_preemptions_total") == 0
    assert v("vllm:request_success_total", finished_reason="length") == 3
    assert v("vllm:request_success_total", finished_reason="abort") == 2
    assert v("vllm:request_success_total", finished_reason="stop") == 0
    # Gauges after the engine went idle.
    assert v("vllm:num_requests_running") == v("vllm:num_requests_waiting") == 0
    assert v("vllm:kv_cache_usage_perc") == v("vllm:gpu_cache_usage_perc") == 0
    # One observation per finished request, aborted ones included.
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_max_tokens"):
        assert v(f"vllm:{name}_count") == 5, name
    assert v("vllm:e2e_request_latency_seconds_sum") == pytest.approx(k("kvpilot:e2e_request_latency_seconds_sum"))
    assert v("vllm:request_queue_time_seconds_sum") == pytest.approx(k("kvpilot:request_queue_time_seconds_sum"))
    assert v("vllm:request_prompt_tokens_sum") == done_prompt + 3 + 4
    assert v("vllm:request_generation_tokens_sum") == generated
    # max_tokens as asked; unset = what max_model_len leaves after the prompt.
    assert v("vllm:request_params_max_tokens_sum") == generated + 4 + (MAX_MODEL_LEN - 4)
    # Phases only for requests that produced a token; decode = the sum of its ITLs.
    for name in ("time_to_first_token_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds"):
        assert v(f"vllm:{name}_count") == 3, name
    assert v("vllm:time_to_first_token_seconds_sum") == pytest.approx(k("kvpilot:time_to_first_token_seconds_sum"))
    prefill, decode = v("vllm:request_prefill_time_seconds_sum"), v("vllm:request_decode_time_seconds_sum")
    assert prefill > 0 and decode > 0
    assert v("vllm:request_inference_time_seconds_sum") == pytest.approx(prefill + decode)
    assert v("vllm:request_prefill_time_seconds_sum") <= v("vllm:time_to_first_token_seconds_sum")
    itl_count = sum(n - 1 for n in max_tokens.values())
    assert v("vllm:inter_token_latency_seconds_count") == v("vllm:time_per_output_token_seconds_count") == itl_count
    assert v("vllm:inter_token_latency_seconds_sum") == pytest.approx(v("vllm:time_per_output_token_seconds_sum"))
    assert v("vllm:inter_token_latency_seconds_sum") == pytest.approx(decode)
    assert v("vllm:inter_token_latency_seconds_count") == k("kvpilot:inter_token_latency_seconds_count")
    # Per-request time per output token: only requests with 2+ tokens (r0: 4 gaps, r1: 2).
    assert v("vllm:request_time_per_output_token_seconds_count") == 2
    assert 0 < v("vllm:request_time_per_output_token_seconds_sum") <= decode
    # One observation per step that computed something: prompts + every decode.
    assert v("vllm:iteration_tokens_total_count") == steps
    assert v("vllm:iteration_tokens_total_sum") == done_prompt + itl_count
    # kvpilot's own name for the same observations (the autoscaler's step_tokens).
    assert k("kvpilot:iteration_tokens_total_count") == steps
    assert k("kvpilot:iteration_tokens_total_sum") == done_prompt + itl_count
    # The per-parent histograms stay empty: the engine never sees n.
    assert v("vllm:request_params_n_count") is None and v("vllm:request_max_num_generation_tokens_count") is None
    # Cache config as vLLM formats it.
    info = families(metrics)["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == str(engine.config.block_size) == "16"
    assert info["num_gpu_blocks"] == str(engine.config.num_blocks)
    assert info["enable_prefix_caching"] == "False" and info["cache_dtype"] == "auto" and info["engine"] == "0"
    # SmolLM2 has no sliding window: vLLM's str(None), on both series.
    assert info["sliding_window"] == "None"
    assert cache_config_info(metrics, "kvpilot:cache_config_info")["sliding_window"] == "None"


def cache_config_info(metrics: EngineMetrics, name: str) -> dict[str, str]:
    (family,) = (f for f in metrics.registry.collect() if f.name == name)
    (sample,) = family.samples
    return dict(sample.labels)


@pytest.mark.parametrize(("arch", "kvpilot_window", "vllm_window"), [
    ("mistral", str(WINDOW), str(WINDOW)),  # every layer slides: the engine frees blocks behind W
    ("gemma2", "None", str(WINDOW)),  # sliding and full layers interleave: nothing is freed
])
def test_cache_config_info_carries_the_sliding_window(tmp_path, arch, kvpilot_window, vllm_window):
    """``sliding_window`` on ``kvpilot:cache_config_info`` is the window the KV cache frees
    blocks behind (the operator's capacity estimate caps a request at it), so only a
    model whose every layer slides has one; ``vllm:cache_config_info`` carries the
    model's window as vLLM's CacheConfig does."""
    tiny_checkpoint(arch, tmp_path)
    engine = make_family_engine(tmp_path)
    assert engine.config.sliding_window == (WINDOW if arch == "mistral" else None)
    metrics = EngineMetrics("m")
    metrics.set_config(engine)
    info = cache_config_info(metrics, "kvpilot:cache_config_info")
    assert info["sliding_window"] == kvpilot_window
    assert info["block_size"] == "4" and int(info["num_gpu_blocks"]) == engine.config.num_blocks
    assert cache_config_info(metrics, "vllm:cache_config_info")["sliding_window"] == vllm_window


def test_cache_config_info_has_no_window_with_disable_sliding_window(tmp_path):
    tiny_checkpoint("mistral", tmp_path)
    engine = make_family_engine(tmp_path, max_model_len=WINDOW, disable_sliding_window=True)
    metrics = EngineMetrics("m")
    metrics.set_config(engine)
    assert cache_config_info(metrics, "kvpilot:cache_config_info")["sliding_window"] == "None"
    assert cache_config_info(metrics, "vllm:cache_config_info")["sliding_window"] == "None"


def test_per_parent_histograms_take_one_observation_per_user_prompt(run):
    metrics = run[0]

    def v(name, **labels):
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    metrics.observe_finished_parent(2, 7)
    metrics.observe_finished_parent(1, 3)
    assert v("vllm:request_params_n_count") == 2 and v("vllm:request_params_n_sum") == 3
    assert v("vllm:request_params_n_bucket", le="1.0") == 1 and v("vllm:request_params_n_bucket", le="2.0") == 2
    assert v("vllm:request_max_num_generation_tokens_count") == 2
    assert v("vllm:request_max_num_generation_tokens_sum") == 10
    assert v("vllm:request_max_num_generation_tokens_bucket", le="5.0") == 1
    check_families(families(metrics), MAX_MODEL_LEN)


# ------------------------------------------------------------- a real server
def text_families(url: str) -> tuple[str, dict]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def test_server_exports_every_dashboard_and_gateway_name_with_vllms_types(server):
    text, fams = text_families(server.url)
    samples = {s.name for f in fams.values() for s in f.samples}
    assert set(GRAFANA_SERIES) <= samples, set(GRAFANA_SERIES) - samples
    assert set(GATEWAY_SERIES) <= samples, set(GATEWAY_SERIES) - samples
    for name in GRAFANA_PER_PARENT_SERIES:
        assert fams[name.removesuffix("_sum")].type == "histogram"
    check_families({n: f for n, f in fams.items() if n.startswith("vllm:")}, 1024)
    # Exposed names are vLLM's exactly: counters end in one _total.
    for name in (*COUNTERS, "request_success"):
        assert f"\nvllm:{name}_total{{" in text and f"vllm:{name}_total_total" not in text
    assert "\nvllm:iteration_tokens_total_bucket{" in text
    # What the endpoint picker parses out of the cache config: positive integers.
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert int(info["block_size"]) == 16 and int(info["num_gpu_blocks"]) > 0
    # No LoRA: like vLLM without --enable-lora, no lora_requests_info at all.
    assert "vllm:lora_requests_info" not in text


def test_server_requests_move_the_vllm_series_by_what_the_api_reported(http, server):
    wait_metric(server.url, "vllm:num_requests_running", lambda x: x == 0)
    wait_metric(server.url, "vllm:num_requests_waiting", lambda x: x == 0)
    before = scrape(server.url)
    asks = [4, 6, 2]
    usages = []
    for i, n in enumerate(asks):
        r = http.post("/v1/completions", json={"prompt": f"Count to {i + 3}:", "max_tokens": n,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        usages.append(r.json()["usage"])
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    asks.append(3)
    usages.append(r.json()["usage"])
    n_req = len(asks)
    # The last step's statistics land right after its outputs are handed over.
    wait_metric(server.url, "vllm:e2e_request_latency_seconds_count",
                lambda x: x == before["vllm:e2e_request_latency_seconds_count"] + n_req)
    after = scrape(server.url)

    def delta(key):
        return after[key] - before.get(key, 0.0)

    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    assert completion == sum(asks)
    assert delta("vllm:prompt_tokens_total") == prompt == delta("kvpilot:prompt_tokens_total")
    assert delta("vllm:generation_tokens_total") == completion == delta("kvpilot:generation_tokens_total")
    assert delta("vllm:request_success_total[('finished_reason', 'length')]") == n_req
    assert delta("vllm:request_success_total[('finished_reason', 'stop')]") == 0
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "time_to_first_token_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "request_time_per_output_token_seconds"):
        assert delta(f"vllm:{name}_count") == n_req, name
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == completion
    assert delta("vllm:request_params_max_tokens_sum") == sum(asks)
    gaps = sum(n - 1 for n in asks)
    assert delta("vllm:inter_token_latency_seconds_count") == gaps == delta("vllm:time_per_output_token_seconds_count")
    assert delta("vllm:request_decode_time_seconds_sum") == pytest.approx(delta("vllm:inter_token_latency_seconds_sum"))
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(
        delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum"))
    # One observation per step; the requests ran one after the other: a prefill step (the
    # first token) and a step per further token each. A full prefix hit recomputes one token.
    assert delta("vllm:iteration_tokens_total_count") == sum(asks)
    computed = delta("vllm:iteration_tokens_total_sum")
    assert prompt - delta("vllm:prefix_cache_hits_total") + gaps <= computed <= prompt + gaps
    assert delta("vllm:prefix_cache_hits_total") == delta("kvpilot:prefix_cache_hits_total")
    assert after["vllm:num_requests_running"] == after["kvpilot:num_requests_running"]
    # Once per user prompt, after all its choices: n and the longest choice.
    assert delta("vllm:request_params_n_count") == n_req and delta("vllm:request_params_n_sum") == n_req
    assert delta("vllm:request_max_num_generation_tokens_sum") == sum(asks)


def test_the_per_request_n_histogram_counts_each_prompt_once_with_its_n(http, server):
    before = scrape(server.url)
    r = http.post("/v1/completions", json={"prompt": ["One", "Two"], "n": 3, "max_tokens": 2, "temperature": 1.0,
                                           "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"]) == 6
    wait_metric(server.url, "vllm:request_params_n_count",
                lambda x: x == before.get("vllm:request_params_n_count", 0.0) + 2)
    after = scrape(server.url)
    assert after["vllm:request_params_n_sum"] - before.get("vllm:request_params_n_sum", 0.0) == 6
    assert (after["vllm:request_max_num_generation_tokens_sum"]
            - before.get("vllm:request_max_num_generation_tokens_sum", 0.0)) == 4


def test_finished_requests_read_zero_before_the_first_one_finishes():
    """The autoscaler's scale to zero reads "no request finished yet" as 0; a series that
    only appears at the first finish would read as missing data and block it."""
    from prometheus_client import generate_latest

    text = generate_latest(EngineMetrics("m").registry).decode()
    for reason in ("stop", "length", "abort"):
        assert f'kvpilot:request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0' in text


# ------------------------------------------------------------------------ LoRA
def picker_lora_view(text: str) -> tuple[set[str], set[str], int] | None:
    """What the Gateway API Inference Extension's endpoint picker takes from
    ``vllm:lora_requests_info`` (``getLatestLoraMetric`` and ``promToPodMetrics`` in its
    metrics client): among the series whose running and waiting labels are not both
    empty, the one with the largest value (a timestamp); its comma-split adapter names
    and ``max_lora`` as an int. None: no such series (the picker keeps what it had)."""
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"]
    assert family.type == "gauge"
    named = [s for s in family.samples if s.labels["running_lora_adapters"] or s.labels["waiting_lora_adapters"]]
    if not named:
        return None
    latest = max(named, key=lambda s: s.value)
    labels = latest.labels
    running = set(labels["running_lora_adapters"].split(",")) if labels["running_lora_adapters"] else set()
    waiting = set(labels["waiting_lora_adapters"].split(",")) if labels["waiting_lora_adapters"] else set()
    return running, waiting, int(labels["max_lora"])


def lora_stats_after_one_step():
    """A real scheduler with max_loras=2 after one step, and the IterationStats that
    LLMEngine.take_stats makes from it (the real method on a stand-in engine)."""
    from types import SimpleNamespace

    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.outputs import IterationStats
    from tests.engine.core.helpers import adapter, make_request, make_scheduler

    sched = make_scheduler(num_blocks=40, budget=64, max_loras=2, max_model_len=40)
    for rid, lora in (("a", adapter("sql-lora", 1)), ("b", adapter("chat-lora", 2)),
                      ("c", adapter("summarize", 3)), ("base", None)):
        sched.add_request(make_request(rid, [5, 6, 7], lora=lora))
    sched.schedule()
    engine = SimpleNamespace(_stats=IterationStats(), scheduler=sched)
    return sched, LLMEngine.take_stats(engine)  # type: ignore[arg-type]


def test_take_stats_reports_running_and_waiting_adapters():
    sched, stats = lora_stats_after_one_step()
    assert [r.request_id for r in sched.waiting] == ["c"]  # max_loras=2 held the third adapter back
    assert stats.running_lora_adapters == ("chat-lora", "sql-lora")
    assert stats.waiting_lora_adapters == ("summarize",)


def test_lora_requests_info_is_vllms_and_parses_as_the_endpoint_picker_reads_it():
    from prometheus_client import generate_latest

    metrics = EngineMetrics("m")
    assert "vllm:lora_requests_info" not in generate_latest(metrics.registry).decode()  # LoRA off: absent
    metrics.enable_lora_info(2)
    _, stats = lora_stats_after_one_step()
    metrics.observe_lora(stats.running_lora_adapters, stats.waiting_lora_adapters, now=1000.0)
    text = generate_latest(metrics.registry).decode()  # what GET /metrics serves
    assert "# HELP vllm:lora_requests_info Running stats on lora requests.\n" in text
    assert "# TYPE vllm:lora_requests_info gauge\n" in text
    # vLLM's label names and nothing else (no model_name, no engine); prometheus_client
    # writes them sorted, as it does for vLLM.
    assert ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="chat-lora,sql-lora",'
            'waiting_lora_adapters="summarize"} 1000.0\n') in text
    assert picker_lora_view(text) == ({"chat-lora", "sql-lora"}, {"summarize"}, 2)
    # Later updates: the picker follows the newest series; an idle update (no adapter)
    # leaves the last named one for it, as vLLM's stale series do.
    metrics.observe_lora(["summarize"], [], now=1001.0)
    assert picker_lora_view(generate_latest(metrics.registry).decode()) == ({"summarize"}, set(), 2)
    metrics.observe_lora([], [], now=1002.0)
    metrics.observe_lora([], [], now=1003.0)
    text = generate_latest(metrics.registry).decode()
    assert picker_lora_view(text) == ({"summarize"}, set(), 2)
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"]
    values = {(s.labels["running_lora_adapters"], s.labels["waiting_lora_adapters"]): s.value for s in family.samples}
    assert values == {("summarize", ""): 1001.0, ("", ""): 1003.0}  # bounded: two series at most
    metrics.observe_lora(["sql-lora"], ["chat-lora"], now=1004.0)
    text = generate_latest(metrics.registry).decode()
    assert picker_lora_view(text) == ({"sql-lora"}, {"chat-lora"}, 2)
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"]
    assert len(family.samples) == 1


def test_lora_requests_info_value_is_the_wall_clock_time():
    import time

    metrics = EngineMetrics("m")
    metrics.enable_lora_info(1)
    before = time.time()
    metrics.observe_lora(["a"], [])
    value = metrics.registry.get_sample_value(
        "vllm:lora_requests_info", {"max_lora": "1", "waiting_lora_adapters": "", "running_lora_adapters": "a"})
    assert before <= value <= time.time()
