"""GPU nodes under a cluster autoscaler, for the fleet simulator.

Without a :class:`NodeModel` the simulator assumes a node is always free for a new pod
(pod start-up is all the wait). With one, every engine pod needs a slot on a node:

* a pod binds to a free slot of a ready node; else it preempts a placeholder pod there
  (placeholders run at a lower priority and go at once); else it is pending, and the
  cluster autoscaler asks for enough nodes for every pending pod, engine or placeholder,
  that the nodes already on their way do not cover. A node is ready
  ``startup_seconds`` after it was asked for; pending engines bind first (oldest first),
  then placeholders. The pod's own start-up (``ReplicaModel.startup_seconds``) begins
  when it binds.
* a node with no pod at all (no engine, no placeholder) for ``scale_down_seconds`` goes
  (the cluster autoscaler's ``--scale-down-unneeded-time``, 10 minutes by default). A node
  holding only placeholders stays: that is what they are for.
* every node is paid from the moment it is asked for until it goes (GPU-node hours).

Placeholders are counts per node, not objects: :meth:`NodePool.set_placeholders` keeps
the wanted number, bound or pending.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeModel:
    """Nodes of one GPU pool.

    Attributes:
        startup_seconds: a new node's request to Ready (VM, boot, driver, device plugin).
        pods_per_node: engine pods (or placeholders) one node holds.
        scale_down_seconds: how long a node stays empty before it is removed.
    """

    startup_seconds: float = 300.0
    pods_per_node: int = 1
    scale_down_seconds: float = 600.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.startup_seconds) and self.startup_seconds >= 0):
            raise ValueError(f"node startup_seconds must be finite and >= 0; got {self.startup_seconds!r}")
        if isinstance(self.pods_per_node, bool) or not isinstance(self.pods_per_node, int) or self.pods_per_node < 1:
            raise ValueError(f"pods_per_node must be an int >= 1; got {self.pods_per_node!r}")
        if not (math.isfinite(self.scale_down_seconds) and self.scale_down_seconds >= 0):
            raise ValueError(f"node scale_down_seconds must be finite and >= 0; got {self.scale_down_seconds!r}")


@dataclass
class Node:
    nid: int
    ready_at: float
    engines: set[int] = field(default_factory=set)  # replica ids bound here
    placeholders: int = 0
    empty_since: float | None = None

    def used(self) -> int:
        return len(self.engines) + self.placeholders


class NodePool:
    """The nodes, the pending pods and the node bill.

    Args:
        model: the node pool's shape.
        on_bound: called with ``(replica_id, time)`` when a pending engine pod binds (the
            fleet then starts its pod start-up).
        on_node_request: called with the ready time of each node asked for (the fleet
            schedules the event that calls :meth:`node_ready`).
        warmup_seconds: node time before this is not billed.
    """

    def __init__(self, model: NodeModel, on_bound: Callable[[int, float], None],
                 on_node_request: Callable[[Node], None], warmup_seconds: float = 0.0) -> None:
        self.model = model
        self.nodes: dict[int, Node] = {}
        self.pending_engines: deque[int] = deque()
        self.pending_placeholders = 0
        self.where: dict[int, int] = {}  # replica id -> node id
        self._on_bound = on_bound
        self._on_request = on_node_request
        self._next = 0
        self._warmup = warmup_seconds
        self._last = 0.0
        self.node_seconds = 0.0
        self.peak_nodes = 0
        self.nodes_requested = 0

    # -- billing -------------------------------------------------------------------------
    def _bill(self, now: float) -> None:
        start = max(self._last, self._warmup)
        if now > start:
            self.node_seconds += len(self.nodes) * (now - start)
        self._last = max(self._last, now)
        if now >= self._warmup:
            self.peak_nodes = max(self.peak_nodes, len(self.nodes))

    def close(self, now: float) -> None:
        """Bill up to ``now`` (the end of the run)."""
        self._bill(now)

    # -- nodes ---------------------------------------------------------------------------
    def add_ready_nodes(self, count: int, now: float) -> None:
        """Nodes that are there at the start."""
        self._bill(now)
        for _ in range(count):
            self.nodes[self._next] = Node(self._next, now, empty_since=now)
            self._next += 1

    def _free(self, node: Node) -> int:
        return self.model.pods_per_node - node.used()

    def _ready_nodes(self, now: float) -> list[Node]:
        return [n for n in self.nodes.values() if n.ready_at <= now]

    def _ensure_capacity(self, now: float) -> None:
        demand = len(self.pending_engines) + self.pending_placeholders
        coming = sum(self._free(n) for n in self.nodes.values() if n.ready_at > now)
        missing = demand - coming
        if missing <= 0:
            return
        self._bill(now)
        for _ in range(math.ceil(missing / self.model.pods_per_node)):
            node = Node(self._next, now + self.model.startup_seconds)
            self.nodes[node.nid] = node
            self._next += 1
            self.nodes_requested += 1
            self._on_request(node)

    def node_ready(self, node: Node, now: float) -> None:
        """A node asked for is Ready: bind what waits (engines first)."""
        if node.nid not in self.nodes:
            return
        self._fill(now)
        if node.used() == 0:
            node.empty_since = now

    def _fill(self, now: float) -> None:
        """Bind pending engines, then pending placeholders, to free ready slots."""
        for node in self._ready_nodes(now):
            while self.pending_engines and self._free(node) > 0:
                rid = self.pending_engines.popleft()
                self._bind(rid, node, now)
            while self.pending_placeholders and self._free(node) > 0:
                self.pending_placeholders -= 1
                node.placeholders += 1
                node.empty_since = None

    def _bind(self, rid: int, node: Node, now: float) -> None:
        node.engines.add(rid)
        node.empty_since = None
        self.where[rid] = node.nid
        self._on_bound(rid, now)

    # -- engine pods ---------------------------------------------------------------------
    def schedule_engine(self, rid: int, now: float) -> bool:
        """Place a new engine pod. True when it bound at once (then ``on_bound`` was
        called); False when it is pending (a node is on its way)."""
        ready = self._ready_nodes(now)
        for node in ready:
            if self._free(node) > 0:
                self._bind(rid, node, now)
                return True
        for node in ready:
            if node.placeholders > 0:  # preempt one: it goes pending and asks for a node
                node.placeholders -= 1
                self.pending_placeholders += 1
                self._bind(rid, node, now)
                self._ensure_capacity(now)
                return True
        self.pending_engines.append(rid)
        self._ensure_capacity(now)
        return False

    def release_engine(self, rid: int, now: float) -> None:
        """An engine pod went (drained, or cancelled while pending or starting)."""
        if rid in self.pending_engines:
            self.pending_engines.remove(rid)
            return
        nid = self.where.pop(rid, None)
        node = self.nodes.get(nid) if nid is not None else None
        if node is None:
            return
        node.engines.discard(rid)
        self._fill(now)
        if node.used() == 0:
            node.empty_since = now

    # -- placeholders --------------------------------------------------------------------
    @property
    def placeholders(self) -> int:
        return self.pending_placeholders + sum(n.placeholders for n in self.nodes.values())

    def set_placeholders(self, wanted: int, now: float) -> None:
        """Keep ``wanted`` placeholder pods: new ones bind to free slots or go pending
        (asking for nodes); extra ones go, pending ones first."""
        have = self.placeholders
        if wanted > have:
            self.pending_placeholders += wanted - have
            self._fill(now)
            self._ensure_capacity(now)
            return
        extra = have - wanted
        drop = min(extra, self.pending_placeholders)
        self.pending_placeholders -= drop
        extra -= drop
        for node in sorted(self.nodes.values(), key=lambda n: -n.nid):  # newest nodes first
            while extra and node.placeholders:
                node.placeholders -= 1
                extra -= 1
                if node.used() == 0:
                    node.empty_since = now

    # -- the cluster autoscaler's scale-down ---------------------------------------------
    def scale_down(self, now: float) -> None:
        """Remove ready nodes empty for ``scale_down_seconds``."""
        gone = [n for n in self.nodes.values() if n.ready_at <= now and n.used() == 0
                and n.empty_since is not None and now - n.empty_since >= self.model.scale_down_seconds]
        if gone:
            self._bill(now)
            for node in gone:
                del self.nodes[node.nid]
