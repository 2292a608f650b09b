"""Engine /metrics pages in the format our engine writes, for metric-source tests."""

from __future__ import annotations

import httpx


def page(usage=0.25, waiting=3, preemptions=7, generated=1000, capacity=True,
         finished=4, window=None) -> str:
    """An engine /metrics page in the format our engine writes; ``window`` is the
    ``sliding_window`` label of the cache-config info (None: no label, as older engines)."""
    window_label = "" if window is None else f',sliding_window="{window}"'
    lines = [
        "# TYPE kvpilot:gpu_cache_usage_factor gauge",
        f'kvpilot:gpu_cache_usage_factor{{model_name="m"}} {usage}',
        "# TYPE kvpilot:num_requests_waiting gauge",
        f'kvpilot:num_requests_waiting{{model_name="m"}} {waiting}',
        "# TYPE kvpilot:num_waiting_tokens gauge",
        f'kvpilot:num_waiting_tokens{{model_name="m"}} {waiting * 100}',
        "# TYPE kvpilot:num_requests_running gauge",
        'kvpilot:num_requests_running{model_name="m"} 5',
        "# TYPE kvpilot:num_preemptions counter",
        f'kvpilot:num_preemptions_total{{model_name="m"}} {preemptions}',
        "# TYPE kvpilot:generation_tokens counter",
        f'kvpilot:generation_tokens_total{{model_name="m"}} {generated}',
        "# TYPE kvpilot:prompt_tokens counter",
        'kvpilot:prompt_tokens_total{model_name="m"} 3000',
        "# TYPE kvpilot:cache_config_info gauge",
        'kvpilot:cache_config_info{block_size="16",cache_dtype="float32",'
        'enable_prefix_caching="true",model_name="m",num_gpu_blocks="1456"'
        f"{window_label}}} 1.0",
    ]
    if capacity:
        lines += ["# TYPE kvpilot:kv_cache_capacity_tokens gauge",
                  'kvpilot:kv_cache_capacity_tokens{model_name="m"} 20000']
    if finished:
        lines += ["# TYPE kvpilot:request_success counter",
                  'kvpilot:request_success_total{finished_reason="stop",model_name="m"}'
                  f" {finished - 1}",
                  'kvpilot:request_success_total{finished_reason="length",model_name="m"} 1']
    return "\n".join(lines) + "\n"


class Pages:
    """httpx mock transport: ``pages[host]`` is the text (or an exception) to answer."""

    def __init__(self):
        self.pages = {}
        self.requests = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(str(request.url))
        answer = self.pages.get(request.url.host)
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            return httpx.Response(404, text="not found")
        return httpx.Response(200, text=answer)
