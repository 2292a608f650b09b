"""One cluster for the whole e2e session, stopped in the finalizer even when tests fail.

Scenario files are numbered: they run in order and share the cluster (starting it costs
seconds, an engine pod tens of seconds on two cores), each in its own namespace.

The images are built and imported by ``make e2e-images`` before pytest starts. Once the
cluster is up, one small engine fleet is started and its pod timed from scheduled to Ready:
that sets the session's pace (:mod:`e2e.pace`), which every wait's bound and every test's
pytest-timeout are multiplied by. A cluster that does not start ends the session with the
reason (one error, not one per scenario).
"""

from __future__ import annotations

import logging

import pytest

from e2e import pace, procs
from e2e.cluster import Cluster
from e2e.tests import helpers

# The pace probe's own bound: what it measures is unknown until it is done.
PACE_PROBE_BOUND_S = 600


def measure_pace(cluster: Cluster) -> float:
    """Start the small test fleet, return its engine pod's PodScheduled -> Ready seconds
    (the conditions' transition times, one-second resolution), and delete it."""
    ns = "e2e-pace"
    cluster.kubectl("create", "namespace", ns)
    try:
        helpers.apply(cluster, ns, helpers.small_infd("pace"))

        def ready_pod():
            pods = helpers.ready_pods(cluster, ns, "pace")
            return pods[0] if pods else None

        # Not yet measured: the factor is 1 (or the forced one).
        pod = cluster.wait_for(ready_pod, PACE_PROBE_BOUND_S,
                               "the pace probe's engine pod to be Ready")
        seconds = helpers.start_seconds(pod)
        assert seconds is not None, pod["status"]
        pace.PACE.pod_starts.append(("the pace probe, idle node", seconds))
        return seconds
    finally:
        delete_namespace(cluster, ns)


@pytest.fixture(scope="session")
def cluster():
    # SIGTERM/SIGHUP (a CI timeout, `kill`) unwind like Ctrl-C, so the finally below runs.
    procs.install_signal_handlers(interrupt=True)
    logging.getLogger("e2e").setLevel(logging.INFO)
    c = Cluster.create()
    try:
        try:
            c.start()
            pace.PACE.engine_start_s = measure_pace(c)
        except Exception as e:
            pytest.exit(f"e2e: the cluster did not start: {e}\n(logs in {c.workdir})",
                        returncode=3)
        print(f"\n{pace.PACE.summary().splitlines()[0]}")
        yield c
    finally:
        c.stop()
        pace.PACE.write(c.workdir / "waits.json")
        print(f"\ne2e: logs and state in {c.workdir}")


def pytest_configure(config: pytest.Config) -> None:
    """A forced pace (``KVPILOT_E2E_PACE``) is checked before anything starts."""
    try:
        pace.PACE = pace.from_env()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    pace.PACE.current_test = item.nodeid


def _base_timeout(item: pytest.Item) -> float | None:
    """The test's timeout before the pace: its own marker, else ``--timeout``, else the
    ini value (pytest-timeout's order; ``PYTEST_TIMEOUT`` is read by it into the option)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        return None if value is None else float(value)
    option = item.config.getoption("timeout", default=None)
    if option is not None:
        return float(option)
    ini = item.config.getini("timeout")
    return float(ini) if ini else None


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test's pytest-timeout, multiplied by the pace (pytest-timeout reads the
    closest marker in its own wrapper of this hook, which runs after this one). The first
    test's starts before the pace is measured: it runs at the value as set, which covers
    the cluster's start and the pace probe. 0 (no timeout) stays 0."""
    base = _base_timeout(item)
    if base and pace.PACE.factor != 1.0:
        item.add_marker(pytest.mark.timeout(base * pace.PACE.factor), append=False)
    yield


def pytest_terminal_summary(terminalreporter) -> None:
    if pace.PACE.waits:
        terminalreporter.write_line(pace.PACE.summary())


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
