"""Leader election over a coordination.k8s.io/v1 Lease, so several operator replicas can
run and exactly one acts.

The election itself is the kubernetes client's (``kubernetes.leaderelection`` with its
``LeaseLock``), the algorithm of client-go and controller-runtime: a candidate takes the
Lease when it is free or when its holder has not renewed it for ``lease_duration``
seconds (as observed by the candidate's own clock, so clock skew between nodes does not
matter); the leader renews every ``retry_period`` seconds and gives up after failing to
for ``renew_deadline`` seconds.

What kvpilot adds (:class:`LeaderElector`):

* the process waits for the Lease before it starts Kopf, so a follower watches nothing
  and writes nothing;
* a follower answers its liveness probe (``/healthz`` on the health port, ``{"leader":
  false}``) from a small stdlib HTTP server, shut down before Kopf binds that port;
* a leader that loses the Lease exits at once with status 1, as controller-runtime does
  (``on_lost``): two operators must never both act, and the kubelet restarts it as a
  follower;
* a leader that stops on SIGTERM (a rolling update, a drained node) releases the Lease,
  so the follower takes over at its next retry instead of after ``lease_duration``.

Takeover after a leader's death: at most ``lease_duration + retry_period`` seconds (17 s
with the defaults), then Kopf's start-up.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "kvpilot-operator"
# Each Lease read or write gives up after this long (then counts as a failed attempt).
REQUEST_TIMEOUT_SECONDS = 5
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class LeaderOptions:
    """Leader election settings.

    Attributes:
        lease_name: the Lease's name.
        namespace: where the Lease lives (the operator's own namespace).
        identity: this candidate (the pod name: unique, and readable in ``kubectl get
            lease``).
        lease_duration: seconds a follower waits, after it last saw the Lease renewed,
            before it takes over.
        renew_deadline: seconds the leader keeps retrying a failed renewal before it gives
            up (and exits).
        retry_period: seconds between attempts, for leader and followers.
    """

    lease_name: str
    namespace: str
    identity: str
    lease_duration: int = 15
    renew_deadline: int = 10
    retry_period: int = 2

    def __post_init__(self) -> None:
        if not self.lease_name or not self.namespace or not self.identity:
            raise ValueError(f"leader election needs a Lease name, a namespace and an identity; got "
                             f"name={self.lease_name!r} namespace={self.namespace!r} identity={self.identity!r}")
        # The client's own bounds (kubernetes.leaderelection.electionconfig, which would
        # sys.exit on them): checked here to fail with a message instead.
        if not (self.retry_period >= 1 and 1.2 * self.retry_period < self.renew_deadline < self.lease_duration):
            raise ValueError(f"leader election needs 1 <= retry_period ({self.retry_period}), 1.2 x retry_period "
                             f"< renew_deadline ({self.renew_deadline}) < lease_duration ({self.lease_duration})")


def default_namespace() -> str | None:
    """``POD_NAMESPACE`` (the chart sets it from the downward API), else the service
    account's namespace file, else None."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def default_identity() -> str:
    """``POD_NAME`` (the chart sets it), else host name and process id."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def _exit_lost() -> None:
    logger.error("lost the leader Lease: exiting so that only one operator acts (the kubelet restarts "
                 "this one as a follower)")
    logging.shutdown()
    os._exit(1)


class _FollowerHealth(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"leader": False}).encode()
        self.send_response(200 if self.path.split("?")[0] == "/healthz" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: quiet
        return


class _Refused:
    body = ""
    reason = "released: this candidate no longer takes part"


class _CallFailed:
    """A lock call that raised (what the client reads from a failed ``get``)."""

    body = ""

    def __init__(self, exc: BaseException) -> None:
        self.reason = f"{type(exc).__name__}: {exc}"


class _TimedApi:
    """The lock's CoordinationV1Api with a request timeout on every call: without one a
    hung connection blocks a renewal past ``renew_deadline``."""

    def __init__(self, api: Any, timeout: float) -> None:
        self._api, self._timeout = api, timeout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._api, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("_request_timeout", self._timeout)
            return attr(*args, **kwargs)
        return call


class _StoppableLock:
    """The resource lock, refusing every call once :meth:`stop` ran: the client's renew
    loop has no stop, and after a release it would take the Lease straight back.

    Every call that raises counts as a failed attempt, retried at the next period. The
    client's ``LeaseLock`` catches only ``ApiException``; a connection error (urllib3's
    ``MaxRetryError``, a timeout) would end the election thread, leaving a leader that
    never exits on a lost Lease and a follower that never takes over."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.stopped = False
        self.name, self.namespace, self.identity = inner.name, inner.namespace, inner.identity

    def stop(self) -> None:
        self.stopped = True

    def get(self, name: str, namespace: str) -> Any:
        if self.stopped:  # read by the client like an ApiException that is not a 404
            return False, _Refused()
        try:
            return self.inner.get(name, namespace)
        except Exception as exc:
            logger.warning("leader election: reading Lease %s/%s failed (%s: %s); retrying",
                           namespace, name, type(exc).__name__, exc)
            return False, _CallFailed(exc)

    def create(self, name: str, namespace: str, election_record: Any) -> bool:
        return False if self.stopped else self._write("creating", self.inner.create, name, namespace,
                                                      election_record)

    def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        return False if self.stopped else self._write("renewing", self.inner.update, name, namespace,
                                                      updated_record)

    def _write(self, what: str, call: Callable[..., Any], name: str, namespace: str, record: Any) -> bool:
        try:
            return bool(call(name, namespace, record))
        except Exception as exc:
            logger.warning("leader election: %s Lease %s/%s failed (%s: %s); retrying",
                           what, namespace, name, type(exc).__name__, exc)
            return False


