"""``kvpilot operator``: run the Kopf operator for InferenceDeployment resources.

Flags (each also read from the environment variable in brackets, as the Helm chart sets):

  --namespace NS            watch only NS; repeatable (default: the whole cluster)
  --engine-image IMAGE      default engine image  [KVPILOT_ENGINE_IMAGE]
  --router-image IMAGE      default request-router image (vllm-router)  [KVPILOT_ROUTER_IMAGE]
  --pod-monitor MODE        auto | always | never  [KVPILOT_POD_MONITOR]
  --pod-monitor-label K=V   a label on every engine PodMonitor; repeatable
  --resync-seconds S        period of the drift-repair reconcile (default 300)
  --metrics-port P          operator metrics on 0.0.0.0:P/metrics (0 = off; default 9090)
  --health-port P           Kopf liveness probe on 0.0.0.0:P/healthz (0 = off; default 8080)
  --log-level LEVEL         DEBUG | INFO | WARNING | ERROR (default INFO)
  --log-format FORMAT       text | json: every line about an InferenceDeployment names its
                            namespace and name (``[ns/name]``, or JSON ``object``)
                            [KVPILOT_LOG_FORMAT]
  --headroom-priority-class PriorityClass of node-headroom placeholder pods (default
                            kvpilot-headroom)  [KVPILOT_HEADROOM_PRIORITY_CLASS]
  --leader-elect            wait for the Lease --leader-election-id before acting, so several
                            replicas can run and one acts (:mod:`kvpilot.operator.leader`)
                            [KVPILOT_LEADER_ELECT=true]
  --leader-election-id NAME the Lease (default kvpilot-operator), in the operator's namespace
                            [POD_NAMESPACE, else the service account's]; identity [POD_NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import TYPE_CHECKING, Any

from kvpilot.operator.logs import LOG_FORMATS, LOG_LEVELS, configure_logging
from kvpilot.operator.options import POD_MONITOR_MODES, OperatorOptions
from kvpilot.operator.spec.fields import is_dns_subdomain

if TYPE_CHECKING:
    from kvpilot.operator.handlers.context import OperatorContext


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = OperatorOptions()
    parser.add_argument("--namespace", action="append", default=[], dest="namespaces",
                        help="namespace to watch (repeatable); default: all namespaces")
    parser.add_argument("--engine-image", default=os.environ.get("KVPILOT_ENGINE_IMAGE",
                                                                 d.engine_image),
                        help=f"engine image when a spec sets none (default {d.engine_image})")
    parser.add_argument("--router-image", default=os.environ.get("KVPILOT_ROUTER_IMAGE",
                                                                 d.router_image),
                        help="request-router image when a spec sets no router.image"
                             f" (default {d.router_image})")
    parser.add_argument("--pod-monitor", choices=POD_MONITOR_MODES,
                        default=os.environ.get("KVPILOT_POD_MONITOR", d.pod_monitor),
                        help="create PodMonitors: auto = when the Prometheus operator's API exists")
    parser.add_argument("--pod-monitor-label", action="append", default=[], metavar="KEY=VALUE",
                        dest="pod_monitor_labels", type=_label,
                        help="label every engine PodMonitor (repeatable), e.g. release=kps for"
                             " a kube-prometheus-stack Prometheus that selects by it")
    parser.add_argument("--resync-seconds", type=float, default=d.resync_seconds,
                        help="period of the drift-repair reconcile")
    parser.add_argument("--metrics-port", type=_port, default=9090,
                        help="port of the operator's /metrics (0 = off)")
    parser.add_argument("--health-port", type=_port, default=8080,
                        help="port of the liveness endpoint /healthz (0 = off)")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    parser.add_argument("--log-format", choices=LOG_FORMATS,
                        default=os.environ.get("KVPILOT_LOG_FORMAT", "text"),
                        help="text: [time] logger [LEVEL] [namespace/name] message; json: one object"
                             " per line with the resource under 'object'")


    parser.add_argument("--headroom-priority-class",
                        default=os.environ.get("KVPILOT_HEADROOM_PRIORITY_CLASS", d.headroom_priority_class),
                        help="PriorityClass of node-headroom placeholder pods (below the engines')")
    parser.add_argument("--leader-elect", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="act only while holding the leader Lease (run several replicas);"
                             " default: KVPILOT_LEADER_ELECT")
    parser.add_argument("--leader-election-id", default="kvpilot-operator", type=_lease_name,
                        help="name of the leader Lease in the operator's namespace")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _env_bool(name: str) -> bool:
    """A boolean environment variable; anything but the usual spellings is refused by name
    (``KVPILOT_LEADER_ELECT=enabled`` silently meaning off would run two leaders)."""
    value = os.environ.get(name, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise SystemExit(f"kvpilot operator: {name}={os.environ[name]!r}: use one of "
                         f"{', '.join(_TRUE)} (on) or {', '.join(v for v in _FALSE if v)} (off)")
    return value in _TRUE


def wants_leader_election(args: argparse.Namespace) -> bool:
    """``--[no-]leader-elect``, else ``KVPILOT_LEADER_ELECT``. Raises SystemExit naming
    an environment value that is neither on nor off."""
    return bool(args.leader_elect) if args.leader_elect is not None else _env_bool("KVPILOT_LEADER_ELECT")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port 1-65535, or 0 for off; got {text!r}")
    return port


def _lease_name(text: str) -> str:
    if not is_dns_subdomain(text):
        raise argparse.ArgumentTypeError(f"a Lease name (a DNS-1123 subdomain: lowercase letters, digits,"
                                         f" '-' and '.'); got {text!r}")
    return text


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"a label is KEY=VALUE; got {text!r}")
    return key, value


def options_from_args(args: argparse.Namespace) -> OperatorOptions:
    """The frozen options; raises ValueError naming a bad flag value."""
    return OperatorOptions(
        engine_image=args.engine_image,
        router_image=args.router_image,
        pod_monitor=args.pod_monitor,
        resync_seconds=args.resync_seconds,
        namespaces=tuple(args.namespaces),
        pod_monitor_labels=tuple(args.pod_monitor_labels),
        headroom_priority_class=args.headroom_priority_class,
    )


def run(args: argparse.Namespace) -> int:
    # Imported here so `kvpilot --help` stays fast and import errors name the extra.
    try:
        import kopf  # noqa: F401
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise SystemExit(f"kvpilot operator needs the operator extra: pip install "
                         f"'kvpilot[operator]' ({exc})") from exc

    from kvpilot.operator.handlers.context import OperatorContext
    from kvpilot.operator.kube import KubernetesApi
    from kvpilot.operator.metrics import OperatorMetrics

    try:
        configure_logging(args.log_level, args.log_format)
    except ValueError as exc:  # KVPILOT_LOG_FORMAT bypasses argparse's choices
        raise SystemExit(f"kvpilot operator: {exc}") from exc
    try:
        options = options_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"kvpilot operator: {exc}") from exc
    leader_elect = wants_leader_election(args)
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config()
        except (k8s_config.ConfigException, OSError) as exc:
            raise SystemExit(
                "kvpilot operator: no Kubernetes configuration: neither an in-cluster service"
                f" account nor a kubeconfig (KUBECONFIG or ~/.kube/config) was usable: {exc}"
            ) from exc
    metrics = OperatorMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    context = OperatorContext(api=KubernetesApi(k8s.ApiClient()), options=options, metrics=metrics)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    elector = _lead(args, metrics) if leader_elect else None
    try:
        asyncio.run(operate(context, liveness_endpoint=liveness))
    finally:
        if elector is not None:
            elector.release()  # a stop (SIGTERM) hands over at once, not after the Lease expires
    return 0


def _lead(args: argparse.Namespace, metrics: Any) -> Any:
    """Wait, serving the follower's /healthz, until this process holds the leader Lease.
    Returns the elector (to release the Lease on exit). Raises SystemExit on bad settings."""
    from kvpilot.operator.leader import (
        DEFAULT_LEASE_NAME,
        FollowerHealthServer,
        LeaderElector,
        LeaderOptions,
        default_identity,
        default_namespace,
    )

    namespace = default_namespace()
    if namespace is None:
        raise SystemExit("kvpilot operator: --leader-elect needs the operator's namespace: set POD_NAMESPACE "
                         "(the chart does) or run in a pod")
    try:
        options = LeaderOptions(args.leader_election_id or DEFAULT_LEASE_NAME, namespace, default_identity())
    except ValueError as exc:
        raise SystemExit(f"kvpilot operator: {exc}") from exc
    metrics.set_leader(False)
    health = FollowerHealthServer(args.health_port) if args.health_port else None
    elector = LeaderElector(options, on_leading_changed=metrics.set_leader)
    elector.start()
    elector.wait()
    if health is not None:
        health.close()  # Kopf serves /healthz from here on
    return elector


async def operate(context: OperatorContext, *, liveness_endpoint: str | None = None,
                  stop_flag: Any = None, ready_flag: Any = None) -> None:
    """Run Kopf with our handlers until ``stop_flag`` is set (or forever).

    Kopf logs in by itself (in-cluster token or kubeconfig, through the kubernetes
    client); ``context.api`` is the operator's own client for applying children.
    """
    import kopf

    from kvpilot.operator.registration import register

    registry = kopf.OperatorRegistry()
    register(registry, context.options)
    namespaces = context.options.namespaces
    await kopf.operator(
        registry=registry,
        memo=context,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness_endpoint,
        standalone=True,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
