"""What the simulator tests share: a policy that never moves and hand-written traces."""

from kvpilot.autoscaler.sim.traces import Request, Trace


class Fixed:
    """A policy that never moves: isolates the replica model or the routing."""

    name = "fixed"
    interval_seconds = 15.0

    def __init__(self, n):
        self.n = n

    def decide(self, now, ready, pending):
        return self.n


def one_request_trace(*requests, duration=600.0):
    """A trace of ``(arrival, prompt, output)`` tuples (one-off requests, nothing shared)."""
    return Trace("manual", "", duration, 1.0, 1, 1,
                 lambda: iter(Request(*r) for r in requests))
