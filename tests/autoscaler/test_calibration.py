"""Replica-model presets and calibration files of the fleet simulator."""

import json

import pytest

from kvpilot.autoscaler.sim import ReplicaModel
from kvpilot.autoscaler.sim.calibration import (
    CPU_SMOLLM2_135M,
    DEFAULT_PRESET,
    PRESETS,
    load_calibration,
    preset,
    replica_model_from,
)
from kvpilot.cli import main


def test_cpu_preset_is_derived_from_the_engine_benchmarks():
    m = PRESETS["cpu-smollm2-135m"]
    # prefill: 34,816 prompt tokens in 78.126 s
    assert m.prefill_tokens_per_second == pytest.approx(445.6, abs=0.05)
    # a 64-request step: (98.044 s - 18,463 tokens / 445.6 tok/s) / 128 steps = 0.4423 s;
    # a 4-request step: 0.1301 s -> 5.2 ms per sequence on 109 ms
    assert m.decode_step_per_seq_seconds == pytest.approx(0.0052, abs=2e-5)
    assert m.decode_step_base_seconds == pytest.approx(0.1093, abs=2e-4)
    step64 = m.decode_step_base_seconds + 64 * m.decode_step_per_seq_seconds
    assert step64 == pytest.approx((98.044 - 18_463 / (34_816 / 78.126)) / 128, rel=1e-3)
    assert (m.kv_capacity_tokens, m.startup_seconds) == (23_296, 20.0)
    assert m == replica_model_from(CPU_SMOLLM2_135M)


def test_the_benchmark_default_stays_gpu_class():
    assert DEFAULT_PRESET == "h100-llama3-8b" and PRESETS[DEFAULT_PRESET] == ReplicaModel()
    with pytest.raises(ValueError, match="replica model preset must be one of"):
        preset("a100-mystery")


def test_measurements_that_make_no_model_are_refused():
    from dataclasses import replace

    with pytest.raises(ValueError, match="check the figures"):
        replica_model_from(replace(CPU_SMOLLM2_135M, large_batch_seconds=10.0))
    with pytest.raises(ValueError, match="must exceed small_batch"):
        replica_model_from(replace(CPU_SMOLLM2_135M, large_batch=4))


def test_calibration_file_overrides_the_preset(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"prefill_tokens_per_second": 900, "max_num_seqs": 64.0}))
    model = load_calibration(path, PRESETS["cpu-smollm2-135m"])
    assert model.prefill_tokens_per_second == 900 and model.max_num_seqs == 64
    assert model.kv_capacity_tokens == 23_296  # kept from the preset


@pytest.mark.parametrize("content,message", [
    ('{"prefil_tokens_per_second": 9}', "unknown keys ['prefil_tokens_per_second']; allowed:"),
    ('[1, 2]', "must be a JSON object; got list"),
    ('{"max_num_seqs": 1.5}', "max_num_seqs must be a whole number; got 1.5"),
    ('{"startup_seconds": "2m"}', "startup_seconds must be a number; got '2m'"),
    ('{nope', "calibration file"),
])
def test_bad_calibration_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "cal.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_calibration(path)


def test_simulate_with_the_cpu_preset_and_a_flag_override(tmp_path, capsys):
    """This run once failed: a replica's KV usage rounded to -2e-16 when its last request
    left, which the policy refuses as input."""
    out = tmp_path / "sim.json"
    assert main(["simulate", "--replica-model", "cpu-smollm2-135m", "--trace", "burst",
                 "--duration", "1800", "--warmup", "300", "--startup-seconds", "25",
                 "--json", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert model["kv_capacity_tokens"] == 23_296 and model["startup_seconds"] == 25
    assert "kvpilot" in capsys.readouterr().out


def test_simulate_reports_a_bad_calibration_file(tmp_path, capsys):
    path = tmp_path / "cal.json"
    path.write_text('{"kv_capacity": 5}')
    assert main(["simulate", "--calibration", str(path), "--duration", "600"]) == 2
    assert "unknown keys ['kv_capacity']" in capsys.readouterr().err