class LeaderElector:
    """One candidate. :meth:`start` runs the election in a daemon thread; :meth:`wait`
    blocks until this process leads; :meth:`release` gives the Lease up.

    Args:
        options: the settings.
        on_lost: called (in the election thread) when the Lease is lost after it was
            held; the default logs and exits the process with status 1.
        on_leading_changed: called with True when leading starts (metrics).
        lock: the resource lock (default: the client's ``LeaseLock``; a fake in tests).
    """

    def __init__(self, options: LeaderOptions, on_lost: Callable[[], None] = _exit_lost,
                 on_leading_changed: Callable[[bool], None] | None = None, lock: Any = None) -> None:
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        self.options = options
        self.leading = threading.Event()
        self._on_lost = on_lost
        self._on_changed = on_leading_changed
        if lock is None:
            lock = LeaseLock(options.lease_name, options.namespace, options.identity)
            lock.api_instance = _TimedApi(lock.api_instance, REQUEST_TIMEOUT_SECONDS)
        self.lock = lock
        self._guard = _StoppableLock(self.lock)
        config = electionconfig.Config(
            self._guard, options.lease_duration, options.renew_deadline, options.retry_period,
            self._started, self._stopped)
        self._election = leaderelection.LeaderElection(config)
        self._thread: threading.Thread | None = None
        # The client logs every retry of a follower at INFO ("yet to finish lease_duration").
        logging.getLogger("leaderelection").setLevel(logging.WARNING)

    def _started(self) -> None:
        logger.info("%s leads (Lease %s/%s)", self.options.identity, self.options.namespace,
                    self.options.lease_name)
        self.leading.set()
        if self._on_changed:
            self._on_changed(True)

    def _stopped(self) -> None:
        was_leading = self.leading.is_set()
        self.leading.clear()
        if self._on_changed:
            self._on_changed(False)
        if was_leading:
            self._on_lost()

    def _run(self) -> None:
        """The client's election loop; if it ever raises, this candidate can no longer
        take part: on_lost (by default, exit 1 so the kubelet restarts a fresh one)."""
        try:
            self._election.run()
        except Exception:
            logger.exception("leader election stopped on an error")
            self.leading.clear()
            self._on_lost()

    def start(self) -> None:
        """Run the election in a daemon thread (returns at once)."""
        logger.info("%s waits for the leader Lease %s/%s", self.options.identity, self.options.namespace,
                    self.options.lease_name)
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this candidate leads (True) or ``timeout`` passes (False)."""
        return self.leading.wait(timeout)

    def release(self) -> bool:
        """Give the Lease up if this candidate holds it (holder cleared), so a follower takes
        over at its next retry. Returns whether it was released; errors are logged."""
        if not self.leading.is_set():
            return False
        self.leading.clear()  # from here on a failed renewal is not a loss
        self._guard.stop()  # and the election thread renews no more
        try:
            found, record = self.lock.get(self.options.lease_name, self.options.namespace)
            if not found or getattr(record, "holder_identity", None) != self.options.identity:
                return False
            lease = self.lock.lease_reference
            lease.spec.holder_identity = None
            self.lock.api_instance.replace_namespaced_lease(
                name=self.options.lease_name, namespace=self.options.namespace, body=lease)
        except Exception as exc:  # best effort: the Lease expires anyway
            logger.warning("could not release the leader Lease (a follower takes over when it expires): %s", exc)
            return False
        logger.info("%s released the leader Lease", self.options.identity)
        return True


class FollowerHealthServer:
    """``GET /healthz`` -> 200 ``{"leader": false}`` on ``port`` while this process
    follows (Kopf serves the port once it leads)."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        self._server = ThreadingHTTPServer((host, port), _FollowerHealth)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="follower-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
