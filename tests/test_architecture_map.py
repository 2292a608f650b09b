"""docs/architecture.md's module map names every module and package of src/kvpilot, so a
new file cannot land without a line saying what it owns."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvpilot"
MAP = (ROOT / "docs" / "architecture.md").read_text()
NAMED = set(re.findall(r"`([^`\s]+)`", MAP))


def test_every_module_is_in_the_map():
    missing = sorted(
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" and path.name not in NAMED
        and str(path.relative_to(PACKAGE)) not in NAMED
    )
    assert not missing, f"docs/architecture.md's module map does not name: {missing}"


def test_every_package_is_in_the_map():
    packages = sorted(str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py")
                      if p.parent != PACKAGE)
    text = MAP.replace("`", " ")
    missing = [p for p in packages if f"{p}/" not in text and f"{p.rsplit('/', 1)[-1]}/" not in text]
    assert not missing, f"docs/architecture.md's module map does not name the packages: {missing}"
