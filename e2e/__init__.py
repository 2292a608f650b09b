"""End-to-end harness: a real Kubernetes control plane on loopback (see docs/e2e.md)."""
