"""Prebuilt CPU kernels (what the engine image ships): the ISA level a CPU gets, stale or
missing manifests refused with a log line, the torch fallback when nothing fits and no
compiler exists, and one real build loaded in a fresh process without compiling."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpilot.engine.attention.backend import resolve_backend_name
from kvpilot.kernels import cpu_attention

V4, V3 = cpu_attention.ISA_LEVELS
# An AVX-512 Xeon, a Haswell-class AVX2 CPU, and one older than both (SSE4.2 only).
AVX512 = V4.flags | {"sse4_2", "popcnt"}
AVX2 = V3.flags | {"sse4_2", "popcnt"}
SSE4 = frozenset({"sse4_2", "popcnt", "ssse3", "avx"})


def test_each_cpu_gets_the_best_level_it_runs():
    assert cpu_attention.pick_level(AVX512) is V4
    assert cpu_attention.pick_level(AVX2) is V3
    assert cpu_attention.pick_level(SSE4) is None
    # AVX-512F alone (no BW/VL, as on Knights Landing) is not x86-64-v4.
    assert cpu_attention.pick_level(AVX2 | {"avx512f", "avx512cd"}) is V3


def test_the_cpuinfo_flags_are_parsed(monkeypatch):
    monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda: "flags\t\t: fpu avx2 fma\n")
    assert cpu_attention.cpu_flag_set() == {"fpu", "avx2", "fma"}
    monkeypatch.setattr(cpu_attention, "_cpu_flags", lambda: "")
    assert cpu_attention.cpu_flag_set() == frozenset()


def _manifest(root: Path, **overrides: object) -> None:
    manifest = {"source": cpu_attention.source_hash(), "torch": torch.__version__,
                "levels": {"x86-64-v3": "x86-64-v3/kvpilot_cpu_attention.so"}}
    manifest.update(overrides)
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_from_another_torch_or_source_is_not_loaded(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvpilot.engine")
    _manifest(tmp_path / "a", torch="2.0.0")
    assert cpu_attention._load_prebuilt(tmp_path / "a") is None
    _manifest(tmp_path / "b", source="0" * 64)
    assert cpu_attention._load_prebuilt(tmp_path / "b") is None
    assert caplog.text.count("built from another source or torch") == 2
    assert cpu_attention._load_prebuilt(tmp_path / "missing") is None
    assert "no usable prebuilt CPU kernels" in caplog.text


def test_a_cpu_without_any_level_is_told_what_it_lacks(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="kvpilot.engine")
    _manifest(tmp_path)
    monkeypatch.setattr(cpu_attention, "cpu_flag_set", lambda: SSE4)
    assert cpu_attention._load_prebuilt(tmp_path) is None
    assert "none of them runs or loads here (x86-64-v3 needs " in caplog.text
    assert "avx2" in caplog.text and "fma" in caplog.text


@pytest.mark.parametrize("manifest", ["[]", '{"levels": []}', '{"levels": {"x86-64-v3": 3}}',
                                      "{not json"])
def test_a_malformed_manifest_is_logged_not_raised(tmp_path, caplog, manifest):
    caplog.set_level(logging.WARNING, logger="kvpilot.engine")
    (tmp_path / "manifest.json").write_text(manifest)
    assert cpu_attention._load_prebuilt(tmp_path) is None
    assert "no usable prebuilt CPU kernels" in caplog.text and "manifest.json" in caplog.text


def test_a_library_that_does_not_load_falls_to_the_next_level(tmp_path, monkeypatch, caplog):
    """A missing v4 file and a v3 file that is not a library: both logged, none raised."""
    caplog.set_level(logging.WARNING, logger="kvpilot.engine")
    _manifest(tmp_path, levels={"x86-64-v4": "x86-64-v4/missing.so", "x86-64-v3": "v3.so"})
    (tmp_path / "v3.so").write_text("not an ELF file")
    monkeypatch.setattr(cpu_attention, "cpu_flag_set", lambda: AVX512)
    assert cpu_attention._load_prebuilt(tmp_path) is None
    assert "prebuilt CPU kernels x86-64-v4" in caplog.text and "missing.so" in caplog.text
    assert "prebuilt CPU kernels x86-64-v3" in caplog.text and "did not load" in caplog.text


def test_nothing_prebuilt_fits_and_no_compiler_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    """The engine image without a fitting level: the torch backend, with a warning naming
    both reasons; the engine still starts."""
    caplog.set_level(logging.WARNING)
    _manifest(tmp_path)
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setattr(cpu_attention, "cpu_flag_set", lambda: SSE4)
    monkeypatch.setenv(cpu_attention.PREBUILT_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert "none of them runs or loads here" in caplog.text
    assert "no C++ compiler" in caplog.text and "falls back to the torch backend" in caplog.text


@pytest.mark.slow
def test_a_prebuilt_level_loads_in_a_fresh_process_without_compiling(tmp_path):
    """Build x86-64-v3 only (the image builds every level; one keeps this under a minute),
    then a new process with no compiler on PATH loads it and runs a decode that matches
    the torch reference, and WNA16 products (this level's AVX2 tiles) that match float64."""
    ok, why = cpu_attention.available()
    if not ok:
        pytest.skip(f"no C++ toolchain to build the kernels here: {why}")
    if not V3.flags <= cpu_attention.cpu_flag_set():
        pytest.skip("this CPU cannot run x86-64-v3 code")
    out = tmp_path / "kernels"
    built = cpu_attention.build_prebuilt(out, (V3,))
    assert built == {"x86-64-v3": "x86-64-v3/kvpilot_cpu_attention.so"}
    assert sorted(p.name for p in (out / "x86-64-v3").iterdir()) == ["kvpilot_cpu_attention.so"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == cpu_attention.source_hash()
    assert manifest["torch"] == torch.__version__
    assert "-march=x86-64-v3" in manifest["cflags"]["x86-64-v3"]
    script = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from kvpilot.kernels import cpu_attention, reference
torch.manual_seed(0)
q = torch.randn(2, 4, 64)
kc, vc = torch.randn(8, 16, 2, 64), torch.randn(8, 16, 2, 64)
bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
sl = torch.tensor([40, 7], dtype=torch.int32)
got = cpu_attention.paged_decode_attention(q, kc, vc, bt, sl, 0.125)
want = reference.paged_decode_attention(q, kc, vc, bt, sl, 0.125)
print("max-diff", float((got - want).abs().max()))
from kvpilot.kernels.cpu_quant_gemm import wna16_gemm  # the AVX2 tiles of this level
rels = []
for bits in (4, 8):
    codes = torch.randint(0, 1 << bits, (40, 256), dtype=torch.uint8)
    s, o = (torch.rand(40, 8) * 0.05 + 0.01).half(), -torch.rand(40, 8).half()
    w = (codes.double().view(40, 8, 32) * s.double()[..., None] + o.double()[..., None]).view(40, 256)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous() if bits == 4 else codes
    for m in (1, 2, 5, 11):
        x = torch.randn(m, 256)
        ref = x.double() @ w.T
        got = wna16_gemm(x, packed, s, o, bits, 32)
        rels.append(float((got.double() - ref).abs().max() / ref.abs().max()))
print("wna16-rel", float(torch.tensor(rels).max()))  # NaN stays NaN
"""
    env = {**os.environ, cpu_attention.PREBUILT_ENV: str(out), "CXX": "/nonexistent/c++",
           "KVPILOT_CACHE_DIR": str(tmp_path / "empty-cache")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CPU kernels: prebuilt x86-64-v3 from" in result.stdout
    assert float(result.stdout.split("max-diff")[1].split()[0]) < 1e-4
    assert float(result.stdout.split("wna16-rel")[1]) < 1e-5
    assert not (tmp_path / "empty-cache").exists()  # nothing was compiled
