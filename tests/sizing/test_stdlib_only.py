"""kvpilot.sizing imports only the standard library (and itself): the engine, the operator
and kv-calc all import it, so it must pull in none of their dependencies."""

from pathlib import Path

import kvpilot.sizing
from tests.autoscaler.test_stdlib_only import imported_modules

PACKAGE = Path(kvpilot.sizing.__file__).parent


def test_every_module_imports_only_the_standard_library():
    import sys

    def allowed(module: str) -> bool:
        root = module.split(".")[0]
        if root == "kvpilot":
            return module == "kvpilot.sizing" or module.startswith("kvpilot.sizing.")
        return root == "__future__" or root in sys.stdlib_module_names

    offenders = {
        p.name: sorted(m for m in imported_modules(p) if not allowed(m))
        for p in sorted(PACKAGE.rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
