"""Mechanical layering checks beyond import-linter's contracts (run by `make lint`):
the kernels package may import only the standard library, torch, triton and numpy."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvpilot"


def imported_roots(package: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for file in package.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                found.setdefault(n.split(".")[0], set()).add(str(file.relative_to(SRC)))
    return found


def test_kernels_import_only_stdlib_torch_triton_numpy():
    allowed = set(sys.stdlib_module_names) | {"torch", "triton", "numpy", "__future__"}
    roots = imported_roots(SRC / "kernels")
    bad = {k: v for k, v in roots.items() if k not in allowed}
    assert not bad, f"kernels import {bad}"


def test_cli_dispatch_does_not_import_torch():
    import subprocess

    code = "import sys, kvpilot.cli; kvpilot.cli.build_parser; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_operator_reads_model_uris_without_the_download_clients():
    """The operator image has no minio or oras: parsing s3:// and oci:// specs must not
    import them (only `kvpilot fetch-model`, in the engine image, does)."""
    import subprocess

    code = ("import sys, kvpilot.operator.spec as s;"
            " s.parse_spec({'model': {'uri': 's3://bucket/m'}});"
            " s.parse_spec({'model': {'uri': 'oci://r.io/m:v1'}});"
            " print(sorted(m for m in ('minio', 'oras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
