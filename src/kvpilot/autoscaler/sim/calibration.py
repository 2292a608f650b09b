"""Replica models for the fleet simulator: named presets and calibration files.

Two presets:

* ``h100-llama3-8b`` (the default, :class:`ReplicaModel`'s own defaults): a GPU-class
  replica, Llama-3-8B in bf16 on one H100-80GB. Its rates are placeholders (we have no GPU
  measurements of our engine yet); the autoscaler benchmark and its goal use it, because
  pod start-up times and KV sizes of that class are what the goal is about.
* ``cpu-smollm2-135m``: our engine as measured on the project's CPU machine (SmolLM2-135M
  fp32, 2 cores), derived by :func:`replica_model_from` from the benchmark results in
  ``benchmarks/results/`` (figures copied into :data:`CPU_SMOLLM2_135M` below).

* ``h200-llama3-8b``: our engine on one H200 (Llama-3-8B architecture, bf16, 8,192-token
  step budget), fitted by :func:`gpu_model_from` to the figures of
  ``benchmarks/README.md`` ("GPU: the H200"), :data:`H200_LLAMA3_8B` below.
* ``cpu-smollm2-135m-steps``: the CPU engine's step times measured over batch sizes and
  prefill chunks by ``benchmarks/step_time_sweep.py`` and fitted by least squares
  (``benchmarks/results/step_time_cpu.json``; coefficients copied into
  :data:`CPU_STEP_FIT` below).

Which preset is which hardware profile (its default SLO targets,
:data:`kvpilot.autoscaler.sim.model.SLO_PROFILES`): :data:`PROFILES`.

A calibration file (``kvpilot simulate --calibration FILE``) is a JSON object whose keys
are :class:`ReplicaModel` fields, or an object with such an object under
``"replica_model"`` (what ``step_time_sweep.py`` writes); keys it omits keep the preset's
values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvpilot.autoscaler.sim.model import ReplicaModel


@dataclass(frozen=True)
class EngineMeasurements:
    """What our engine's benchmarks measure, in the units they report.

    Attributes:
        prefill_tokens / prefill_seconds: a prefill-only run (one output token per
            request, no prefix reuse): prompt tokens and wall time.
        small_batch / small_batch_step_seconds: running requests and the median
            inter-token latency while only they decode (a decode step at that batch).
        large_batch / large_batch_prompt_tokens / large_batch_output_tokens_each /
            large_batch_seconds: an offline run of ``large_batch`` requests decoding
            together, its prompt tokens, output tokens per request and wall time.
        kv_capacity_tokens: ``kvpilot:kv_cache_capacity_tokens`` of the engine.
        startup_seconds: process start to ``/ready``.
        max_num_seqs: the engine's ``--max-num-seqs``.
    """

    prefill_tokens: int
    prefill_seconds: float
    small_batch: int
    small_batch_step_seconds: float
    large_batch: int
    large_batch_prompt_tokens: int
    large_batch_output_tokens_each: int
    large_batch_seconds: float
    kv_capacity_tokens: int
    startup_seconds: float
    max_num_seqs: int = 256


# SmolLM2-135M-Instruct fp32 on 2 AMD EPYC cores (benchmarks/results, 2026-11-29):
#   shared_prefix.json "off": 64 x (512 + 32) = 34,816 prompt tokens, 1 output each, 78.13 s
#   serve_chunked.json "budget 512": 4 background streams, p50 inter-token latency 130.1 ms
#   offline_throughput.json: 64 requests, 18,463 prompt + 64 x 128 output tokens, 98.04 s
#   /metrics of `kvpilot serve` on CPU: 1,456 blocks x 16 = 23,296 KV tokens; ready in ~20 s
CPU_SMOLLM2_135M = EngineMeasurements(
    prefill_tokens=34_816,
    prefill_seconds=78.126,
    small_batch=4,
    small_batch_step_seconds=0.1301,
    large_batch=64,
    large_batch_prompt_tokens=18_463,
    large_batch_output_tokens_each=128,
    large_batch_seconds=98.044,
    kv_capacity_tokens=23_296,
    startup_seconds=20.0,
)


def replica_model_from(m: EngineMeasurements) -> ReplicaModel:
    """Fit the simulator's replica model to measurements.

    * prefill rate = prefill tokens / prefill seconds;
    * a decode step at the large batch = (offline seconds - its prompt tokens / prefill
      rate) / output tokens per request (the offline run prefills, then decodes together);
    * a decode step is linear in the batch (the model's ``base + per_seq x batch``) through
      that point and the small-batch median step.

    Raises ValueError when the figures give a non-positive rate or step cost.
    """
    prefill_rate = m.prefill_tokens / m.prefill_seconds
    decode_seconds = m.large_batch_seconds - m.large_batch_prompt_tokens / prefill_rate
    large_step = decode_seconds / m.large_batch_output_tokens_each
    if m.large_batch <= m.small_batch:
        raise ValueError(
            f"large_batch ({m.large_batch}) must exceed small_batch ({m.small_batch})")
    per_seq = (large_step - m.small_batch_step_seconds) / (m.large_batch - m.small_batch)
    base = m.small_batch_step_seconds - per_seq * m.small_batch
    if not (prefill_rate > 0 and large_step > 0 and per_seq >= 0 and base > 0):
        raise ValueError(
            f"measurements give prefill {prefill_rate:.1f} tok/s, decode step"
            f" {base:.4f} s + {per_seq:.5f} s/seq: check the figures ({m})"
        )
    return ReplicaModel(
        kv_capacity_tokens=m.kv_capacity_tokens,
        prefill_tokens_per_second=round(prefill_rate, 1),
        decode_step_base_seconds=round(base, 5),
        decode_step_per_seq_seconds=round(per_seq, 6),
        max_num_seqs=m.max_num_seqs,
        startup_seconds=m.startup_seconds,
    )


@dataclass(frozen=True)
class GpuEngineRun:
    """One offline engine run on a GPU plus two kernel figures (benchmarks/README.md).

    Attributes:
        requests / prompt_tokens / output_tokens_each / seconds: the run (all requests
            admitted at once, exactly ``output_tokens_each`` tokens each), wall seconds.
        budget_tokens / max_num_seqs / kv_capacity_tokens: its engine settings and pool.
        weight_bytes / read_bytes_per_second: model weights and the device's measured
            copy bandwidth: a step reads every weight once (the step's fixed cost).
        attention_seconds / attention_batch / attention_context: one paged-decode
            attention call (one layer) at that batch and context.
        layers: attention calls per step.
        startup_seconds: pod start-up assumed for the simulation (image pull, real
            weights), not measured here.
        serve_budget_tokens: the step budget the simulated replica serves with (the
            engine's default, 2,048: an 8,192-token prefill step would take ~0.57 s, ten
            times the GPU profile's ITL target); the fit uses ``budget_tokens``.
    """

    requests: int
    prompt_tokens: int
    output_tokens_each: int
    seconds: float
    budget_tokens: int
    max_num_seqs: int
    kv_capacity_tokens: int
    weight_bytes: float
    read_bytes_per_second: float
    attention_seconds: float
    attention_batch: int
    attention_context: int
    layers: int
    startup_seconds: float = 120.0
    serve_budget_tokens: int = 2048


# One H200, 2026-12-04, benchmarks/README.md "GPU: the H200" (results/gpu_check-h200.json):
#   engine: 256 requests, 164,064 prompt tokens (256-1,024 each), 256 output tokens each,
#     bf16 KV, budget 8,192, 256 seqs, no CUDA graphs: 18.8 s; KV pool 695,472 tokens
#   device-to-device copy 4.19-4.22 TB/s; Llama-3-8B bf16 weights 8.03e9 x 2 bytes
#   paged decode, bf16, 64 x 4,096 context, 32 q / 8 KV heads: 293 us per layer
H200_LLAMA3_8B = GpuEngineRun(
    requests=256,
    prompt_tokens=164_064,
    output_tokens_each=256,
    seconds=18.8,
    budget_tokens=8192,
    max_num_seqs=256,
    kv_capacity_tokens=695_472,
    weight_bytes=16.06e9,
    read_bytes_per_second=4.2e12,
    attention_seconds=293e-6,
    attention_batch=64,
    attention_context=4096,
    layers=32,
)


def gpu_model_from(m: GpuEngineRun) -> ReplicaModel:
    """Fit the step model (base + per_seq x decode rows + prefill tokens x per_token) to
    one offline run and two kernel figures.

    One run gives one equation, so two coefficients come from elsewhere:

    * base = weight bytes / read bandwidth (every step reads the weights once; a lower
      bound: launch overhead without CUDA graphs is not separated);
    * attention per decode row = the paged-decode call's time per (sequence x context
      token) x layers x the run's mean decode context (mean prompt + half the output);
    * per_token (each prefill token, and each decode row's share of the products) =
      what remains of the run's seconds after ``steps x base`` and the decode rows'
      attention, over prompt tokens + decode rows; the run has ceil(prompt tokens /
      budget) prefill steps and output - 1 decode steps of all its requests.

    per_seq = per_token + attention per row. Raises ValueError on a non-positive result.
    """
    base = m.weight_bytes / m.read_bytes_per_second
    context = m.prompt_tokens / m.requests + m.output_tokens_each / 2
    attention = (m.attention_seconds / (m.attention_batch * m.attention_context)
                 * m.layers * context)
    decode_steps = m.output_tokens_each - 1
    steps = -(-m.prompt_tokens // m.budget_tokens) + decode_steps
    rows = m.requests * decode_steps
    per_token = (m.seconds - steps * base - rows * attention) / (m.prompt_tokens + rows)
    if not per_token > 0:
        raise ValueError(f"figures leave no time for the tokens (per_token {per_token}): {m}")
    return ReplicaModel(
        kv_capacity_tokens=m.kv_capacity_tokens,
        prefill_tokens_per_second=round(1.0 / per_token, 1),
        decode_step_base_seconds=round(base, 6),
        decode_step_per_seq_seconds=round(per_token + attention, 7),
        max_num_seqs=m.max_num_seqs,
        max_num_batched_tokens=m.serve_budget_tokens,
        startup_seconds=m.startup_seconds,
    )


# benchmarks/step_time_sweep.py on the project's CPU machine, 2026-12-07 (SmolLM2-135M
# fp32, one torch thread, process CPU time; decode rows 1-64 x prefill chunks 0-1,024):
# least-squares fit (relative errors) of step seconds = base + per_seq x decode rows +
# prefill tokens / rate: 23.77 ms + 1.660 ms x rows + 1.5124 ms x tokens, worst residual
# 27%; see benchmarks/results/step_time_cpu.json. KV pool and start-up: kvpilot serve.
CPU_STEP_FIT = ReplicaModel(
    kv_capacity_tokens=23_296,
    prefill_tokens_per_second=661.2,
    decode_step_base_seconds=0.02377,
    decode_step_per_seq_seconds=0.00166,
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    startup_seconds=20.0,
)

PRESETS: dict[str, ReplicaModel] = {
    "h100-llama3-8b": ReplicaModel(),
    "cpu-smollm2-135m": replica_model_from(CPU_SMOLLM2_135M),
    "h200-llama3-8b": gpu_model_from(H200_LLAMA3_8B),
    "cpu-smollm2-135m-steps": CPU_STEP_FIT,
}
# The hardware profile of each preset: its default SLO targets (SLO_PROFILES).
PROFILES: dict[str, str] = {
    "h100-llama3-8b": "gpu",
    "cpu-smollm2-135m": "cpu",
    "h200-llama3-8b": "gpu",
    "cpu-smollm2-135m-steps": "cpu",
}
DEFAULT_PRESET = "h100-llama3-8b"


def preset(name: str) -> ReplicaModel:
    if name not in PRESETS:
        raise ValueError(
            f"replica model preset must be one of {', '.join(PRESETS)}; got {name!r}")
    return PRESETS[name]


def load_calibration(path: str | Path, base: ReplicaModel | None = None) -> ReplicaModel:
    """A replica model from a JSON calibration file (keys: ReplicaModel fields, any subset;
    the rest from ``base``). Raises ValueError naming the file and the bad key or value."""
    known = {f.name for f in fields(ReplicaModel)}
    try:
        data: Any = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"calibration file {path}: {exc}") from exc
    if isinstance(data, dict) and isinstance(data.get("replica_model"), dict):
        data = dict(data["replica_model"])
    if not isinstance(data, dict):
        raise ValueError(
            f"calibration file {path}: must be a JSON object; got {type(data).__name__}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"calibration file {path}: unknown keys {unknown}; allowed: {', '.join(sorted(known))}"
        )
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"calibration file {path}: {key} must be a number; got {value!r}")
        if key in _WHOLE and not float(value).is_integer():
            raise ValueError(f"calibration file {path}: {key} must be a whole number; got {value}")
        if key in _WHOLE:
            data[key] = int(value)
    return replace(base or ReplicaModel(), **data)


_WHOLE = ("kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens")
