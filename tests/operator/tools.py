"""The external binaries the chart and alert tests run (helm, promtool), found in the
repository's .tools/bin (installed by `make tools`, i.e. scripts/install-tools.sh) or on
PATH. A missing tool fails the test with the command that installs it: never a skip."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TOOLS_BIN = REPO / ".tools" / "bin"
CHART = REPO / "charts" / "kvpilot"
KUBE_VERSION = "1.36.0"
MONITORING_APIS = ("monitoring.coreos.com/v1/PrometheusRule", "monitoring.coreos.com/v1/PodMonitor")


def tool(name: str) -> str:
    local = TOOLS_BIN / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found in {TOOLS_BIN} or on PATH: run `make tools` "
                    "(scripts/install-tools.sh) first", pytrace=False)
    return found


def run(args: list[str], cwd: Path | None = None, check: bool = True,
        timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


def helm_template(values: list[Path] = (), apis: tuple[str, ...] = MONITORING_APIS,
                  sets: list[str] = (), release: str = "kvp",
                  namespace: str = "kvpilot-system") -> list[dict]:
    """`helm template --include-crds` of the chart; the rendered documents."""
    args = [tool("helm"), "template", release, str(CHART), "--namespace", namespace,
            "--include-crds", "--kube-version", KUBE_VERSION]
    for api in apis:
        args += ["--api-versions", api]
    for path in values:
        args += ["--values", str(path)]
    for item in sets:
        args += ["--set", item]
    out = run(args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]
