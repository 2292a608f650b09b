"""Scenario: children deleted or edited by hand come back within seconds, from their own
watch events, not at the next resync (60 s in this harness): the engine Deployment
deleted, its Service's port edited, its replica count changed with ``kubectl scale``, its
image edited. Each repair is timed and posted as a ChildRestored Event."""

from __future__ import annotations

import json
import time

from e2e.cluster import wait_seconds
from e2e.tests import helpers as h

NAME = "repair"
# A repair is a watch event plus one reconcile; the resync is 60 s here, so anything
# under this bound came from the watch.
RESTORE_WITHIN_SECONDS = 15.0


def _timed(cluster, what: str, predicate) -> float:
    start = time.monotonic()
    cluster.wait_for(predicate, 45, what, interval=0.25)
    seconds = time.monotonic() - start
    print(f"e2e repair: {what}: {seconds:.1f} s")
    return seconds


def test_deleted_and_edited_children_are_restored_within_seconds(cluster, namespace):
    # No pods: the scenario is about the objects, and the two-core node has other work.
    h.apply(cluster, namespace, h.small_infd(NAME, replicas=0, autoscaling=None))
    cluster.wait_for(lambda: h.deployment(cluster, namespace, NAME), 60, "the engine Deployment")
    cluster.wait_for(lambda: cluster.kubectl("get", "-n", namespace, "service", NAME, check=False)
                     .returncode == 0, 60, "the engine Service")
    # The reconcile that applied both has finished: their fingerprints are the operator's
    # own, so the edits below are someone else's.
    cluster.wait_for(lambda: h.reconciled(cluster, namespace, NAME), 60,
                     "the reconcile that applied them to finish")
    first = h.deployment(cluster, namespace, NAME)
    image = first["spec"]["template"]["spec"]["containers"][0]["image"]
    times = {}

    cluster.kubectl("delete", "-n", namespace, "deployment", NAME, "--wait=false")

    def recreated():
        dep = h.deployment(cluster, namespace, NAME)
        return dep if dep and dep["metadata"]["uid"] != first["metadata"]["uid"] else None

    times["deployment deleted"] = _timed(cluster, "the deleted Deployment recreated", recreated)

    # The target port, not the port: ports is a list keyed by port and protocol, and an
    # edit of a key adds an entry that server-side apply leaves to its writer (the
    # reconcile then reports ApplyFailed, docs/operator.md).
    cluster.kubectl("patch", "-n", namespace, "service", NAME, "--type=json", "-p",
                    json.dumps([{"op": "replace", "path": "/spec/ports/0/targetPort", "value": 9999}]))

    def port_back():
        svc = cluster.get_json("-n", namespace, "service", NAME)
        return svc["spec"]["ports"][0]["targetPort"] == "http"

    times["service edited"] = _timed(cluster, "the Service target port put back", port_back)

    wait_seconds(1.5)  # on purpose: past the first step of the per-owner back-off (1 s)
    cluster.kubectl("scale", "-n", namespace, "deployment", NAME, "--replicas=2")
    times["deployment scaled"] = _timed(
        cluster, "the manual scale reverted",
        lambda: h.deployment(cluster, namespace, NAME)["spec"]["replicas"] == 0)

    wait_seconds(2.5)  # on purpose: past the second step (2 s)
    cluster.kubectl("patch", "-n", namespace, "deployment", NAME, "--type=json", "-p",
                    json.dumps([{"op": "replace", "path": "/spec/template/spec/containers/0/image",
                                 "value": "example.invalid/not-kvpilot:1"}]))
    times["image edited"] = _timed(
        cluster, "the edited image put back",
        lambda: h.deployment(cluster, namespace, NAME)["spec"]["template"]["spec"]["containers"][0]
        ["image"] == image)

    slow = {k: v for k, v in times.items() if v > RESTORE_WITHIN_SECONDS}
    assert not slow, f"restored only after the resync, not from the watch: {slow} (all: {times})"
    reasons = [e["message"] for e in h.events(cluster, namespace, NAME) if e["reason"] == "ChildRestored"]
    assert any(m.startswith(f"Deployment {NAME} was deleted") for m in reasons), reasons
    assert any(m.startswith(f"Service {NAME} was changed") for m in reasons), reasons
