"""benchmarks/gpu_check.py --smoke runs every section on CPU (Triton interpreter, tiny
shapes) and writes its results, so the script is known to work before the GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_smoke_run_passes_every_section_and_writes_results(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--timeout", "300"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["smoke"] and set(summary["sections"]) == {"env", "kernel_tests", "decode_bench", "decode_tune", "engine", "moe",
                                                            "lora", "quant_gemm"}
    assert all(r["ok"] for r in summary["sections"].values())
    tests = summary["sections"]["kernel_tests"]
    assert tests["failed"] == 0 and tests["passed"] >= 7
    assert any("fp4" in r["test"] or "int4" in r["test"] for r in tests["results"])
    rows = summary["sections"]["decode_bench"]["rows"]
    assert {r["kv_cache_dtype"] for r in rows} == {"bfloat16", "fp8_e4m3", "int4", "fp4_e2m1", "sdpa_contiguous_bf16"}
    assert all(r["finite"] for r in rows)
    # 4-bit reads 0.5625 B per value (group scales counted), bf16 2 B
    by = {r["kv_cache_dtype"]: r["kv_bytes"] for r in rows}
    assert by["bfloat16"] / by["fp4_e2m1"] == 16 / 4.5
    assert "| 2 x 40 | fp4_e2m1 |" in proc.stdout
    tune = summary["sections"]["decode_tune"]
    assert {p["kv_cache_dtype"] for p in tune["points"]} == {"bfloat16", "fp8_e4m3", "int4", "fp4_e2m1"}
    assert set(tune["best"]) == {f"2x40/{d}" for d in ("bfloat16", "fp8_e4m3", "int4", "fp4_e2m1")}
    engine = summary["sections"]["engine"]
    assert [r["kv_cache_dtype"] for r in engine["rows"]] == ["auto", "fp8_e4m3", "fp4_e2m1"]
    assert all(r["ok"] and r["output_tok_s"] > 0 for r in engine["rows"])
    # a 4-bit cache holds more tokens than the model-dtype one in the same memory
    cap = {r["kv_cache_dtype"]: r["kv_capacity_tokens"] for r in engine["rows"]}
    assert cap["fp4_e2m1"] > cap["fp8_e4m3"] > cap["auto"]
    lora = summary["sections"]["lora"]["rows"]
    assert [r["batch"] for r in lora] == ["decode 4 x 1"] * 2 + ["prefill 2 x 20"] * 2
    assert all(r["ok"] and r["delta_max_abs"] > 0 for r in lora)
    assert "| decode 4 x 1 | 64 x 80 | yes |" in proc.stdout


def test_a_section_past_the_deadline_is_reported_not_lost(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path), "--sections", "env",
                           "kernel_tests", "--deadline", "12"], capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert proc.returncode == 1
    section = summary["sections"]["kernel_tests"]
    assert not section["ok"] and ("timed out" in section["error"] or "deadline" in section["error"])

