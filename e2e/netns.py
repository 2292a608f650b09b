"""The network namespace the real-node e2e cluster lives in.

Every server of the suite (etcd, the control plane, Prometheus, containerd's streaming
server, the kubelet, kube-proxy, the pods) runs inside one network namespace created here
and deleted at the end, so nothing binds an address of the machine and every iptables
rule, bridge, route and sysctl the node sets up goes away with the namespace:

    host (tests, kubectl)                        namespace kvpilot-e2e-<pid>
    kvpe<pid> 10.250.0.1/30  <-- veth pair -->  eth0 10.250.0.2/30  (apiserver, kubelet, ...)
    routes 10.244.0.0/24, 10.96.0.0/16                cni0 10.244.0.1/24 --- pods 10.244.0.x
    via 10.250.0.2                                    (pods: no default route)

The host reaches pods and ClusterIP Services through the two routes (they leave with the
veth), its connections masqueraded to the bridge's address, so pods need no route to the
host. Pods reach only the node's address, their peers and Services. Processes are put in
the namespace with ``nsenter --net`` (not ``ip netns exec``, which would remount /sys and
hide the cgroup hierarchies the kubelet and runc need).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass

POD_CIDR = "10.244.0.0/24"
POD_GATEWAY = "10.244.0.1"
SERVICE_CIDR = "10.96.0.0/16"
LINK_HOST_IP = "10.250.0.1"
NODE_IP = "10.250.0.2"
LINK_PREFIX = 30


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


def _is_mount_point(path: str) -> bool:
    """From /proc/self/mountinfo: ``os.path.ismount`` misses a directory bind-mounted on
    itself (same device), which is what ``ip netns add`` makes of /run/netns."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


@dataclass
class NodeNetwork:
    """A created namespace and its link to the host; :meth:`delete` removes both."""

    name: str
    host_link: str
    # `ip netns add` turns /run/netns into a shared bind mount the first time; undone at
    # delete when this suite did it and no namespace is left in it.
    made_run_netns: bool = False

    @classmethod
    def create(cls, suffix: str | None = None) -> NodeNetwork:
        """Create the namespace, the veth pair, the addresses and the host's routes.

        Raises RuntimeError naming the ``ip`` command that failed; anything half-made is
        removed first."""
        suffix = suffix or str(os.getpid())
        net = cls(name=f"kvpilot-e2e-{suffix}", host_link=f"kvpe{suffix}"[:15])
        for conflict in (POD_CIDR, SERVICE_CIDR, f"{LINK_HOST_IP}/{LINK_PREFIX}"):
            routes = _ip("route", "show", "to", "match", conflict.split("/")[0]).stdout
            if any(line and not line.startswith("default") for line in routes.splitlines()):
                raise RuntimeError(f"the host already routes {conflict}: {routes.strip()} "
                                   "(a previous run left its namespace? ip netns list)")
        net.made_run_netns = not _is_mount_point("/run/netns")
        try:
            _ip("netns", "add", net.name)
            _ip("link", "add", net.host_link, "type", "veth", "peer", "name", "eth0",
                "netns", net.name)
            _ip("addr", "add", f"{LINK_HOST_IP}/{LINK_PREFIX}", "dev", net.host_link)
            _ip("link", "set", net.host_link, "up")
            _ip("link", "set", "lo", "up", netns=net.name)
            _ip("addr", "add", f"{NODE_IP}/{LINK_PREFIX}", "dev", "eth0", netns=net.name)
            _ip("link", "set", "eth0", "up", netns=net.name)
            # The pods' bridge, made here so its gateway address exists before any pod (the
            # CNI bridge plugin adopts a bridge of the configured name).
            _ip("link", "add", "cni0", "type", "bridge", netns=net.name)
            _ip("addr", "add", f"{POD_GATEWAY}/24", "dev", "cni0", netns=net.name)
            _ip("link", "set", "cni0", "up", netns=net.name)
            for cidr in (POD_CIDR, SERVICE_CIDR):
                _ip("route", "add", cidr, "via", NODE_IP, "dev", net.host_link)
            # Forwarding between eth0 and cni0 (host <-> pods), in this namespace only; the
            # host's connections to pod addresses leave with the bridge's address, so pods
            # need no route towards the host.
            net.run(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            net.run(["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{LINK_HOST_IP}/32",
                     "-o", "cni0", "-j", "MASQUERADE"])
        except Exception:
            net.delete()
            raise
        return net

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (network only; mounts and cgroups are shared)."""
        return ["nsenter", f"--net=/run/netns/{self.name}", "--", *argv]

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(self.wrap(argv), capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} (in {self.name}) failed: {result.stderr}")
        return result

    def delete(self) -> None:
        """Remove the namespace (its bridge, veth end, iptables rules and sysctls go with it)
        and the host's veth end (its routes go with it). Idempotent."""
        with contextlib.suppress(Exception):
            _ip("link", "del", self.host_link, check=False)
        _ip("netns", "del", self.name, check=False)
        run_netns = "/run/netns"
        if self.made_run_netns and _is_mount_point(run_netns) and not os.listdir(run_netns):
            subprocess.run(["umount", run_netns], capture_output=True, check=False)
            with contextlib.suppress(OSError):
                os.rmdir(run_netns)
