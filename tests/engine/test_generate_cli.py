"""`kvpilot generate` end to end in a subprocess: real text from the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def kvpilot(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_prints_paris():
    out = kvpilot("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0", "--json")
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["text"].startswith(" Paris.")
    assert line["finish_reason"] == "length" and len(line["token_ids"]) == 8


def test_generate_rejects_bad_flags_with_a_clear_message():
    out = kvpilot("generate", "--prompt", "x", "--temperature", "-1")
    assert out.returncode == 2
    assert "temperature must be >= 0, got -1.0" in out.stderr
    out = kvpilot("generate", "--prompt", "x", "--model", "/nonexistent/model.gguf")
    assert out.returncode == 2
    assert out.stderr.startswith("kvpilot generate: model '/nonexistent/model.gguf' not found")
    assert "Traceback" not in out.stderr
