"""Scenario: two operator replicas under the chart's leader election. Only the Lease
holder acts; when it dies without a word (its pod force-deleted, so it releases nothing),
another replica takes the Lease and serves a resource applied after the death, within
30 s. That replica is the waiting follower, or the pod the ReplicaSet starts in the dead
leader's place when it wins the race for a Lease the kubelet's SIGTERM made the leader
release (both are a takeover; CI saw the second). The operator is scaled back to one
replica afterwards."""

from __future__ import annotations

import time

from e2e.cluster import OPERATOR_NAMESPACE, OPERATOR_SELECTOR
from e2e.tests import helpers as h

LEASE = "kvpilot-operator"
TAKEOVER_WITHIN_SECONDS = 30.0


def _operator_deployment(cluster) -> str:
    return cluster.get_json("-n", OPERATOR_NAMESPACE, "deployment", "-l", OPERATOR_SELECTOR)[
        "items"][0]["metadata"]["name"]


def _ready_operator_pods(cluster) -> list[str]:
    pods = cluster.get_json("-n", OPERATOR_NAMESPACE, "pods", "-l", OPERATOR_SELECTOR)["items"]
    return sorted(p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")
                  and any(c["type"] == "Ready" and c["status"] == "True"
                          for c in p.get("status", {}).get("conditions", [])))


def _holder(cluster) -> str | None:
    lease = cluster.get_json("-n", OPERATOR_NAMESPACE, "lease", LEASE)
    return lease["spec"].get("holderIdentity")


def test_a_second_operator_takes_over_within_30_s(cluster, namespace):
    deployment = _operator_deployment(cluster)
    cluster.kubectl("scale", "deployment", "-n", OPERATOR_NAMESPACE, deployment, "--replicas=2")
    try:
        pods = cluster.wait_for(lambda: len(_ready_operator_pods(cluster)) == 2 and _ready_operator_pods(cluster),
                                180, "two ready operator pods (the follower answers /healthz)")
        leader = cluster.wait_for(lambda: _holder(cluster) in pods and _holder(cluster), 60, "a Lease holder")
        (follower,) = [p for p in pods if p != leader]
        follower_log = cluster.kubectl("logs", "-n", OPERATOR_NAMESPACE, follower).stdout
        assert "waits for the leader Lease" in follower_log
        assert "Initial authentication has finished" not in follower_log  # it watches nothing

        # The leader acts.
        h.apply(cluster, namespace, h.small_infd("ha-before", replicas=0, autoscaling=None))
        cluster.wait_for(lambda: h.deployment(cluster, namespace, "ha-before"), 60, "the leader's reconcile")

        # It dies: its pod is force-deleted (so the kubelet never restarts it in place,
        # where the same identity would take its Lease straight back) and its container
        # SIGKILLed through containerd, as a node loss or the OOM killer would, racing the
        # kubelet's own stop. A resource arrives right after.
        container = cluster.get_json("-n", OPERATOR_NAMESPACE, "pod", leader)["status"]["containerStatuses"][0]
        cluster.kubectl("delete", "pod", "-n", OPERATOR_NAMESPACE, leader, "--grace-period=0", "--force",
                        "--wait=false")
        died = time.monotonic()
        try:
            cluster.node.kill_task(container["containerID"].split("://", 1)[1])
        except Exception as exc:  # the kubelet stopped it first: a graceful stop then
            print(f"e2e operator HA: the kubelet stopped the leader first ({exc})")
        h.apply(cluster, namespace, h.small_infd("ha-after", replicas=0, autoscaling=None))
        cluster.wait_for(lambda: h.deployment(cluster, namespace, "ha-after"), 90,
                         "another replica to take over and reconcile")
        took = time.monotonic() - died
        print(f"e2e operator HA: takeover and first reconcile {took:.1f} s after the leader's death")
        holder = _holder(cluster)
        assert holder != leader, f"the dead leader {leader} still holds the Lease"
        # A replacement pod may lead before its readiness probe has passed once.
        cluster.wait_for(lambda: holder in _ready_operator_pods(cluster), 60,
                         f"the Lease holder {holder} to be a ready operator pod")
        print(f"e2e operator HA: {holder} took over "
              f"({'the follower' if holder == follower else 'the replacement pod'})")
        assert took <= TAKEOVER_WITHIN_SECONDS, f"took {took:.1f} s"
        # About 15-20 s when the SIGKILL came first (the Lease had to expire); a few
        # seconds when the kubelet's SIGTERM did (the leader released it).
    finally:
        cluster.kubectl("scale", "deployment", "-n", OPERATOR_NAMESPACE, deployment, "--replicas=1")
        cluster.wait_for(lambda: len(_ready_operator_pods(cluster)) == 1
                         and _holder(cluster) in _ready_operator_pods(cluster), 120,
                         "one operator pod again, holding the Lease")
