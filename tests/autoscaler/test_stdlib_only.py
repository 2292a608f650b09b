"""kvpilot.autoscaler imports only the standard library (and itself): the policy must run
anywhere, and the operator image must not grow for it."""

import ast
import sys
from pathlib import Path

import kvpilot.autoscaler

PACKAGE = Path(kvpilot.autoscaler.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported anywhere in the file (relative imports are in-package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module)
    return names


# Outside the package, only kvpilot.stats (the one percentile, shared with the benchmarks),
# itself standard library only: checked below and by an import-linter contract.
SHARED = {"kvpilot.stats"}


def allowed(module: str) -> bool:
    root = module.split(".")[0]
    if root == "kvpilot":
        return (module == "kvpilot.autoscaler" or module.startswith("kvpilot.autoscaler.")
                or module in SHARED)
    return root == "__future__" or root in sys.stdlib_module_names


def test_every_module_imports_only_the_standard_library():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) >= 10
    offenders = {
        str(p.relative_to(PACKAGE)): sorted(m for m in imported_modules(p) if not allowed(m))
        for p in modules
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_shared_modules_import_only_the_standard_library():
    import kvpilot.stats

    imported = imported_modules(Path(kvpilot.stats.__file__))
    assert {m for m in imported if m != "__future__" and m.split(".")[0] not in sys.stdlib_module_names} == set()


def test_the_check_would_catch_a_third_party_or_engine_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import numpy\nfrom kvpilot.engine import llm\ndef f():\n    import httpx\n")
    assert {m for m in imported_modules(bad) if not allowed(m)} == {
        "numpy",
        "kvpilot.engine",
        "httpx",
    }
