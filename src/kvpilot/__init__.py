"""kvpilot: a Kubernetes operator and autoscaler with its own paged-KV inference engine."""

__version__ = "0.1.0"
