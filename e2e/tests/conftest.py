"""One cluster for the whole e2e session, stopped in the finalizer even when tests fail.

Scenario files are numbered: they run in order and share the cluster (starting it costs
seconds, an engine pod tens of seconds on two cores), each in its own namespace.
"""

from __future__ import annotations

import logging

import pytest

from e2e import procs
from e2e.cluster import Cluster


@pytest.fixture(scope="session")
def cluster():
    # SIGTERM/SIGHUP (a CI timeout, `kill`) unwind like Ctrl-C, so the finally below runs.
    procs.install_signal_handlers(interrupt=True)
    logging.getLogger("e2e").setLevel(logging.INFO)
    c = Cluster.create()
    try:
        c.start()
        yield c
    finally:
        c.stop()
        print(f"\ne2e: logs and state in {c.workdir}")


@pytest.fixture
def namespace(cluster, request):
    """A fresh namespace per test, deleted afterwards (its objects are garbage-collected)."""
    name = request.node.name.lower().replace("_", "-")[:40].strip("-")
    cluster.kubectl("create", "namespace", name)
    yield name
    delete_namespace(cluster, name)


def delete_namespace(cluster, name: str) -> None:
    """Delete the InferenceDeployments first and wait for them (the operator removes its
    finalizer and posts its last Events while the namespace still accepts them), then
    the namespace."""
    cluster.kubectl("delete", "-n", name, "inferencedeployments", "--all", "--timeout=120s",
                    check=False)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
