"""The import-linter contract that keeps the engine off its HTTP server names each engine
module and package (with ``kvpilot.engine`` as its source lint-imports lets imports of the
server through): a new engine module must join it, or it would be unchecked."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "src" / "kvpilot" / "engine"
NAME = "the engine outside engine/server never imports the server"


def test_every_engine_module_but_the_server_is_a_source():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == NAME]
    modules = {f"kvpilot.engine.{p.stem}" for p in ENGINE.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    assert set(contract["source_modules"]) == modules - {"kvpilot.engine.server"}
    assert contract["forbidden_modules"] == ["kvpilot.engine.server"]
