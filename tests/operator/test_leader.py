"""Leader election (kvpilot.operator.leader) over an in-memory Lease with the kubernetes
client's own election loop: one of two candidates leads, the other takes over when the
leader dies (the Lease expires) or at once when it releases the Lease; a leader that
cannot renew calls on_lost; bad settings and the follower's /healthz."""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.request

import pytest
import urllib3

from kvpilot.operator.leader import FollowerHealthServer, LeaderElector, LeaderOptions

pytestmark = pytest.mark.timeout(60)


class NotFound(Exception):
    body = json.dumps({"code": 404})
    reason = "Not Found"


class Unreachable(Exception):
    body = ""
    reason = "connection refused"


class Store:
    """One Lease, shared by the candidates' locks."""

    def __init__(self):
        self.record = None
        self.lock = threading.Lock()
        self.down = False  # the API server unreachable


class FakeLeaseLock:
    """The LeaseLock interface the client's election calls (get/create/update), plus what
    LeaderElector.release uses (lease_reference, api_instance)."""

    def __init__(self, store, identity):
        self.store, self.identity = store, identity
        self.name, self.namespace = "kvpilot-operator", "kvpilot-system"
        self.lease_reference = None
        self.api_instance = self
        self.alive = True  # False: this candidate's process is dead (stops talking)

    def get(self, name, namespace):
        if self.store.down or not self.alive:
            return False, Unreachable()
        with self.store.lock:
            if self.store.record is None:
                return False, NotFound()
            record = copy.copy(self.store.record)
        self.lease_reference = type("Lease", (), {"spec": type("Spec", (), {"holder_identity": record.holder_identity})()})()
        return True, record

    def create(self, name, namespace, election_record):
        if self.store.down or not self.alive:
            return False
        with self.store.lock:
            if self.store.record is not None:
                return False
            self.store.record = copy.copy(election_record)
        return True

    def update(self, name, namespace, updated_record):
        if self.store.down or not self.alive:
            return False
        with self.store.lock:
            self.store.record = copy.copy(updated_record)
        return True

    def replace_namespaced_lease(self, name, namespace, body):  # release: clear the holder
        with self.store.lock:
            self.store.record.holder_identity = body.spec.holder_identity


FAST = {"lease_duration": 3, "renew_deadline": 2, "retry_period": 1}


def candidate(store, identity, **kw):
    lost = threading.Event()
    elector = LeaderElector(LeaderOptions("kvpilot-operator", "kvpilot-system", identity, **FAST),
                            on_lost=lost.set, lock=FakeLeaseLock(store, identity), **kw)
    elector.start()
    return elector, lost


def test_one_leads_and_the_other_takes_over_when_it_dies():
    store = Store()
    a, _ = candidate(store, "a")
    assert a.wait(5)
    b, _ = candidate(store, "b")
    assert not b.wait(4)  # a renews: b follows
    assert store.record.holder_identity == "a"
    a.lock.alive = False  # a's process dies: no more renewals, no release
    died = time.monotonic()
    assert b.wait(10)
    took = time.monotonic() - died
    assert store.record.holder_identity == "b"
    # at most the Lease duration plus one retry (and a jitter of the client's loop)
    assert took <= FAST["lease_duration"] + 2 * FAST["retry_period"] + 1, took


def test_a_released_lease_is_taken_at_the_next_retry_and_not_taken_back():
    store = Store()
    changes = []
    a, lost = candidate(store, "a", on_leading_changed=changes.append)
    assert a.wait(5)
    b, _ = candidate(store, "b")
    time.sleep(1.5)
    assert a.release()
    released = time.monotonic()
    assert b.wait(5)
    assert time.monotonic() - released < FAST["lease_duration"]  # not an expiry: the release
    time.sleep(3)
    assert store.record.holder_identity == "b"  # a's election thread did not take it back
    assert not lost.is_set()  # releasing is not losing
    assert changes[0] is True


def test_a_leader_that_cannot_renew_calls_on_lost():
    store = Store()
    a, lost = candidate(store, "a")
    assert a.wait(5)
    store.down = True
    assert lost.wait(10)
    assert not a.leading.is_set()


class RaisingLeaseLock(FakeLeaseLock):
    """As the client's LeaseLock behaves when the API server cannot be reached: it
    catches only ApiException, so a connection error raises out of get/create/update."""

    def _check(self):
        if self.store.down:
            raise urllib3.exceptions.MaxRetryError(None, "/apis/coordination.k8s.io/v1", "Connection refused")

    def get(self, name, namespace):
        self._check()
        return super().get(name, namespace)

    def create(self, name, namespace, election_record):
        self._check()
        return super().create(name, namespace, election_record)

    def update(self, name, namespace, updated_record):
        self._check()
        return super().update(name, namespace, updated_record)


def raising_candidate(store, identity):
    lost = threading.Event()
    elector = LeaderElector(LeaderOptions("kvpilot-operator", "kvpilot-system", identity, **FAST),
                            on_lost=lost.set, lock=RaisingLeaseLock(store, identity))
    elector.start()
    return elector, lost


def test_connection_errors_are_failed_attempts_not_a_dead_election():
    """Found by a fresh-user trial: a MaxRetryError ended the election thread, so a leader
    cut off from the API server never exited (two leaders once the other took over) and
    a follower started during an outage never took part."""
    store = Store()
    store.down = True
    b, b_lost = raising_candidate(store, "b")  # starts while the API server is away
    time.sleep(2.5)
    assert b._thread.is_alive() and not b.leading.is_set()
    store.down = False
    assert b.wait(5)  # it kept retrying
    store.down = True  # now the leader is cut off
    assert b_lost.wait(10), "the leader kept acting without its Lease"
    assert not b.leading.is_set()


def test_bad_settings_are_refused_with_the_values():
    with pytest.raises(ValueError, match="needs a Lease name, a namespace and an identity"):
        LeaderOptions("kvpilot-operator", "", "pod-1")
    with pytest.raises(ValueError, match=r"renew_deadline \(15\) < lease_duration \(15\)"):
        LeaderOptions("kvpilot-operator", "ns", "pod-1", lease_duration=15, renew_deadline=15)
    with pytest.raises(ValueError, match=r"1 <= retry_period \(0\)"):
        LeaderOptions("kvpilot-operator", "ns", "pod-1", retry_period=0)


def test_the_follower_answers_its_liveness_probe_and_frees_the_port():
    health = FollowerHealthServer(0, host="127.0.0.1")
    url = f"http://127.0.0.1:{health.port}/healthz"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200 and json.load(response) == {"leader": False}
    port = health.port
    health.close()
    again = FollowerHealthServer(port, host="127.0.0.1")  # what Kopf does next: bind it
    again.close()
